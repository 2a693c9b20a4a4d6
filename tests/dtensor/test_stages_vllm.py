"""2 pipeline stages x FSDP2 dp 2 (transformers' split, tied embeddings) -> one real vLLM engine:
after one refit it generates exactly what a fresh engine started on the new weights does."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.clients.fleet import EngineFleet
from common.wire.group import free_port
from recipes.rank_runner import run_ranks
from tests.dtensor.shard import build_unsharded
from tests.dtensor.split import TRAINERS, Layout, build_layout
from tests.dtensor_vllm.harness import write_engine_checkpoint
from tests.dtensor_vllm.helpers import greedy, start_engine
from tests.multiproc import expect_ok

pytestmark = pytest.mark.slow
LAYOUT = Layout("pp_hf", tie=True)  # the last stage keeps the tied embedding too


def _trainer(rank: int, world: int, port: int, dist_port: int) -> list:
    """One stage rank: build its part, double every weight (a "step"), refit version 1."""
    from common.config import RefitConfig
    from common.plan import RefitPlan
    from common.transfer.sender import RefitSender
    from common.wire.group import RefitGroup
    from dtensor_refit import DTensorWeightSource, DtypePolicy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=TRAINERS)
    try:
        parts = build_layout(LAYOUT)
        source = DTensorWeightSource(parts, DtypePolicy(torch.bfloat16))
        config = RefitConfig(bucket_bytes=16 << 10, timeout_s=120)
        group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                           num_trainers=TRAINERS, timeout_s=120, device="cpu")
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        with torch.no_grad():
            for t in parts[0].parameters():
                t.mul_(2)
        sender.refit(source, 1)
        return sorted({s.source_rank for s in source.plan_specs()})
    finally:
        dist.destroy_process_group()


def test_two_stages_refit_a_vllm_engine_like_a_fresh_engine(tmp_path: Path) -> None:
    write_engine_checkpoint(build_unsharded(LAYOUT.case), tmp_path / "v0")
    doubled = build_unsharded(LAYOUT.case)
    with torch.no_grad():
        for t in doubled.parameters():
            t.mul_(2)
    write_engine_checkpoint(doubled, tmp_path / "v1")
    with start_engine(str(tmp_path / "v1")) as fresh:
        want = greedy(fresh)
    with start_engine(str(tmp_path / "v0")) as engine:
        before = greedy(engine)
        fleet, port = EngineFleet([engine]), free_port()
        join = fleet.join_async("127.0.0.1", port, TRAINERS, timeout_s=120.0).futures[0]
        outcome: list = []

        def drive() -> None:
            join.result(300)
            fleet.refit(lambda: None, 1)  # the trainers send from their own processes
            outcome.append("refit")

        driver = threading.Thread(target=drive)
        driver.start()
        dist_port = free_port()
        while dist_port == port:
            dist_port = free_port()
        results = expect_ok(run_ranks(_trainer, TRAINERS, dist_port, timeout=300, port=port,
                                      group_world=fleet.world_size(TRAINERS)))
        driver.join(timeout=120)
        assert outcome == ["refit"] and all(v == [0, 2] for v in results.values()), results
        assert engine.weight_version() == "1"
        got = greedy(engine)
    assert got == want and got["tokens"] != before["tokens"]
