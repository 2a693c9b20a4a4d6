"""RefitConfig: defaults, environment overrides, clear errors for nonsense."""

from __future__ import annotations

import os

import pytest

from common.config import RefitConfig, RefitConfigError


def test_env_overrides_and_explicit_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_BUCKET_BYTES", str(1 << 20))
    monkeypatch.setenv("REFIT_NUM_BUFFERS", "3")
    monkeypatch.setenv("REFIT_TIMEOUT_S", "12.5")
    monkeypatch.setenv("REFIT_CHECKSUM", "yes")
    monkeypatch.setenv("REFIT_GRAPH_SEND", "on")
    c = RefitConfig.from_env()
    assert (c.bucket_bytes, c.num_buffers, c.timeout_s, c.checksum) == (1 << 20, 3, 12.5, True)
    assert c.graph_send is True
    monkeypatch.setenv("REFIT_CHECKSUM", "0")
    assert RefitConfig.from_env().checksum is False
    assert RefitConfig.from_env(num_buffers=1).num_buffers == 1


@pytest.mark.parametrize(
    "env,value,fragment",
    [
        ("REFIT_BUCKET_BYTES", "lots", "REFIT_BUCKET_BYTES='lots' is not a valid int"),
        ("REFIT_BUCKET_BYTES", "12", "bucket_bytes=12: must be at least 1024"),
        ("REFIT_NUM_BUFFERS", "0", "num_buffers=0: must be >= 1"),
        ("REFIT_TIMEOUT_S", "-1", "timeout_s=-1.0: must be a positive"),
        ("REFIT_TIMEOUT_S", "nan", "timeout_s=nan: must be a positive"),
        ("REFIT_ALIGNMENT", "48", "alignment=48: must be a power of two"),
        ("REFIT_CHECKSUM", "maybe", "REFIT_CHECKSUM='maybe' is not a valid boolean"),
    ],
)
def test_nonsense_values_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, fragment: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(RefitConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        RefitConfig.from_env()


def test_wrong_types_and_unknown_fields() -> None:
    with pytest.raises(RefitConfigError, match="num_buffers=2.0: must be an int"):
        RefitConfig(num_buffers=2.0)  # type: ignore[arg-type]
    with pytest.raises(RefitConfigError, match="unknown RefitConfig fields"):
        RefitConfig.from_env(bucket_size=5)


def test_graph_send_on_a_gloo_group_sends_eagerly() -> None:
    """`graph_send` (on by default) asks for CUDA graph replays; a CPU (gloo) group has none
    to capture, so the sender keeps no graphs and its refit lands as without it."""
    import torch

    from common.plan import RefitPlan
    from common.source import DictWeightSource
    from common.transfer.sender import RefitSender
    from common.wire.group import RefitGroup, free_port

    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=30, device="cpu")
    try:
        source = DictWeightSource({f"w{i}": torch.full((256,), float(i)) for i in range(8)})
        config = RefitConfig(bucket_bytes=2048, timeout_s=30)
        assert config.graph_send is True
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        assert sender.plan.config.graph_send and not group.captures_broadcasts
        assert sender.graphs is None
        assert sender.refit(source, 1).num_buckets == len(sender.plan.buckets)
    finally:
        group.destroy()


def test_a_cpu_server_of_several_workers_gives_each_its_own_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing is set (the suite sets "nobind"), a TP x DP server's workers get
    `cpu_bind_mask`'s cores ([DP, PP, TP] order, wrapping around); a value set is kept."""
    from common.clients.serve import ServeConfig
    from common.engine.config import cpu_bind_mask

    cores = sorted(os.sched_getaffinity(0))
    assert cpu_bind_mask(2, 1) == f"{cores[0]}|{cores[1 % len(cores)]}"
    assert cpu_bind_mask(1, 2) == f"{cores[0]},{cores[1 % len(cores)]}"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ServeConfig(model="m").env()
    four = ServeConfig(model="m", tensor_parallel_size=2, data_parallel_size=2).env()
    assert four["VLLM_CPU_OMP_THREADS_BIND"] == cpu_bind_mask(4, 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert ServeConfig(model="m", tensor_parallel_size=2).env()["VLLM_CPU_OMP_THREADS_BIND"] \
        == "nobind"
