"""Pipeline stages, HSDP and dp x ep over real gloo ranks: merged plan, exact refits, gathers
only where their result is used, and setup errors that name the tensor."""

from __future__ import annotations

import pytest
import torch

from common.plan import TensorSpec
from dtensor_refit import LayoutError
from dtensor_refit.stages import Report, check_complete, merge
from tests.dtensor.split import TRAINERS, Layout
from tests.dtensor.stage_ranks import setup_error_job, stage_job


def check(results: list, layout: Layout) -> list[dict]:
    trainers, receiver = results[:TRAINERS], results[TRAINERS]
    assert len({r["specs"] for r in trainers}) == 1, "specs differ between training ranks"
    for rank, r in enumerate(trainers):
        assert r["yielded"] == r["sourced"], f"rank {rank} yields what it does not send"
    assert sorted(trainers[0]["names"]) == receiver["names"]
    n = len(receiver["names"])
    assert receiver["received"] == {1: n, 2: n}
    return trainers


@pytest.mark.parametrize("layout", [Layout("pp_dict"), Layout("pp_hf", tie=True),
                                    Layout("pp_hf", "qwen3_moe")], ids=str)
def test_two_stages_fsdp2_dp2(pool, layout: Layout) -> None:
    """Each stage sends its own tensors from its first rank and gathers only in its mesh."""
    trainers = check(pool.run(stage_job, layout), layout)
    # MoE: FSDP2's Shard(0) splits stage 1's 4 experts, rank 3 sends its own 2 (experts 2, 3)
    owned = sorted(n for n, r in trainers[0]["expert_sources"].items() if r == 3)
    assert len(owned) == (3 * 2 if layout.arch == "qwen3_moe" else 0), owned
    assert trainers[0]["sources"] == ([0, 2, 3] if owned else [0, 2])
    names = trainers[0]["names"]
    assert names[0] == "model.embed_tokens.weight" and names.count(names[0]) == 1
    assert ("lm_head.weight" in names) != layout.tie  # tied: sent once, as the embedding
    assert trainers[1]["yielded"] == [] and trainers[3]["yielded"] == owned
    assert all(n.startswith("model.layers.1.") or n in ("model.norm.weight", "lm_head.weight")
               for n in trainers[2]["yielded"])
    for r in trainers:  # no rank gathers another stage's tensors (nor experts it holds)
        assert r["gathers"] == r["own_gathers"] > 0, r


def test_hsdp_other_replica_runs_no_gather(pool) -> None:
    """(Replicate(), Shard(0)) on 2 x 2: only the replica of rank 0 all-gathers."""
    trainers = check(pool.run(stage_job, Layout("hsdp")), Layout("hsdp"))
    assert trainers[2]["placements"] == ["(Replicate(), Shard(dim=0))"]
    gathers = [r["gathers"] for r in trainers]
    assert gathers[0] == gathers[1] > 0 and gathers[2] == gathers[3] == 0, gathers


# layout -> (the experts' placements, the rank holding each of the 4 experts: mesh
# [[0, 1], [2, 3]] over (dp_mod_ep, ep): ep j holds experts 2j, 2j+1, dp i the i-th of them)
EXPERT_LAYOUTS = {"dpep": ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", [0, 2, 1, 3]),
                  "dpep_s1": ("(Shard(dim=1), Shard(dim=0))", [0, 2, 1, 3]),
                  "ep": ("(Shard(dim=0),)", [0, 1, 2, 3])}


@pytest.mark.parametrize("kind", EXPERT_LAYOUTS)
def test_expert_owners_send_their_experts(pool, kind: str) -> None:
    """Exact; each expert sent by the rank holding it; expert gathers only inside an EP group."""
    layout = Layout(kind, "qwen3_moe")
    trainers = check(pool.run(stage_job, layout), layout)
    placements, owner = EXPERT_LAYOUTS[kind]
    assert placements in trainers[0]["placements"], trainers[0]["placements"]
    sources = trainers[0]["expert_sources"]
    assert len(sources) == 3 * 4 and len(set(sources.values())) == 4
    for name, src in sources.items():
        assert src == owner[int(name.split(".experts.")[1].split(".")[0])], (name, src)
    # dim 1 split by FSDP2: one gather per fused tensor (2) over dp inside each EP group;
    # otherwise every rank holds its experts whole and gathers nothing for them
    want = 2 if kind == "dpep_s1" else 0
    assert [r["expert_gathers"] for r in trainers] == [want] * TRAINERS


def test_dp_x_ep_gathered(pool) -> None:
    """expert_sources="gather": every expert gathered whole and sent from rank 0, exact."""
    layout = Layout("dpep", "qwen3_moe", experts="gather")
    trainers = check(pool.run(stage_job, layout), layout)
    assert set(trainers[0]["expert_sources"].values()) == {0}
    assert all(r["expert_gathers"] > 0 for r in trainers)


@pytest.mark.parametrize(("layout", "match"), [
    (Layout("pp_hf", tie=True, skew=True),
     "'model.embed_tokens.weight' is in the stage on ranks \\[0, 1\\].*different values"),
    (Layout("pp_dict", drop_layer=1),
     "'model.layers.1.self_attn.q_proj.weight' is missing from every pipeline stage"),
], ids=["overlap-values", "missing"])
def test_stage_setup_errors_name_the_tensor(pool, layout: Layout, match: str) -> None:
    import re

    errors = pool.run(setup_error_job, layout)[:TRAINERS]
    assert all(e is not None and re.search(match, e) for e in errors), errors


def _report(rank: int, ranks: tuple[int, ...], metas) -> Report:
    return Report(rank, (((ranks, 0), tuple(metas)),))


def test_merge_orders_stages_and_rejects_conflicts() -> None:
    emb = ("model.embed_tokens.weight", (8, 4), "bfloat16")
    l0, l1 = ("model.layers.0.w", (4,), "bfloat16"), ("model.layers.1.w", (4,), "bfloat16")
    reports = [_report(3, (2, 3), [l1, emb]), _report(0, (0, 1), [emb, l0]),
               _report(1, (0, 1), [emb, l0]), _report(2, (2, 3), [l1, emb])]
    merged = merge(reports)
    assert [(s.name, s.source_rank) for s in merged.specs] == \
        [(emb[0], 0), (l0[0], 0), (l1[0], 2)]
    assert merged.overlaps == {emb[0]: (((0, 1), 0), ((2, 3), 0))}
    wide = (emb[0], (9, 4), "bfloat16")
    with pytest.raises(LayoutError, match="'model.embed_tokens.weight' is in the stage on ranks "
                                          r"\[0, 1\].*\[8, 4\].*\[9, 4\]"):
        merge([_report(0, (0, 1), [emb]), _report(2, (2, 3), [wide])])
    with pytest.raises(LayoutError, match="ranks 0 and 1 of the stage on ranks"):
        merge([_report(0, (0, 1), [emb]), _report(1, (0, 1), [l0])])
    with pytest.raises(LayoutError, match="rank 1: ValueError: boom"):
        merge([_report(0, (0, 1), [emb]), Report(1, (), "ValueError: boom")])
    with pytest.raises(LayoutError, match=r"layer 1 \(tensors '\*.layers.1.\*'\) is missing"):
        check_complete([TensorSpec(n, s, torch.bfloat16) for n, s, _ in (l0, emb)
                        ] + [TensorSpec("model.layers.2.w", (4,), torch.bfloat16)], None)
