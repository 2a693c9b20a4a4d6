"""A `vllm serve` engine with tensor parallel 2 and two data-parallel replicas (4 workers, CPU
mp executor + gloo) in one refit group: every worker joins with its own rank, and after a
refit each replica generates exactly what a fresh TP2 server on the new weights generates,
also on the later refits that each worker applies directly (its learned load map) from the
compact frames of its need-set: the workers of one TP rank across the replicas share one set
and each receives about half of the plan's bytes (shard-to-shard). Then two delta refits (a
few percent of the elements changed, then changed back): every worker rebuilds its compact
frames from its base, loads model-format bytes whose hash (in its status record) equals the
one it loaded from the whole v3, and both replicas again generate exactly what the fresh
server does. Then trainers killed mid-refit, with and without the undo log (`-k survives`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import requests
import torch

from common.clients.fleet import EngineFleet
from common.clients.serve import VllmServer
from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.dtensor_vllm.helpers import perturb
from tests.multiproc import expect_ok
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S, serve_config, timed
from tests.serve.test_survives import Served, run_cycles
from tests.test_concurrent_sources import QuarterSources

pytestmark = pytest.mark.slow
TP, DP = 2, 2


def _greedy(engine, dp_rank: int | None = None) -> tuple[list, list]:
    outs = engine.generate(PROMPTS, SHORT, data_parallel_rank=dp_rank)
    return [o.tokens for o in outs], [o.logprobs for o in outs]


def _loaded_hashes(stats) -> dict[int, str]:
    return {rank: t["loaded_hash"] for rank, t in stats.receivers.items()}


def _delta_refits(fleet, sender, source, group, want, v3_hashes: dict[int, str]) -> None:
    """v4: 3% of v3's elements changed; v5: v3 again. Both go as deltas to every worker."""
    exact = source.tensors
    noisy = dict(exact)
    perturb(noisy, 4)
    for version, state in ((4, noisy), (5, exact)):
        source.tensors = state
        stats = fleet.refit(lambda v=version: sender.refit(source, v), version, group=group)
        print(f"[serve] {stats.summary()}")
        for rank, t in stats.receivers.items():
            assert t["delta_frames"] > 0 and t["wire_bytes"] <= 0.2 * stats.nbytes, (rank, t)
        for rank, digest in _loaded_hashes(stats).items():  # v5 loads v3's bytes again
            assert (digest == v3_hashes[rank]) == (version == 5), (version, rank)
    engine = fleet.engines[0]
    for r in range(DP):
        assert _greedy(engine, r) == want, f"after the delta refits replica {r} differs"


@pytest.fixture(scope="module")
def want(checkpoints) -> tuple[list, list]:
    """A fresh TP2 server's greedy outputs on the changed weights (stopped before the TP2 x
    DP2 server starts: one server at a time)."""
    config = replace(serve_config(checkpoints.changed, "reference_tp2"), tensor_parallel_size=TP)
    with VllmServer(config) as fresh:
        print(f"[serve] fresh TP2 server ready in {fresh.wait_ready():.1f} s")
        return _greedy(fresh.client(timeout_s=TIMEOUT_S))


@pytest.fixture(scope="module")
def replicas(checkpoints) -> Iterator[tuple[VllmServer, list]]:
    """The TP2 x DP2 server and each replica's greedy outputs on the starting weights (a test
    that also needs `want` asks for it first)."""
    config = replace(serve_config(checkpoints.start, "tp2_dp2"), tensor_parallel_size=TP,
                     data_parallel_size=DP, hash_loaded=True)
    with VllmServer(config) as server:
        print(f"[serve] TP2 x DP2 server ready in {server.wait_ready():.1f} s")
        engine = server.client(timeout_s=TIMEOUT_S)
        before = [_greedy(engine, r) for r in range(DP)]
        assert before[0] == before[1]
        yield server, before


def test_shard_and_delta_tp2_engine_with_two_replicas_refits_like_a_fresh_tp2_engine(
        checkpoints, want, replicas) -> None:
    server, before = replicas
    engine = server.client(timeout_s=TIMEOUT_S)
    assert engine.num_workers() == TP * DP
    fleet, port = EngineFleet([engine]), free_port()
    assert fleet.rank_names(1) == {r: f"engine {server.url}" for r in range(1, 5)}
    with timed("join: 1 trainer + 4 engine workers"):
        joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=TIMEOUT_S)
        group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=1 + TP * DP,
                           num_trainers=1, timeout_s=TIMEOUT_S, device="cpu",
                           rank_names=fleet.rank_names(1))
        source = DictWeightSource(checkpoints.states[1])
        sender = RefitSender.setup(group, RefitPlan.build(
            source.plan_specs(), RefitConfig(bucket_bytes=64 << 10, delta=True,
                                             undo_bytes=64 << 20)))
        joining.result(TIMEOUT_S)
    try:
        with timed("refit v1 into 4 workers"):
            stats = fleet.refit(lambda: sender.refit(source, 1), 1, group=group)
        print(f"[serve] {stats.summary()}")
        assert sorted(stats.receivers) == [1, 2, 3, 4]  # every worker reported its times
        assert engine.weight_version() == "1"
        # the guard reads every replica's workers (vLLM's /collective_rpc: the first one's)
        found = requests.get(server.url + "/refit_state", timeout=TIMEOUT_S).json()
        assert found["expected"] == len(found["workers"]) == TP * DP, found
        assert {w["version"] for w in found["workers"]} == {1}, found
        for r in range(DP):
            got = _greedy(engine, r)
            assert got == want, f"replica {r} differs from a fresh TP2 engine"
            assert got[0] != before[r][0]
        # v1 taught every worker its load map (its own TP shard); v2 and v3 apply it
        for version, state, expected in ((2, 0, before), (3, 1, [want, want])):
            source.tensors = checkpoints.states[state]
            stats = fleet.refit(lambda v=version: sender.refit(source, v), version,
                                group=group)
            print(f"[serve] {stats.summary()}")
            sets = {r: t["need_set"] for r, t in stats.receivers.items()}
            assert sets[1] == sets[3] != sets[2] == sets[4], sets  # one set per TP rank
            for rank, t in stats.receivers.items():
                assert t["wire_bytes"] <= 0.55 * stats.nbytes, (rank, t, stats.nbytes)
            for r in range(DP):
                assert _greedy(engine, r) == expected[r], f"v{version}: replica {r} differs"
        hashes = _loaded_hashes(stats)  # v3's: the same TP rank loaded the same bytes
        assert hashes[1] == hashes[3] != hashes[2] == hashes[4], hashes
        _delta_refits(fleet, sender, source, group, want, hashes)
    finally:
        group.destroy()


def test_concurrent_sources_tp2_dp2_refit_like_a_fresh_tp2_engine(checkpoints, want,
                                                                   replicas) -> None:
    """Two trainers, each the source of half the tensors, send at once (concurrent sources,
    every worker receiving from both streams) into the TP2 x DP2 server: whole frames (the
    workers learn their maps for this plan), then compact frames, then deltas on them (a few
    percent changed, then changed back); after each refit of known weights both replicas
    generate exactly what a fresh TP2 server does on them (or did before the first refit)."""
    server, before = replicas
    engine = server.client(timeout_s=TIMEOUT_S)
    fleet, port, world = EngineFleet([engine]), free_port(), 2 + TP * DP
    config = RefitConfig(bucket_bytes=64 << 10, delta=True, undo_bytes=64 << 20)
    halves = [QuarterSources(checkpoints.states[0], sources=2) for _ in range(2)]
    noisy = dict(checkpoints.states[0])
    perturb(noisy, 8)

    def setup(rank: int) -> RefitSender:
        group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                           num_trainers=2, timeout_s=TIMEOUT_S, device="cpu",
                           rank_names=fleet.rank_names(2))
        return RefitSender.setup(group, RefitPlan.build(halves[rank].plan_specs(), config))

    with ThreadPoolExecutor(2) as pool:
        joining = fleet.join_async("127.0.0.1", port, 2, timeout_s=TIMEOUT_S)
        senders = list(pool.map(setup, (0, 1)))
        joining.result(TIMEOUT_S)
        try:
            start, changed = checkpoints.states
            for version, state, expected in ((6, changed, [want, want]), (7, start, before),
                                             (8, noisy, None), (9, start, before),
                                             (10, changed, [want, want])):
                for half in halves:
                    half.tensors = state
                other = pool.submit(senders[1].refit, halves[1], version)
                stats = fleet.refit(lambda v=version: senders[0].refit(halves[0], v), version,
                                    group=senders[0].group)
                other.result(TIMEOUT_S)
                print(f"[serve] {stats.summary()}")
                assert stats.sources == 2 and engine.weight_version() == str(version)
                if version >= 7:  # compact frames of each TP rank's need-set from v7 on
                    sets = {r: t["need_set"] for r, t in stats.receivers.items()}
                    assert sets[2] == sets[4] != sets[3] == sets[5], sets
                if version in (8, 9):  # a few percent changed each: deltas to every worker
                    assert all(t["delta_frames"] > 0 for t in stats.receivers.values())
                for r in range(DP) if expected is not None else ():
                    assert _greedy(engine, r) == expected[r], f"v{version}: replica {r}"
        finally:
            for sender in senders:
                sender.group.destroy()


def _stage_trainer(rank: int, world: int, port: int, dist_port: int,
                   versions: list[tuple[int, dict]]) -> dict:
    """One rank of 2 pipeline stages x FSDP2 dp 2 (transformers' split): each version's
    weights copied into its shards, then refit."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from dtensor_refit import DTensorWeightSource, DtypePolicy
    from tests.dtensor.split import TRAINERS, Layout, build_layout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=TRAINERS)
    try:
        parts = build_layout(Layout("pp_hf"))
        source = DTensorWeightSource(parts, DtypePolicy(torch.bfloat16))
        group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                           num_trainers=TRAINERS, timeout_s=TIMEOUT_S, device="cpu")
        sender = RefitSender.setup(group, RefitPlan.build(
            source.plan_specs(), RefitConfig(bucket_bytes=64 << 10, delta=True,
                                             undo_bytes=64 << 20)))
        out = {}
        for version, state in versions:
            with torch.no_grad():
                for part in parts:
                    for name, p in part.named_parameters():
                        full = state[name].float()
                        p.to_local().copy_(distribute_tensor(full, p.device_mesh,
                                                             p.placements).to_local())
            stats = sender.refit(source, version)
            out[version] = {"sources": stats.sources, "receivers": stats.receivers}
        group.destroy()
        return out
    finally:
        dist.destroy_process_group()


def test_concurrent_dtensor_stages_tp2_dp2_refit_like_a_fresh_tp2_engine(checkpoints, want,
                                                                         replicas) -> None:
    """Two pipeline stages x FSDP2 dp 2 (4 trainer processes, two sources) into the TP2 x DP2
    server: whole frames, compact frames, deltas; both replicas generate what a fresh TP2
    server does, and each TP rank's workers of the two replicas load the same bytes."""
    from tests.dtensor.split import TRAINERS

    server, before = replicas
    engine = server.client(timeout_s=TIMEOUT_S)
    fleet, port, dist_port = EngineFleet([engine]), free_port(), free_port()
    start, changed = checkpoints.states
    noisy = dict(start)
    perturb(noisy, 11)
    versions = [(11, changed), (12, start), (13, noisy), (14, start)]
    expected = {11: [want, want], 12: before, 14: before}
    seen: dict[int, list] = {}

    def drive() -> None:
        joining.result(TIMEOUT_S * 4)
        for version, _ in versions:  # the trainers send from their own processes
            fleet.refit(lambda: None, version)
            seen[version] = [_greedy(engine, r) for r in range(DP)]

    joining = fleet.join_async("127.0.0.1", port, TRAINERS, timeout_s=TIMEOUT_S * 4)
    driver = threading.Thread(target=drive)
    driver.start()
    res = expect_ok(run_ranks(_stage_trainer, TRAINERS, dist_port, versions, timeout=600,
                              port=port, group_world=fleet.world_size(TRAINERS)))
    driver.join(timeout=120)
    stats = res[0]
    assert all(stats[v]["sources"] == 2 for v, _ in versions), stats
    for version, got in seen.items():
        assert got == expected.get(version, got), f"v{version} differs"
    assert sorted(seen) == [v for v, _ in versions]
    workers = sorted(stats[12]["receivers"])
    sets = {r: stats[12]["receivers"][r]["need_set"] for r in workers}
    assert sets[workers[0]] == sets[workers[2]] != sets[workers[1]] == sets[workers[3]], sets
    for version in (13, 14):
        assert all(t["delta_frames"] > 0 for t in stats[version]["receivers"].values())
    hashes = {v: {r: t["loaded_hash"] for r, t in stats[v]["receivers"].items()}
              for v in (12, 14)}
    assert hashes[12] == hashes[14], hashes  # start's bytes, compact then as deltas
    assert hashes[12][workers[0]] == hashes[12][workers[2]] != hashes[12][workers[1]]


def test_survives_tp2_dp2_trainers_killed_mid_refit(checkpoints, replicas, tmp_path) -> None:
    """The crash-restart path at TP2 x DP2 (`tests/serve/test_survives.py`): a trainer killed
    mid-refit with the undo log (both replicas roll back and serve), one without (the server
    refuses until the next trainer's refit lands); then both replicas serve the starting
    weights as the fresh server did."""
    server, before = replicas
    engine = server.client(timeout_s=TIMEOUT_S)
    start = [[tokens, logprobs] for tokens, logprobs in zip(*before[0], strict=True)]
    held = engine.weight_version()  # "default": a fresh server (this test run alone)
    run_cycles(Served(server, TP, start), checkpoints.states, tmp_path,
               [(True, "mid_way"), (False, "mid_way")], int(held) if held.isdigit() else 0)
    for r in range(DP):
        assert _greedy(engine, r) == before[r], f"replica {r} differs after the cycles"
