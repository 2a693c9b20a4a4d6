"""Direct apply against vLLM's own loaders, on one refit group: two engines of one model, one
applying refits directly (the learned load map), one through `load_weights` every refit.

Both receive the same bytes; after every refit their readable params must be equal bit for bit
(prepacked fused experts and MLA's derived weights included) and equal to the trainer's
tensors, and their greedy tokens and logprobs equal (this also covers the linear weights vLLM's
CPU kernels keep only inside oneDNN, which no param exposes). Small buckets make layers
straddle buckets. A direct refit that fails midway leaves the engine refusing to serve until
a complete refit lands.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from common.clients.engine_client import EngineError
from common.clients.local_engine import LocalEngine
from common.errors import RefitError
from recipes.vllm_checks import compare_params, vllm_layout
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint
from tests.dtensor_vllm.helpers import (
    PROMPTS,
    DriftAt,
    engine_config,
    greedy,
    join_one_trainer,
    new_version,
)

pytestmark = pytest.mark.slow
ARCHS = ("qwen3", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(trainer, direct engine, load_weights engine, the trainer's state) for one model."""
    start = initial_checkpoint(Case(request.param, dp=2), tmp_path_factory.mktemp(request.param))
    state = load_file(f"{start}/model.safetensors")
    configs = [engine_config(start), engine_config(start)]
    engines = [LocalEngine(configs[0]),
               LocalEngine(type(configs[1])(**{**configs[1].__dict__, "apply": "load_weights"}))]
    try:
        trainer = join_one_trainer(engines, state, bucket_bytes=16 << 10)
        yield request.param, trainer, engines, state
        trainer.group.destroy()
    finally:
        for engine in engines:
            engine.close()


def _assert_same_engines(engines, state) -> None:
    direct, loaders = (e.read() for e in engines)
    assert sorted(direct) == sorted(loaders)
    differ = [n for n in direct if not torch.equal(direct[n].contiguous().view(torch.uint8),
                                                   loaders[n].contiguous().view(torch.uint8))]
    assert differ == [], f"direct apply and load_weights differ in {differ}"
    assert compare_params(direct, vllm_layout(state)) >= 4
    assert greedy(engines[0], PROMPTS, 6) == greedy(engines[1], PROMPTS, 6)


def test_direct_refits_equal_load_weights_bit_for_bit(pair) -> None:
    arch, trainer, engines, state = pair
    for version in (1, 2, 3):  # 1 learns the map (through load_weights), 2 and 3 apply it
        new_version(state, version)
        trainer.refit(version)
        _assert_same_engines(engines, state)
    (report,) = engines[0].apply_reports()
    assert report["path"] == "direct" and report["unloaded_tensors"] == 0, report
    assert report["verified"] >= 4, f"the map was not checked against the loaders: {report}"
    share = report["direct_bytes"] / report["total_bytes"]
    assert share >= 0.9, f"{arch}: only {share:.1%} of the bytes applied directly: {report}"
    if arch != "deepseek_v3":  # its fp32 router bias is loaded into a live tensor: loaders
        assert report["fallback_tensors"] == 0, report
    # what each refit reopens of vLLM's reload (every processed layer), and where its time went
    assert sum(report["reopened"].values()) >= report["layers"].get("process", 0) > 0, report
    # an attention layer is reopened only for a layer it holds (MLA's kv_b_proj), not for the
    # scale buffers vLLM records of every attention layer
    attention = {k for k in report["reopened"] if k.endswith("Attention")}
    assert attention == ({"MLAAttention"} if arch == "deepseek_v3" else set()), report
    assert {"begin_s", "copy_s", "finalize_s", "fixes_s", "check_s"} <= report["last_refit"].keys()
    assert engines[1].apply_reports() == [{"path": "load_weights", "needs_reported": False}]


def test_a_direct_refit_failing_midway_refuses_to_serve_until_one_lands(pair) -> None:
    arch, trainer, engines, state = pair
    if arch != "qwen3_moe":
        pytest.skip("one model is enough for the engine-state rules")
    version = int(engines[0].weight_version()) + 1
    new_version(state, 100 + version)
    late = list(state)[-2]  # buckets before it are already applied when the sender aborts
    with pytest.raises(Exception, match=late.replace(".", r"\.")):
        trainer.fleet.refit(lambda: trainer.sender.refit(DriftAt(state, late), version),
                            version, "keep")
    for engine in engines:
        assert engine.failed is not None and engine.failed[0] == version
        with pytest.raises(EngineError, match=f"(?s)refusing to serve.*v{version} failed"):
            engine.generate([[1, 2, 3]], 2)
    trainer.refit(version + 1)
    _assert_same_engines(engines, state)
    assert engines[0].apply_reports()[0]["path"] == "direct"


def test_verify_passes_on_the_weights_the_engines_hold_and_names_a_param_they_do_not(pair):
    """verify: the trainer resends the version the engines hold; a norm weight changed on
    the trainer's side since then fails it on both engines, naming that param."""
    arch, trainer, engines, state = pair
    if arch != "qwen3":
        pytest.skip("one model is enough for the verification")
    version = int(engines[0].weight_version())
    send = lambda: trainer.sender.refit(trainer.source, version)  # noqa: E731
    trainer.fleet.refit(send, version, verify=True, group=trainer.group)
    emptied = len(vllm_layout(state)) - len(engines[0].read())  # CPU kernels empty some
    for engine in engines:
        (report,) = engine.apply_reports()
        assert report["last_verify"]["differ"] == 0 and report["last_verify"]["compared"] >= 4
        assert (report["last_verify"]["unreadable"] > 0) == (emptied > 0), (report, emptied)
    norm = next(n for n in state if n.endswith("norm.weight"))
    state[norm] = state[norm] * 2
    with pytest.raises(RefitError, match=f"(?s)verify v{version}: 1 of .*{re.escape(norm)}"):
        trainer.fleet.refit(send, version, verify=True, group=trainer.group)
    for engine in engines:
        assert engine.failed is not None
    trainer.refit(version + 1)  # a complete refit repairs them
    _assert_same_engines(engines, state)
