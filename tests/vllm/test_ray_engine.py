"""An engine hosted in a real Ray actor (`RayEngine`), refit through the same interface as
the other hosts: it joins, takes a refit as version 1 and then generates exactly what a fresh
engine started on the new weights generates."""

from __future__ import annotations

import pytest
import torch

from common.broadcast import RefitSender
from common.config import RefitConfig
from common.engine_client import EngineFleet
from common.group import RefitGroup, free_port
from common.plan import RefitPlan
from common.source import DictWeightSource
from tests.dtensor.models import make_model
from tests.vllm.helpers import PROMPTS, engine_config, greedy, start_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def test_an_engine_in_a_ray_actor_refits_like_a_fresh_engine(ray_cluster, tmp_path) -> None:
    from common.ray_engine import RayEngine

    old = make_model("qwen3", dtype=torch.bfloat16)
    old.save_pretrained(tmp_path / "v0")
    new_state = {n: (t * 1.5 if t.dim() > 1 else t).contiguous()
                 for n, t in old.state_dict().items()}
    old.load_state_dict(new_state)
    old.save_pretrained(tmp_path / "v1")
    engine = RayEngine.start(engine_config(str(tmp_path / "v0")))
    try:
        before = greedy(engine)
        fleet, port = EngineFleet([engine]), free_port()
        joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=60)
        group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=fleet.world_size(1),
                           num_trainers=1, timeout_s=60, device="cpu")
        source = DictWeightSource(new_state)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(),
                                                          RefitConfig(bucket_bytes=16 << 10)))
        joining.result(60)
        stats = fleet.refit(lambda: sender.refit(source, 1), 1, mode="abort")
        assert sorted(stats.receivers) == [1] and engine.weight_version() == "1"
        got = greedy(engine)
        (out,) = engine.generate([PROMPTS[0]], 4)
        assert out.weight_versions == [("1", 0, 4)]
        group.destroy()
    finally:
        engine.close()
    with start_engine(str(tmp_path / "v1")) as fresh:
        assert got == greedy(fresh)
    assert got["tokens"] != before["tokens"]
