"""Two TP=2 engines in one refit group, one taking shard-to-shard frames and one whole
buckets (`EngineConfig.shard_to_shard=False`), both hosted by `LocalEngine` (its child process
may start vLLM's worker processes; a daemonic child may not). The first refit learns each
worker's load map; from the second on the shard engine's workers each receive about half of
the plan's bytes and load model-format bytes hashing equal to those of the whole-bucket
engine's worker of the same TP rank. Then the whole-bucket engine gives way to a restarted
replica in a new group: it takes whole buckets while it learns, the kept engine its need-sets
from the first refit; both end generating exactly like a fresh TP=2 engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, greedy, join_one_trainer

pytestmark = pytest.mark.slow
TP2 = {**LLM_KWARGS, "tensor_parallel_size": 2}


@dataclass
class Refitted:
    before: dict  # greedy outputs on the starting weights
    got: dict  # after the refits, of the shard engine
    got_restarted: dict  # of the replica restarted after refit 3, after refit 5
    state: dict[str, torch.Tensor]  # what the last refit (5) sent
    reports: list[dict]  # each shard worker's apply report
    received: dict[int, dict[int, dict]]  # version -> refit rank -> its status figures
    hashes: dict[int, tuple[list, list]]  # version -> loaded hashes per engine, by TP rank
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
    received, hashes = {}, {}

    def refits(engines: list, versions: range) -> None:
        trainer = join_one_trainer(engines, state)
        try:
            for version in versions:
                for name, t in state.items():
                    state[name] = (t.float() * 1.25).to(t.dtype) if t.dim() > 1 else t
                received[version] = trainer.refit(version).receivers
                hashes[version] = tuple([r.get("loaded_hash") for r in e.apply_reports()]
                                        for e in engines)
        finally:
            trainer.group.destroy()

    with LocalEngine(shard, name="shard") as engine:
        assert engine.num_workers() == 2
        before = greedy(engine)
        with LocalEngine(replace(shard, shard_to_shard=False), name="full") as full:
            refits([engine, full], range(1, 4))  # 1 learns each worker's map, 2-3 apply it
        # the whole-bucket engine gives way to a restarted replica, in a new group
        with LocalEngine(shard, name="restarted") as restarted:
            refits([engine, restarted], range(4, 6))
            assert engine.weight_version() == restarted.weight_version() == "5"
            return Refitted(before, greedy(engine), greedy(restarted), state,
                            engine.apply_reports(), received, hashes,
                            sum(t.nbytes for t in state.values()))


def test_verdict_local_engine_hosts_a_tp2_engine_that_refits_like_a_fresh_one(
        refitted, tmp_path):
    path = _save(refitted.state, tmp_path / "v5")
    with LocalEngine(EngineConfig(model=path, llm_kwargs=TP2)) as fresh:
        want = greedy(fresh)
    assert refitted.got == want, "the shard TP=2 engine differs from a fresh TP=2 engine"
    assert refitted.got_restarted == want, "the restarted engine differs from a fresh one"
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


def test_shard_a_restarted_replica_takes_whole_buckets_while_the_others_keep_their_sets(
        refitted):
    """Refit 4, in a new group: the kept engine (ranks 1-2) keeps its maps and need-sets, the
    restarted replica (3-4) learns from whole buckets; refit 5: all four in two need-sets,
    loading equal bytes per TP rank."""
    total = refitted.total_bytes
    got = refitted.received[4]
    sets = {r: got[r]["need_set"] for r in got}
    assert sets[1] != sets[2] and sets[3] == sets[4] not in (sets[1], sets[2]), sets
    assert got[1]["wire_bytes"] <= 0.55 * total and got[3]["wire_bytes"] >= total, got
    got = refitted.received[5]
    sets = {r: got[r]["need_set"] for r in got}
    assert sets[1] == sets[3] != sets[2] == sets[4], sets
    assert all(got[r]["wire_bytes"] <= 0.55 * total for r in got), got
    kept, restarted = refitted.hashes[5]
    assert None not in kept and kept == restarted, refitted.hashes[5]


def test_shard_each_tp2_worker_needs_its_own_half_of_the_bytes(refitted):
    """The needs its map implies (`DirectLoad.needs`): different per TP rank, each about half
    of the plan's bytes (its shard of every split tensor, and the replicated norms)."""
    reports = refitted.reports
    assert [r["path"] for r in reports] == ["direct", "direct"], reports
    assert reports[0]["needs_digest"] != reports[1]["needs_digest"]
    for r in reports:
        fraction = r["needs_bytes"] / refitted.total_bytes
        assert 0.45 < fraction < 0.6, (fraction, r)
