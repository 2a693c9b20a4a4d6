"""The cost model for frames sent by CUDA graph replay (`RefitConfig.graph_send`, the default on
CUDA), checked against the sender sweeps' graph cases it was not calibrated on.

Per bucket the host takes its tensors (seconds per tensor) and replays; the device packs at the
lend's measured pack rate, then pays a cost per frame (the header copy, the captured broadcast's
nodes) and one per graph launch (a dict's frames go in runs of buffers + 1, the first frame
alone), all on one stream (`StageCosts.one_stream`). Calibration, per lend: the pack rate from
that lend's broadcast-bench run (`cost_model_check.machine`), the rest from the sweep's own
synthetic list at 64 MiB with 1 and 2 buffers (two run lengths: frame and launch costs apart,
`fit_host`). Held out: that list's other bucket sizes and 3 buffers, and every case of the
Qwen3-30B-A3B-shaped list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_model_check import EXCEPTIONS, Machine, buckets_of, machine, sweep_shapes
from cost_model_core import Bucket, StageCosts, fit_host, simulate
from cost_model_inputs import load, stamp

CAL_MIB = 64
# sender sweep file -> the same lend's broadcast-bench run (its pack rate)
GRAPH_SWEEPS = {f"sender_sweep_h100_run{k}": f"gpu_h100x1_sweep_cal_run{k}"
                for k in (4, 6, 7, 8, 9, 11)}
GRAPH_NOT_HELD_OUT = {
    "sender_sweep_h100, sender_sweep_h100_run2, sender_sweep_h100_run3, sender_sweep_h200_run2":
    "measured before a dict's frames went in runs (one launch a frame)",
    "sender_sweep_h100_run5": "its calibrating case (the MoE list at 64 MiB, 1 buffer, 9.8 ms) "
    "took 1.14x its 2-buffer case while the model list's 1, 2 and 3 buffer cases at 64 MiB "
    "agree within 1%: held out, 19 of 22 within 25% (the model list at 64 / 96 MiB with 1 "
    "buffer +41% / +31%)",
    "sender_sweep_h100_run10": "the slowest and noisiest host on record, its graph cases out of "
    "order (MoE 96 MiB: 1 buffer 7.1 ms, 2 buffers 13.5, 3 buffers 9.5): held out, 14 of 22 "
    "within 25%",
}


@dataclass(frozen=True)
class GraphMachine:
    base: Machine  # the lend's eager calibration: pack rate, wire
    host_s: float  # host seconds per tensor (the take and the replay's share)
    frame_s: float  # device seconds per frame beyond its pack
    launch_s: float  # device seconds per graph launch


def starts_launch(i: int, buffers: int) -> bool:
    """Whether a dict's bucket `i` starts a graph launch: the first frame alone, then runs of
    `buffers` + 1 frames, as the sweeps held out were sent (since b71651a a refit's first runs
    grow 1, 1, 2, ...: one or two launches more a refit)."""
    return i == 0 or (i - 1) % (buffers + 1) == 0


def graph_costs(g: GraphMachine, buckets: list[Bucket], buffers: int) -> StageCosts:
    device = [b.nbytes / g.base.pack_Bps + g.frame_s + g.launch_s * starts_launch(i, buffers)
              for i, b in enumerate(buckets)]
    wire = [b.nbytes / g.base.wire_Bps if g.base.wire_Bps else 0.0 for b in buckets]
    return StageCosts([b.tensors * g.host_s for b in buckets], device, wire,
                      [0.0] * len(buckets), overlap=True, one_stream=True)


def predict(g: GraphMachine, shapes, bucket_bytes: int, buffers: int) -> float:
    buckets = buckets_of(shapes, 1, bucket_bytes)
    return simulate(buckets, graph_costs(g, buckets, buffers), buffers).seconds


def graph_cases_of(report: dict, name: str) -> dict[tuple[int, int], dict]:
    return {(c["bucket_mib"], c["buffers"]): c for c in report["lists"][name]["cases"]
            if c.get("graph_send") and not c["checksum"]}


def graph_machine(sweep: str, cal: str) -> GraphMachine:
    """Calibrated on the sweep's synthetic list at `CAL_MIB` with 1 and 2 buffers (see above)."""
    r, base = load(sweep), machine(cal)
    shapes, cases = sweep_shapes(r, "moe", r["lists"]["moe"]), graph_cases_of(r, "moe")
    stats = cases[CAL_MIB, 2]["stats"]["rank0"]
    host_s = (stats["produce_s"] + stats["pack_s"]) / len(shapes)
    bare = GraphMachine(base, host_s, 0.0, 0.0)
    n = len(buckets_of(shapes, 1, CAL_MIB << 20))
    rows = [(n, sum(starts_launch(i, nb) for i in range(n)),
             cases[CAL_MIB, nb]["median_s"] - predict(bare, shapes, CAL_MIB << 20, nb))
            for nb in (1, 2)]
    frame_s, launch_s = fit_host(rows)
    return dataclasses.replace(bare, frame_s=frame_s, launch_s=launch_s)


def graph_sweep_cases() -> list[dict]:
    """Every checksum-off graph case of each sweep in `GRAPH_SWEEPS` but the calibration's."""
    out = []
    for file, cal in GRAPH_SWEEPS.items():
        r, g = load(file), graph_machine(file, cal)
        for name, v in r["lists"].items():
            shapes = sweep_shapes(r, name, v)
            for (mib, nb), case in sorted(graph_cases_of(r, name).items()):
                if name == "moe" and mib == CAL_MIB and nb < 3:
                    continue  # what calibrated it
                p, t = predict(g, shapes, mib << 20, nb), case["median_s"]
                method = f"graph_{nb}buf @ {mib} MiB"
                why = EXCEPTIONS.get((file, name, method))
                out.append({"run": file, "stamp": stamp(file), "calibrated_on": f"{cal} + {file}",
                            "list": name, "method": method, "measured_s": t,
                            "predicted_s": round(p, 6), "error": round((p - t) / t, 3),
                            **({"exception": why} if why else {})})
    return out
