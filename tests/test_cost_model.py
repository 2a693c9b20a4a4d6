"""The cost model (`bench/cost_model.py`): its arithmetic on small hand-computed cases, every
constant it reads present in bench/results/, clear errors on bad input, and the
"At scale" tables of docs/at-scale.md equal to the model's output."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.plan import TensorSpec, balance_sources
from mcore_refit.placement import RankInfo
from mcore_refit.placement import place_stage as library_place_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from cost_model import main, parse_layout  # noqa: E402
from cost_model_check import CALIBRATION, HELD_OUT, SWEEPS, Machine, costs, machine  # noqa: E402
from cost_model_core import (  # noqa: E402
    Bucket,
    StageCosts,
    concurrent,
    cut,
    fit_host,
    imbalance,
    interleave,
    place_stage,
    simulate,
    spread,
)
from cost_model_graph import GRAPH_SWEEPS, graph_costs, graph_machine, starts_launch  # noqa: E402
from cost_model_inputs import RESULTS, load  # noqa: E402
from cost_model_readme import (  # noqa: E402
    CONCURRENT,
    CONCURRENT_TOPOLOGIES,
    FILES,
    H100,
    H200,
    TABLES,
    TOPOLOGIES,
    render,
)
from cost_model_scale import (  # noqa: E402
    Engine,
    LayoutError,
    Links,
    Options,
    Trainer,
    _placed,
    _rates,
    _stages,
    _stream,
    concurrency,
    figures,
    joined_gathers,
    predict,
    sources,
    streams,
    wire_fraction,
    worker_bytes,
)
from model_shapes import CONFIGS, experts_of  # noqa: E402


def test_cost_model_cuts_buckets_per_sender_and_size() -> None:
    items = [(0, 40, False), (0, 40, True), (0, 40, False), (1, 10, False), (1, 200, False)]
    assert cut(items, 100) == [Bucket(0, 2, 80, 40), Bucket(0, 1, 40), Bucket(1, 1, 10),
                               Bucket(1, 1, 200)]


def _three(host: float, wire: float, apply: float = 0.0) -> tuple[list[Bucket], StageCosts]:
    return [Bucket(0, 1, 1)] * 3, StageCosts([host] * 3, [0.0] * 3, [wire] * 3, [apply] * 3)


def test_cost_model_pipeline_by_hand() -> None:
    b, c = _three(host=2.0, wire=1.0)
    # the sender takes a bucket before it waits for a buffer: with 1 buffer too its takes
    # run back to back while the wire carries the last one: 2 x 3 + 1
    assert simulate(b, c, 1).seconds == pytest.approx(7.0)
    t = simulate(b, c, 2)
    assert t.seconds == pytest.approx(7.0) and t.bound == "sender"
    b, c = _three(host=1.0, wire=3.0, apply=0.5)
    t = simulate(b, c, 2)  # wire-bound: 1 + 3 x 3 + the last apply
    assert t.seconds == pytest.approx(10.5) and t.bound == "wire"
    assert sum(t.totals.values()) == pytest.approx(t.seconds)
    # 1 buffer: each pack after the first waits for the last bucket's wire and starts the
    # hand-back after it (the last apply is done by then): 1 + 3, then 2 x (0.5 + 3), then
    # the last apply; the first bucket waits for nothing, so it pays no hand-back
    assert simulate(b, c, 1, handback_s=0.5).seconds == pytest.approx(1 + 3 + 2 * 3.5 + 0.5)
    # the hand-back's share per tensor (the pack's host calls a tensor): buckets of 4 tensors
    four = [Bucket(0, 4, 1)] * 3
    assert simulate(four, c, 1, handback_s=0.5, handback_tensor_s=0.25).seconds == \
        pytest.approx(1 + 3 + 2 * (3 + 0.5 + 4 * 0.25) + 0.5)
    assert simulate(four, c, 2, handback_s=0.5, handback_tensor_s=0.25).seconds == \
        pytest.approx(simulate(four, c, 2).seconds)  # 2 buffers: no hand-back waited for
    # a pack on the host (CPU) holds the host: 2 buffers, take 1 + pack 2 per bucket
    three = [Bucket(0, 1, 1)] * 3
    cpu = StageCosts([1.0] * 3, [2.0] * 3, [0.5] * 3, [0.0] * 3, overlap=False)
    gpu = StageCosts([1.0] * 3, [2.0] * 3, [0.5] * 3, [0.0] * 3, overlap=True)
    assert simulate(three, cpu, 2).seconds == pytest.approx(3 * 3 + 0.5)
    assert simulate(three, gpu, 2).seconds == pytest.approx(1 + 3 * 2 + 0.5)  # device-bound


def test_cost_model_interleave_takes_senders_in_turn_and_overlaps_their_work() -> None:
    a, b, c = (Bucket(s, 1, n) for s, n in ((0, 1), (1, 2), (2, 3)))
    a2, b2 = Bucket(0, 1, 4), Bucket(1, 1, 5)
    assert interleave([a, a2, b, b2, c]) == [a, b, c, a2, b2]  # each sender's order kept
    # two senders, 4 buckets each, 2 s to take, 1 s on the wire, 2 buffers. In plan order
    # the first sender's buckets leave at 3, 5, 7, 9; the second had 2 packed and a third
    # taken, sends them at 9-12 (the third packed once a buffer is back, at 10), takes its
    # last at 10-12: 13. In turn both take at once: a bucket leaves every second from 2 on.
    bs = [Bucket(0, 1, 1)] * 4 + [Bucket(1, 1, 1)] * 4
    costs = StageCosts([2.0] * 8, [0.0] * 8, [1.0] * 8, [0.0] * 8)
    in_order, in_turn = simulate(bs, costs, 2), simulate(interleave(bs), costs, 2)
    assert in_order.seconds == pytest.approx(13.0)
    assert in_order.totals["sender"] == pytest.approx(5.0)  # the wire waiting on a sender
    assert in_turn.seconds == pytest.approx(10.0)
    assert in_turn.totals["sender"] == pytest.approx(2.0)  # only for the first bucket


def test_cost_model_per_bucket_term_is_fitted_and_paid_per_bucket() -> None:
    per_tensor, per_bucket = 3e-7, 8e-5
    lists = [(t, b, t * per_tensor + b * per_bucket) for t, b in ((20_000, 30), (400, 50))]
    assert fit_host(lists) == pytest.approx((per_tensor, per_bucket))
    assert fit_host(lists[:1]) == pytest.approx((lists[0][2] / 20_000, 0.0))  # one list
    # more host time for fewer buckets: no per-bucket cost can explain it, tensors take all
    assert fit_host([(100, 10, 1.0), (100, 20, 0.5)]) == pytest.approx((1.5 / 200, 0.0))
    # a host-bound sender (the wire free, the pack fast): every bucket pays its host cost
    m = Machine("by hand", per_tensor, per_bucket, 1e18, 0.0, True, 1, 0)
    for n in (1, 7, 40):
        bs = [Bucket(0, 500, 1000)] * n
        assert simulate(bs, costs(m, bs), 2).seconds == pytest.approx(
            n * (500 * per_tensor + per_bucket))
    # the lends on record show one: their synthetic lists are fitted with it
    assert all(machine(run).bucket_s > 0 for run in CALIBRATION)
    assert figures()["host_s_per_bucket"].expected > 0


def test_cost_model_graph_replay_is_one_stream_with_costs_per_frame_and_launch() -> None:
    # one stream: no host wait for a buffer, each pack after the previous broadcast; host 1,
    # pack 2, wire 3 a bucket: 1 + 2 + 3, then 2 x (2 + 3), whatever the buffer count
    three = [Bucket(0, 1, 1)] * 3
    graph = StageCosts([1.0] * 3, [2.0] * 3, [3.0] * 3, [0.0] * 3, one_stream=True)
    for buffers in (1, 2, 3):
        assert simulate(three, graph, buffers).seconds == pytest.approx(1 + 5 + 2 * 5)
    eager = StageCosts([1.0] * 3, [2.0] * 3, [3.0] * 3, [0.0] * 3)  # the pack beside the wire
    assert simulate(three, eager, 2).seconds == pytest.approx(1 + 2 + 3 * 3)
    # a dict's frames: the first alone, then runs of buffers + 1, one launch each
    assert [i for i in range(8) if starts_launch(i, 2)] == [0, 1, 4, 7]
    # each lend's calibration: a positive host rate, frame and launch costs never negative,
    # and the device paid per frame and per launch on top of the pack
    for sweep, calibration in GRAPH_SWEEPS.items():
        g = graph_machine(sweep, calibration)
        assert g.host_s > 0 and g.frame_s >= 0 and g.launch_s >= 0 and g.frame_s + g.launch_s > 0
        bs = [Bucket(0, 10, 1 << 20)] * 4
        c = graph_costs(g, bs, 1)
        assert c.one_stream and c.device[1] - c.device[2] == pytest.approx(g.launch_s)
        assert c.device[2] == pytest.approx((1 << 20) / g.base.pack_Bps + g.frame_s)


def test_cost_model_delta_wire_fraction_matches_the_codec() -> None:
    measured = load("delta_codec_h200")["summary"]
    assert wire_fraction(0.03) == pytest.approx(measured["wire_fraction_3pct"], abs=1e-3)
    assert wire_fraction(0.15) == pytest.approx(measured["wire_fraction_15pct"], abs=1e-3)


def test_cost_model_constants_are_in_the_results() -> None:
    for run in {*CALIBRATION, *HELD_OUT}:
        assert (RESULTS / f"{run}.json").exists(), run
        m = machine(run)
        assert m.host_s > 0 and m.pack_Bps > 0 and m.handback_s >= 0 and m.handback_tensor_s >= 0
    for sweep, calibration in SWEEPS.items():
        assert load(sweep)["lists"] and calibration in CALIBRATION, sweep
    for f in figures().values():
        # an FP8 refit may take no longer than the bf16 one: its quantize then costs nothing
        assert f.best > 0 or (f.best == 0 and f.name == "quantize_over_copy"), f.name
        assert f.expected > 0 and f.worst > 0, f.name
        if f.measured:
            assert (RESULTS / f.source).exists() and f.stamp, f.name


@pytest.mark.parametrize("argv, says", [
    (["--model", "GPT-9"], "unknown model"),
    (["--model", "Qwen3-30B-A3B", "--engine", "tp=3"], "does not divide"),
    (["--model", "Qwen3-30B-A3B", "--trainer", "ep=7"], "does not divide"),
    (["--model", "Qwen3-30B-A3B", "--nics", "0"], "zero links"),
    (["--model", "Qwen3-30B-A3B", "--trainer", "tq=2"], "expected KEY=INT"),
    (["--model", "DeepSeek-V3", "--engine", "tp=8"], "per engine GPU"),
])
def test_cost_model_bad_input_is_a_clear_error(argv, says, capsys) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_cost_model_answers_a_users_case(capsys) -> None:
    assert main(["--model", "Qwen3-30B-A3B", "--trainer", "tp=2,ep=8,dp=8",
                 "--engine", "tp=4,dp=4"]) == 0
    out = capsys.readouterr().out
    assert '"bound"' in out and '"stages_s"' in out and "gpu_h200x1.json" in out
    assert parse_layout(Engine, "tp=8,ep=16") == Engine(tp=8, ep=16)
    with pytest.raises(LayoutError):
        parse_layout(Trainer, "tp=x")
    assert Links().nics_per_node == 8 and Options().buffers == 2


def test_cost_model_concurrent_core_is_simulate_per_stream_then_the_shared_links() -> None:
    b, c = _three(host=1.0, wire=3.0, apply=0.5)
    # one stream and no shared link: the one-stream simulation itself
    assert concurrent([(b, c)], {}, 2).seconds == pytest.approx(simulate(b, c, 2).seconds)
    # two streams run at once: the slower one's end, not their sum
    slow = StageCosts([2.0] * 3, [0.0] * 3, [3.0] * 3, [0.5] * 3)
    t = concurrent([(b, c), (b, slow)], {"trainer egress": 1.0}, 2)
    assert t.seconds == pytest.approx(simulate(b, slow, 2).seconds) and t.bound == "source"
    assert t.detail == simulate(b, slow, 2).totals  # the slowest stream's own split
    # a shared link that needs longer than every stream bounds the refit and says so
    t = concurrent([(b, c)], {"trainer egress": 1.0, "engine ingress": 20.0}, 2)
    assert t.seconds == 20.0 and t.bound == "engine ingress"


def test_cost_model_concurrent_imbalance_is_one_when_balanced() -> None:
    # largest first onto the least loaded candidate: six tensors over two ranks end equal
    sizes, loads = [3, 3, 2, 2, 1, 1], {}
    spread(loads, [(n, (0, 1)) for n in sizes])
    assert loads == {0: 6, 1: 6} and imbalance(list(loads.values())) == 1.0
    assert spread({0: 5}, [(3, (0, 1)), (2, (0, 1))]) == [1, 1]  # what a rank sends counts
    assert spread({}, [(4, (0,)), (1, (0, 1))]) == [0, 1]  # a tensor only its candidates
    assert imbalance([2, 1, 0]) == 2.0 and imbalance([]) == 1.0
    # an engine whose EP divides the experts: every GPU holds the same bytes
    assert imbalance(worker_bytes("DeepSeek-V3", Engine(tp=8, ep=32))) == 1.0
    for model, t, e in CONCURRENT_TOPOLOGIES.values():
        assert min(concurrency(model, t, e)["imbalance"].values()) >= 1.0


# (TP, DP, EP, expert-TP) of one stage: the table's V3, its ETP2 variant, K2 (two EDP
# replicas), 235B, expert-TP 2 with one and with two EDP replicas
STAGES = [(2, 4, 8, 1), (2, 4, 4, 2), (2, 8, 8, 1), (4, 2, 8, 1), (2, 2, 2, 2), (2, 4, 2, 2)]


@pytest.mark.parametrize("tp, dp, ep, etp", STAGES)
def test_cost_model_concurrent_sources_are_placed_as_the_library_places_them(tp, dp, ep,
                                                                            etp) -> None:
    """`place_stage` is `mcore_refit.placement.place_stage` on Megatron's expert grid (ETP,
    then EP, then EDP): experts from their owners (one per EDP replica), dense tensors from any
    rank; no fallback."""
    infos = [RankInfo(r, r // etp % ep, r % etp, r // (etp * ep)) for r in range(tp * dp)]
    library = library_place_stage(infos, experts=True)
    assert library.spread and place_stage(tp, dp, ep, etp, True) == (library.owners,
                                                                     library.dense)
    assert {len(o) for o in library.owners} == {tp * dp // (ep * etp)}  # EDP replicas
    assert place_stage(tp, dp, 1, 1, False) == ((), tuple(range(tp * dp)))  # a dense stage


@pytest.mark.parametrize("topology", ["V3: 128 -> 64", "K2: 256 -> 128"])
def test_cost_model_concurrent_spreads_tensors_as_balance_sources_does(topology) -> None:
    """Dense tensors over the stage, experts over their owners (K2: two EDP replicas)."""
    model, t, _ = CONCURRENT_TOPOLOGIES[topology]
    placed, width, experts = _placed(model, t.pp), t.tp * t.dp, experts_of(CONFIGS[model])
    stages, specs, candidates = _stages(model, t), [], {}
    for i, ((stage, k, n), (rank, _, _)) in enumerate(zip(placed, sources(model, t),
                                                          strict=True)):
        owners, dense = stages[stage]
        ranks = [stage * width + r for r in (owners[k * t.ep // experts] if k is not None
                                             else dense)]
        assert rank in ranks  # every tensor from a rank of its own stage
        specs.append(TensorSpec(str(i), (n,), torch.uint8, ranks[0]))
        candidates[str(i)] = ranks
    assert [s.source_rank for s in balance_sources(specs, candidates)] == [
        r for r, _, _ in sources(model, t)]
    for name, count in (("V3: 128 -> 64", 128), ("V3: 128 -> 64, ETP2", 128),
                        ("K2: 256 -> 128", 256), ("235B: 8 -> 8", 8)):
        assert concurrency(*CONCURRENT_TOPOLOGIES[name])["sources"] == count, name


@pytest.mark.parametrize("topology", ["30B: 16 -> 16", "K2: 256 -> 128"])
def test_cost_model_concurrent_spreads_experts_over_edp_replicas(topology) -> None:
    """Two EDP replicas (expert-TP 1): every rank of a stage owns experts, and both replicas'
    owners send them, about half each; the sources end within 10% of the mean (replica 0's
    owners alone sent 1.90x the mean on 30B, 2.11x on K2)."""
    model, t, e = CONCURRENT_TOPOLOGIES[topology]
    width, by_replica = t.tp * t.dp, [0, 0]
    assert width == 2 * t.ep * t.etp
    for rank, n, expert in sources(model, t):
        by_replica[rank % width // t.ep] += n if expert else 0
    assert by_replica[1] == pytest.approx(by_replica[0], rel=0.05)
    assert concurrency(model, t, e)["imbalance"]["source_bytes"] <= 1.1


def test_cost_model_concurrent_sources_spend_the_gathers_they_share() -> None:
    # TP2, expert-TP 1: a rank runs its TP peer's dense gathers, half of each tensor moved
    model, t, _ = CONCURRENT_TOPOLOGIES["V3: 128 -> 64"]
    dense = {}
    for rank, n, expert in sources(model, t):
        dense[rank] = dense.get(rank, 0) + (0 if expert else n)
    joined = joined_gathers(model, t)
    assert all(joined[r] == pytest.approx(dense[r ^ 1] / 2) for r in dense)
    # expert-TP 2: the owner's expert-TP peer (a dense source) also runs its experts' gathers
    model, t, _ = CONCURRENT_TOPOLOGIES["V3: 128 -> 64, ETP2"]
    experts = sum(n for r, n, ex in sources(model, t) if ex and r == 0)
    assert joined_gathers(model, t)[1] >= experts / 2 > 0
    # and spends them: its stream's device time grows by their NVLink time
    f, bs = figures(), streams(model, t, 256 << 20)[1]
    r = _rates(f, H100, "expected")
    args = (1.0, Trainer(tp=2, etp=2), Engine(tp=8), Options(), f, r, "expected")
    alone, shared = _stream(bs, 0.0, *args)[1], _stream(bs, 1e9, *args)[1]
    assert sum(shared.device) - sum(alone.device) == pytest.approx(1e9 / r["nvbus"])


@pytest.mark.parametrize("topology", CONCURRENT_TOPOLOGIES)
def test_cost_model_concurrent_never_slower_than_the_interleaved_one_stream(topology) -> None:
    """Every case of the table: the placement gives every stage several sources (8 or 16),
    each stream on its own GPU's NIC."""
    model, t, e = CONCURRENT_TOPOLOGIES[topology]
    assert concurrency(model, t, e)["sources"] >= 8 * t.pp
    links = H200 if topology == "V3: 64 -> 32" else H100  # bf16 V3 does not fit 32 H100s
    for name, o in CONCURRENT.items():
        one = predict(model, t, e, links, replace(o, interleave=True))["seconds"]
        many = predict(model, t, e, links, replace(o, concurrent=True))["seconds"]
        assert all(many[c] <= one[c] + 1e-9 for c in one), (name, one, many)


def test_cost_model_concurrent_with_one_source_is_the_one_stream_model() -> None:
    case = ("Qwen3-8B", Trainer(), Engine(tp=2), H100)
    for o in CONCURRENT.values():
        many = predict(*case, replace(o, concurrent=True))
        assert many["concurrent"]["sources"] == 1
        assert many["seconds"] == predict(*case, o)["seconds"]


def test_cost_model_concurrent_reports_the_engine_ingress_bound(capsys) -> None:
    assert main(["--model", "DeepSeek-V3", "--trainer", "tp=2,pp=16,ep=8,dp=4",
                 "--engine", "tp=8,ep=32,dp=2", "--mode", "shard", "--concurrent"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"] == "engine ingress" == max(out["stages_s"], key=out["stages_s"].get)
    assert out["concurrent"]["sources"] == 128
    assert "concurrent_shard_rails" in out["constants"] and "source_rail" in out["constants"]


def test_cost_model_concurrent_source_sends_by_its_own_gpus_nic() -> None:
    # one trainer node, eight owners of 235B's experts: each sends an eighth of the model by
    # its own NIC, the slowest of them ends the refit (the node's eight NICs all busy)
    model, t, e = TOPOLOGIES["235B: 8 -> 8"]
    many = predict(model, t, e, H100, Options(concurrent=True))
    assert many["concurrent"]["sources"] == 8 and many["bound"] == "source"
    sent: dict[int, int] = {}
    for rank, n, _ in sources(model, t):
        sent[rank] = sent.get(rank, 0) + n
    nic = H100.nic_Gbps / 8 * 1e9 * figures()["ib_efficiency"].expected
    assert many["stages_s"]["source"] >= max(sent.values()) / nic


def test_cost_model_readme_at_scale_is_the_models_output() -> None:
    found = set()
    for path in FILES:
        text = path.read_text()
        assert render(text) == text, (
            f"{path.name}'s At scale tables differ from the cost model: run "
            "`python bench/cost_model.py --write-readme`")
        found |= {name for name in TABLES if f"<!-- cost_model:{name} -->" in text}
    assert found == set(TABLES), set(TABLES) - found
