"""Two TP=2 engines in one refit group, one taking shard-to-shard frames and one whole
buckets (`EngineConfig.shard_to_shard=False`), both hosted by `LocalEngine` (its child process
may start vLLM's worker processes; a daemonic child may not). The first refit learns each
worker's load map; from the second on the shard engine's workers each receive about half of
the plan's bytes, load model-format bytes hashing equal to those of the whole-bucket engine's
worker of the same TP rank, and both generate exactly like a fresh TP=2 engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine_config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, greedy, join_one_trainer

pytestmark = pytest.mark.slow
TP2 = {**LLM_KWARGS, "tensor_parallel_size": 2}


@dataclass
class Refitted:
    before: dict  # greedy outputs on the starting weights
    got: dict  # after the refits, of the shard engine
    got_full: dict  # of the whole-bucket engine
    state: dict[str, torch.Tensor]  # what the last refit sent
    reports: list[dict]  # each shard worker's apply report
    received: dict[int, dict[int, dict]]  # version -> refit rank -> its status figures
    hashes: dict[int, tuple[list, list]]  # version -> loaded hashes (shard, full) by TP rank
    total_bytes: int


def _save(state: dict[str, torch.Tensor] | None, path) -> str:
    from tests.dtensor.models import make_model

    model = make_model("qwen3", dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory) -> Refitted:
    from tests.dtensor.models import make_model

    start = _save(None, tmp_path_factory.mktemp("tp2") / "start")
    state = {k: v.clone() for k, v in make_model("qwen3", dtype=torch.bfloat16)
             .state_dict().items()}
    shard = EngineConfig(model=start, llm_kwargs=TP2, hash_loaded=True)
    with (LocalEngine(shard, name="shard") as engine,
          LocalEngine(replace(shard, shard_to_shard=False), name="full") as full):
        assert engine.num_workers() == 2
        before = greedy(engine)
        trainer = join_one_trainer([engine, full], state)
        received, hashes = {}, {}
        try:
            for version in (1, 2, 3):  # 1 learns each worker's load map, 2-3 apply it
                for name, t in state.items():
                    state[name] = (t.float() * 1.25).to(t.dtype) if t.dim() > 1 else t
                received[version] = trainer.refit(version).receivers
                hashes[version] = tuple([r.get("loaded_hash") for r in e.apply_reports()]
                                        for e in (engine, full))
            assert engine.weight_version() == "3"
            return Refitted(before, greedy(engine), greedy(full), state,
                            engine.apply_reports(), received, hashes,
                            trainer.sender.plan.total_bytes)
        finally:
            trainer.group.destroy()


def test_verdict_local_engine_hosts_a_tp2_engine_that_refits_like_a_fresh_one(
        refitted, tmp_path):
    path = _save(refitted.state, tmp_path / "v2")
    with LocalEngine(EngineConfig(model=path, llm_kwargs=TP2)) as fresh:
        want = greedy(fresh)
    assert refitted.got == want, "the shard TP=2 engine differs from a fresh TP=2 engine"
    assert refitted.got_full == want, "the full TP=2 engine differs from a fresh TP=2 engine"
    assert refitted.got["tokens"] != refitted.before["tokens"]


def test_shard_tp2_workers_take_their_half_and_load_what_whole_buckets_load(refitted):
    """Ranks 1-2: the shard engine's workers (TP 0, 1); 3-4: the whole-bucket engine's."""
    total = refitted.total_bytes
    first = refitted.received[1]
    assert {r: first[r]["need_set"] for r in first} == {1: -1, 2: -1, 3: -1, 4: -1}
    for version in (2, 3):
        got = refitted.received[version]
        sets = {r: got[r]["need_set"] for r in got}
        assert sets[1] != sets[2] and sets[3] == sets[4] not in (sets[1], sets[2]), sets
        for rank in (1, 2):
            assert got[rank]["wire_bytes"] / total <= 0.55, (rank, got[rank], total)
        for rank in (3, 4):
            assert got[rank]["wire_bytes"] >= total, (rank, got[rank], total)
        shard, full = refitted.hashes[version]
        assert None not in shard and shard == full, (version, shard, full)
    assert refitted.hashes[2][0] != refitted.hashes[3][0]  # the bytes did change


def test_shard_each_tp2_worker_needs_its_own_half_of_the_bytes(refitted):
    """The needs its map implies (`DirectLoad.needs`): different per TP rank, each about half
    of the plan's bytes (its shard of every split tensor, and the replicated norms)."""
    reports = refitted.reports
    assert [r["path"] for r in reports] == ["direct", "direct"], reports
    assert reports[0]["needs_digest"] != reports[1]["needs_digest"]
    for r in reports:
        fraction = r["needs_bytes"] / refitted.total_bytes
        assert 0.45 < fraction < 0.6, (fraction, r)
