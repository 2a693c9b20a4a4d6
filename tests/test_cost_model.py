"""The cost model (`bench/cost_model.py`): its arithmetic on small hand-computed cases, every
constant it reads present in bench/results/, clear errors on bad input, and the
"At scale" tables of docs/at-scale.md equal to the model's output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from cost_model import main, parse_layout  # noqa: E402
from cost_model_check import CALIBRATION, HELD_OUT, SWEEPS, Machine, costs, machine  # noqa: E402
from cost_model_core import Bucket, StageCosts, cut, fit_host, interleave, simulate  # noqa: E402
from cost_model_graph import GRAPH_SWEEPS, graph_costs, graph_machine, starts_launch  # noqa: E402
from cost_model_inputs import RESULTS, load  # noqa: E402
from cost_model_readme import FILES, TABLES, render  # noqa: E402
from cost_model_scale import Engine, LayoutError, Links, Options, Trainer, figures, wire_fraction  # noqa: E402


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


def test_cost_model_readme_at_scale_is_the_models_output() -> None:
    found = set()
    for path in FILES:
        text = path.read_text()
        assert render(text) == text, (
            f"{path.name}'s At scale tables differ from the cost model: run "
            "`python bench/cost_model.py --write-readme`")
        found |= {name for name in TABLES if f"<!-- cost_model:{name} -->" in text}
    assert found == set(TABLES), set(TABLES) - found
