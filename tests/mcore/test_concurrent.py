"""Megatron concurrent sources (`sources="spread"`): experts from their owners (any
expert-data-parallel replica's), dense tensors spread over the stage's ranks, bytes balanced; a
refit into plain receivers lands bit for bit what `sources="stage"` lands, sources sharing TP /
expert-TP gathers included. Selectable by `-k concurrent`."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from common.plan import TensorSpec, balance_sources
from common.transfer.schedule import imbalance
from mcore_refit.placement import RankInfo, StagePlacement, place_stage
from tests.mcore.hfcheck import expected_shapes, hf_logits
from tests.mcore.models import VOCAB, Layout
from tests.mcore.ranks import refit_job

PP2EP2 = Layout("qwen3_moe", pp=2, ep=2)
TRAINERS, RECEIVERS = 4, 2
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


# 4 ranks of one stage, as (rank, EP rank, expert-TP rank, expert-DP rank): the owners of
# each EP rank, one per expert-DP replica
PLACEMENTS = {
    "tp2 ep2 (etp = tp)": ([(0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 0, 0), (3, 1, 1, 0)],
                           ((0,), (2,))),
    "tp2 ep2 etp1": ([(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 1), (3, 1, 0, 1)], ((0, 2), (1, 3))),
    "tp2 ep4 etp1": ([(r, r, 0, 0) for r in range(4)], ((0,), (1,), (2,), (3,))),
    "ep2 edp2": ([(r, r % 2, 0, r // 2) for r in range(4)], ((0, 2), (1, 3))),
    "tp2 etp2 edp2": ([(r, 0, r % 2, r // 2) for r in range(4)], ((0, 2),)),
}


@pytest.mark.parametrize("case", PLACEMENTS)
def test_concurrent_placement_experts_from_owners_dense_anywhere(case: str) -> None:
    infos, owners = PLACEMENTS[case]
    got = place_stage([RankInfo(*i) for i in reversed(infos)], experts=True)
    assert got == StagePlacement(0, owners, (0, 1, 2, 3))
    assert [got.candidates(e) for e in range(len(owners))] == list(owners)
    assert got.candidates(None) == (0, 1, 2, 3)


def test_concurrent_placement_spreads_experts_over_edp_replicas() -> None:
    """EP2 x EDP2 (TP1): each expert may come from its EP rank's owner in either replica;
    `balance_sources` (as `MegatronWeightSource` calls it) gives both replicas' owners
    experts, and the four sources end within one unit of each other."""
    got = place_stage([RankInfo(r, r % 2, 0, r // 2) for r in range(4)], experts=True)
    experts = [(f"e{e}.fc{k}", e % 2, 3 - k) for e in range(8) for k in (1, 2)]  # fc1: 2x fc2
    specs = [TensorSpec(n, (b,), torch.uint8, got.candidates(m)[0]) for n, m, b in experts]
    specs += [TensorSpec(f"d{i}", (1,), torch.uint8, got.first) for i in range(4)]
    candidates = {n: got.candidates(m) for n, m, _ in experts}
    candidates.update({f"d{i}": got.candidates(None) for i in range(4)})
    placed = balance_sources(specs, candidates)
    loads, by_replica = Counter(), Counter()
    for spec in placed:
        loads[spec.source_rank] += spec.nbytes
        if spec.name.startswith("e"):
            assert spec.source_rank in got.owners[int(spec.name[1]) % 2], spec
            by_replica[spec.source_rank // 2] += spec.nbytes
    assert by_replica[0] == by_replica[1] == 12  # both replicas' owners send experts
    assert loads == dict.fromkeys(range(4), 7) and imbalance(dict(loads)) == 1.0, loads


def test_concurrent_placement_without_owners_falls_back_to_stage() -> None:
    dense = [RankInfo(r, 0, r % 2, r // 2) for r in range(2, 6)]  # a stage of a dense model
    assert place_stage(dense, experts=False) == StagePlacement(2, (), (2, 3, 4, 5))
    gap = [RankInfo(2, 0, 0, 0), RankInfo(3, 2, 0, 0)]  # no owner of EP rank 1
    assert place_stage(gap, experts=True) == StagePlacement(2)
    assert StagePlacement(2).candidates(None) == StagePlacement(2).candidates(1) == (2,)


def _specs(result: dict) -> list[TensorSpec]:
    return [TensorSpec.from_json(s) for s in result["specs"]]


def _tensors(results: list[dict]) -> dict[str, torch.Tensor]:
    return {k: v for r in results for k, v in r["tensors"].items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def _owners(results: list[dict], stage: int, expert: int, per_rank: int) -> set[int]:
    """The ranks of `stage` whose EP rank holds `expert`, one per expert-data-parallel replica
    (expert-TP 1: every such rank is its replica's owner)."""
    return {r for r, res in enumerate(results) if res["where"][:2] == (stage, expert // per_rank)}


# 4 ranks, every one an owner (expert-TP 1): PP2 x EP2 (one replica a stage); EP2 x DP2 (TP1:
# two expert-data-parallel replicas, each EP rank's experts shared by its two owners)
PLANS = {"pp2 ep2": (PP2EP2, [0, 2]), "ep2 edp2": (Layout("qwen3_moe", ep=2), [0])}


@pytest.mark.parametrize("case", PLANS)
def test_concurrent_plan_spreads_over_four_sources(pool, case: str) -> None:
    layout, stage_sources = PLANS[case]
    spread = pool.run(refit_job, layout, 5)
    stage = pool.run(refit_job, layout, 5, torch.float32, "stage")
    specs, old = _specs(spread[0]), {s.name: s for s in _specs(stage[0])}
    assert sorted({s.source_rank for s in old.values()}) == stage_sources
    assert [s.source_rank for s in specs] == sorted(s.source_rank for s in specs)
    stage_of = {r: res["where"][0] for r, res in enumerate(spread)}
    per_rank = layout.sizes.experts // layout.ep
    loads, expert_loads = Counter(), Counter()
    for spec in specs:  # a stage's tensors stay on it; each expert comes from an owner
        assert stage_of[spec.source_rank] == stage_of[old[spec.name].source_rank], spec
        loads[spec.source_rank] += spec.nbytes
        if m := _EXPERT.search(spec.name):
            owners = _owners(spread, stage_of[spec.source_rank], int(m.group(1)), per_rank)
            assert spec.source_rank in owners, spec
            expert_loads[spec.source_rank] += spec.nbytes
    assert sorted(expert_loads) == sorted(loads) == [0, 1, 2, 3], (expert_loads, loads)
    layer0_qkv = re.compile(r"model\.layers\.0\.self_attn\.[qkv]_proj")
    qkv = sum(s.nbytes for s in specs if layer0_qkv.match(s.name))  # the largest unit
    for st in set(stage_of.values()):  # greedy by bytes: a stage's sources within one unit
        mine = [loads[r] for r, s in stage_of.items() if s == st]
        assert max(mine) - min(mine) <= qkv, loads
    assert imbalance(dict(loads)) <= 1.1, loads
    assert max(loads.values()) <= 0.55 * max(Counter(
        {r: sum(s.nbytes for s in old.values() if s.source_rank == r)
         for r in stage_sources}).values())
    assert_same_bits(_tensors(spread), _tensors(stage))


SPREAD = [  # every rank a source: TP groups with two sources, owners in another's TP gather
    Layout("qwen3_moe", tp=2, ep=2),
    Layout("qwen3_moe", tp=2, ep=2, etp=1),
    Layout("qwen3_moe", tp=2, ep=4, etp=1, tied=True),
    Layout("deepseek_v3", pp=2, ep=2),
    Layout("qwen3", tp=2, pp=2),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", SPREAD, ids=lambda lay: lay.label)
def test_concurrent_spread_sends_what_stage_sends(pool, layout: Layout) -> None:
    spread = pool.run(refit_job, layout, 8)
    stage = pool.run(refit_job, layout, 8, torch.float32, "stage")
    loads = Counter()
    for spec in _specs(spread[0]):
        loads[spec.source_rank] += spec.nbytes
    assert sorted(loads) == [0, 1, 2, 3] and imbalance(dict(loads)) <= 1.1, loads
    assert_same_bits(_tensors(spread), _tensors(stage))


@pytest.mark.slow
def test_concurrent_etp2_edp2_gathers_in_the_chosen_replica(pool) -> None:
    """Expert-TP 2 x expert-DP 2 (TP2, EP1): both replicas' owners (expert-TP rank 0: ranks 0
    and 2) send experts, each gathered by its source's expert-TP group only; their expert-TP
    peers send dense tensors only, so the sources stay uneven, as V3's ETP2 row."""
    layout = Layout("qwen3_moe", tp=2)
    spread = pool.run(refit_job, layout, 8)
    stage = pool.run(refit_job, layout, 8, torch.float32, "stage")
    specs, loads = _specs(spread[0]), Counter()
    for spec in specs:
        loads[spec.source_rank] += spec.nbytes
    assert sorted({s.source_rank for s in specs if _EXPERT.search(s.name)}) == [0, 2]
    assert sorted(loads) == [0, 1, 2, 3]
    qkv = sum(s.nbytes for s in specs if re.match(r"model\.layers\.0\.self_attn\.[qkv]_", s.name))
    assert abs(loads[0] - loads[2]) <= qkv and abs(loads[1] - loads[3]) <= qkv, loads
    assert_same_bits(_tensors(spread), _tensors(stage))


def _group(rank: int, world: int, port: int):
    from common.wire.group import RefitGroup

    return RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                      num_trainers=TRAINERS, timeout_s=60)


def _train_and_send(rank: int, layout: Layout, trainer_port: int, ports: dict) -> dict:
    """A trainer: Megatron's parallel state over the trainers, the model, its logits; then one
    refit per `sources` mode, each over its own refit group."""
    import torch.distributed as dist

    from common.config import RefitConfig
    from common.plan import RefitPlan
    from common.transfer.sender import RefitSender
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for
    from recipes import mcore_cpu_shim
    from recipes.mcore_configs import build_chunks, setup_parallel
    from recipes.mcore_models import randomise
    from tests.mcore.models import SEQ
    from tests.mcore.ranks import megatron_logits

    mcore_cpu_shim.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank,
                            world_size=TRAINERS)
    setup_parallel(layout)
    chunks = build_chunks(layout)
    randomise(chunks, 6)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(6))
    # tensors go back as numpy arrays: pickled by value (a one-shot rank is gone by then)
    out = {"logits": megatron_logits(layout, chunks, ids).numpy(), "ids": ids.numpy()}
    config = RefitConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=60)
    for mode, port in ports.items():
        source = MegatronWeightSource(chunks, converter_for(layout.model_type), vocab_size=VOCAB,
                                      policy=DtypePolicy(torch.float32), sources=mode)
        group = _group(rank, TRAINERS + RECEIVERS, port)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        stats = sender.refit(source, 1)
        out[mode] = (stats.sources, len(sender.plan.specs))
        group.destroy()
    dist.destroy_process_group()
    return out


def refit_rank(rank: int, world: int, port: int, layout: Layout, trainer_port: int,
               stage_port: int) -> dict:
    ports = {"spread": port, "stage": stage_port}
    torch.set_num_threads(1)
    if rank < TRAINERS:
        return _train_and_send(rank, layout, trainer_port, ports)
    from common.transfer.sender import RefitReceiver
    from tests.multiproc import receive_all

    out = {}
    for mode, p in ports.items():
        group = _group(rank, world, p)
        out[mode] = {n: t.numpy() for n, t in receive_all(RefitReceiver.setup(group))[1].items()}
        group.destroy()
    return out


@pytest.mark.parametrize("layout", [
    PP2EP2, PLANS["ep2 edp2"][0],
    pytest.param(Layout("qwen3_moe", tp=2, ep=2), marks=pytest.mark.slow)],
    ids=lambda lay: lay.label)
def test_concurrent_refit_lands_what_stage_lands(monkeypatch, layout: Layout) -> None:
    """4 Megatron trainers refit 2 plain receivers over gloo, once per `sources` mode."""
    from common.wire.group import free_port
    from recipes.rank_runner import run_ranks
    from tests.multiproc import expect_ok

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # as the pool's ranks (conftest)
    res = expect_ok(run_ranks(refit_rank, TRAINERS + RECEIVERS, layout, free_port(),
                              free_port(), timeout=240))
    (spread_sources, count), (stage_sources, _) = res[0]["spread"], res[0]["stage"]
    assert (spread_sources, stage_sources) == (4, layout.pp)
    want = expected_shapes(layout)
    for receiver in range(TRAINERS, TRAINERS + RECEIVERS):
        got = {mode: {n: torch.from_numpy(a) for n, a in res[receiver][mode].items()}
               for mode in ("spread", "stage")}
        assert len(got["spread"]) == count and got["spread"].keys() == want.keys()
        assert {n: tuple(t.shape) for n, t in got["spread"].items()} == want
        assert_same_bits(got["spread"], got["stage"])
    hf = hf_logits(layout, got["spread"], torch.from_numpy(res[0]["ids"]))
    mega = torch.from_numpy(res[0]["logits"])[..., :VOCAB]
    assert float((hf - mega).abs().max()) <= 1e-4
