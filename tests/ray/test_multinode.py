"""Two Ray nodes on one machine, on distinct addresses (`ray.cluster_utils.Cluster`): the head
at the machine's own address with the trainers, a second node on 127.0.0.2 with the engine
(custom resources pin them). The refit group forms across the nodes and refits land."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from common.launch.ray_cluster import (
    RayLayout,
    RayPlacement,
    TrainerActor,
    TrainerGroup,
    start_trainers,
)
from tests.dtensor.models import make_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


class CheckpointTrainer(TrainerActor):
    """A trainer rank whose weights are a checkpoint's tensors scaled by `scale` (rank 0 sends)."""

    def build(self):
        from safetensors.torch import load_file

        from common.source import DictWeightSource

        path, scale = self.args
        return DictWeightSource({n: t * scale for n, t in
                                 load_file(f"{path}/model.safetensors").items()})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    temp = str(tmp_path_factory.mktemp("ray"))
    _default_dir_exists()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer_node": 2}, "temp_dir": temp})
    try:
        nodes.add_node(num_cpus=1, node_ip_address="127.0.0.2", resources={"engine_node": 1})
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}", "VLLM_LOGGING_LEVEL": "ERROR"}
        ray.init(address=nodes.address, runtime_env={"env_vars": env}, log_to_driver=False,
                 _temp_dir=temp)
        nodes.wait_for_nodes()
        yield ray
    finally:
        ray.shutdown()
        nodes.shutdown()


def _default_dir_exists() -> None:
    """`Cluster` writes the head's address into Ray's default temp dir whatever `temp_dir`
    says, and fails on a machine where no Ray ever ran (it does not create that dir)."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # Ray releases before the move
        from ray._private.utils import get_ray_address_file
    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)


def _node_ips(ray, group) -> set[str]:
    from ray.util import placement_group_table

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return {ips[node] for node in placement_group_table(group)["bundles_to_node_id"].values()}


@dataclass
class RayJob:
    trainers: TrainerGroup
    engine: Any
    host: str  # where trainer rank 0 hosts the refit group's store


@contextlib.contextmanager
def refit_job(ray, placement: RayPlacement, checkpoint: Path, engine_name: str
              ) -> Iterator[RayJob]:
    """Two trainer actors (weights: `checkpoint` x1.5) and an engine actor on `placement` join
    a refit group (trainer rank 0 hosts the store), and v1 lands and changes the engine's greedy
    tokens; everything is stopped and the placement removed on exit."""
    from common.clients.fleet import EngineFleet
    from common.clients.ray_engine import RayEngine
    from common.config import RefitConfig
    from common.engine.config import EngineConfig
    from recipes.engines import tiny_llm_kwargs

    trainers = fleet = None
    try:
        trainers = start_trainers(CheckpointTrainer, placement, str(checkpoint), 1.5)
        config = EngineConfig(model=str(checkpoint), llm_kwargs=tiny_llm_kwargs(64))
        engine = RayEngine.start(config, name=engine_name, **placement.engine_options(0))
        fleet = EngineFleet([engine])
        host, port = ray.get(trainers.actors[0].address.remote(), timeout=TIMEOUT_S)
        joining = fleet.join_async(host, port, 2, timeout_s=TIMEOUT_S)
        trainers.call("join_refit", host, port, fleet.world_size(2), fleet.rank_names(2),
                      RefitConfig(bucket_bytes=64 << 10), TIMEOUT_S)
        joining.result(TIMEOUT_S)
        before = engine.generate([[1, 2, 3]], 6)
        stats = trainers.refit(fleet, 1)
        assert [s["version"] for s in stats] == [1, 1] and sorted(stats[0]["receivers"]) == [2]
        (after,) = engine.generate([[1, 2, 3]], 6)
        assert engine.weight_version() == "1" and after.weight_versions == [("1", 0, 6)]
        assert after.tokens != before[0].tokens
        yield RayJob(trainers, engine, host)
    finally:
        if fleet is not None:
            fleet.close()
        if trainers is not None:
            trainers.call("shutdown")
            trainers.kill()
        placement.remove()


def test_trainers_and_an_engine_on_different_nodes_refit(cluster, tmp_path) -> None:
    make_model("qwen3", dtype=torch.bfloat16).save_pretrained(tmp_path / "v0")
    layout = RayLayout(trainers=2, trainer_resources={"trainer_node": 1},
                       engine_resources={"engine_node": 1}, strategy="SPREAD",
                       timeout_s=TIMEOUT_S)
    placement = RayPlacement(layout)
    trainer_ips, engine_ips = (_node_ips(cluster, placement.trainer_group),
                               _node_ips(cluster, placement.engine_groups[0]))
    assert engine_ips == {"127.0.0.2"} and "127.0.0.2" not in trainer_ips, (
        trainer_ips, engine_ips)
    with refit_job(cluster, placement, tmp_path / "v0", "engine@127.0.0.2") as job:
        assert job.host in trainer_ips  # the refit group's store lives on the trainers' node
