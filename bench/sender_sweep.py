"""Sender sweep: every bucket size x buffer count x list, against one device copy of the bytes.

What the sender costs per refit where the wire is free (one GPU: a world-size-1 NCCL group, a
broadcast is a local no-op), as a ratio to one copy of the same bytes measured in the same run,
for the synthetic 20,000-tensor MoE list and the Qwen3-30B-A3B-shaped list; checksums off, then
on. On CPU (`--quick`) the usual gloo group of 2 trainers + 1 receiver, so the wire is in it.
The last line is one JSON object; its summary keys: `worst_sender_over_copy_2buf` (checksums
off, the worst list and bucket size with 2 buffers), `two_over_three_buffers_max` (2 buffers'
time over 3 buffers', the worst case) of the default sender (on CUDA each frame one graph
replay, `RefitConfig.graph_send`), the same with checksums on (`*_checksum`) and on CUDA with
eager frames (`*_eager`). Files measured before graph replay became the default name the
eager figures untagged and the graph ones `*_graph`.

    python3 bench/sender_sweep.py --out bench/results/sender_sweep_h200.json      # one H200
    OMP_NUM_THREADS=1 .venv/bin/python bench/sender_sweep.py --quick --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from bench_report import _hardware
from broadcast_bench import (
    DEFAULT_MODEL_SCALE,
    NO_MULTICAST,
    SHAPES,
    make_specs,
    make_tensors,
    rank_device,
    run_ranks,
    sync,
    time_refits,
    timed,
)
from model_shapes import MODELS, Shapes, qwen3_shapes, scaled
from provenance import finish

from common.config import RefitConfig
from common.source import DictWeightSource
from common.wire.group import RefitGroup

COPY_CHUNK = 1 << 30  # the copy baseline moves the list's bytes in chunks of this size


def sweep_lists(args: argparse.Namespace) -> dict[str, Shapes]:
    count, numel = SHAPES[args.shapes]["moe"]
    return {"moe": [(f"moe.{i}", (numel,)) for i in range(count)],
            "qwen3_30b_a3b": scaled(qwen3_shapes(MODELS["moe"][1]), args.scale)}


def copy_seconds(total: int, args: argparse.Namespace, device: torch.device) -> float:
    """Median time of one copy of `total` bytes on `device` (in chunks of real pages)."""
    n = min(total, COPY_CHUNK)
    src = torch.full((n,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        for start in range(0, total, n):
            k = min(n, total - start)
            dst[:k].copy_(src[:k], non_blocking=True)

    return statistics.median(timed(copy, args, device))


def fresh_device(device: torch.device) -> None:
    """Free what a case left (its sender, buffers and graphs, held in reference cycles until a
    collection) so that the next case starts as a trainer's first refit would."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sweep_list(group: RefitGroup, name: str, shapes: Shapes, args: argparse.Namespace,
               kept: list | None) -> dict[str, Any]:
    """Every (checksum, bucket size, buffer count) of one list on this rank (the senders
    that sent by graph replay into `kept`, if given)."""
    specs = make_specs(shapes, group.num_trainers)
    tensors = make_tensors(specs, group.device)
    mine = {s.name: t for s, t in zip(specs, tensors, strict=True)
            if s.source_rank == group.rank}
    out: dict[str, Any] = {"total_bytes": sum(s.nbytes for s in specs), "tensors": len(specs),
                           "copy_s": copy_seconds(sum(s.nbytes for s in specs), args,
                                                  group.device), "cases": []}

    def barrier() -> None:
        group.all_gather_bytes(b"", 8, f"{name} barrier")

    for checksum, graph in ((c, g) for g in args.graph_sends for c in args.checksums):
        os.environ["REFIT_CHECKSUM"] = "1" if checksum else "0"  # RefitConfig.from_env
        os.environ["REFIT_GRAPH_SEND"] = "1" if graph else "0"
        for mib in args.bucket_mibs:
            for nb in args.buffer_counts:
                case = argparse.Namespace(**{**vars(args), "bucket_bytes": mib << 20})
                source = DictWeightSource(mine) if group.is_trainer else None
                times, stats = time_refits(group, specs, source, nb, case, barrier, kept)
                fresh_device(group.device)
                out["cases"].append({"checksum": checksum, "graph_send": graph,
                                     "bucket_mib": mib, "buffers": nb, "times_s": times,
                                     "stats": stats})
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    device = rank_device(rank, args)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=max(1, world - 1), timeout_s=args.timeout, device=device)
    kept: list | None = [] if args.keep_graph_senders else None
    try:
        mine = {}
        for name, shapes in sweep_lists(args).items():
            mine[name] = sweep_list(group, name, shapes, args, kept)
            sync(device)
        for sender in kept or []:
            sender.close()
        gathered = group.all_gather_bytes(json.dumps(mine).encode(), 8 << 20, "gather results")
        return _report([json.loads(g) for g in gathered], group, args) if rank == 0 else None
    finally:
        group.destroy()


def _report(ranks: list[dict[str, Any]], group: RefitGroup,
            args: argparse.Namespace) -> dict[str, Any]:
    """Per case: the median over reps of the slowest rank, over the list's one copy."""
    lists: dict[str, Any] = {}
    for name, first in ranks[0].items():
        rows = []
        for i, case in enumerate(first["cases"]):
            per_rep = [max(r[name]["cases"][i]["times_s"][k] for r in ranks)
                       for k in range(len(case["times_s"]))]
            med = statistics.median(per_rep)
            rows.append({**{k: case[k] for k in ("checksum", "graph_send", "bucket_mib",
                                                 "buffers")},
                         "median_s": round(med, 6), "reps_s": [round(t, 6) for t in per_rep],
                         "over_copy": round(med / first["copy_s"], 3),
                         "stats": {f"rank{j}": r[name]["cases"][i]["stats"]
                                   for j, r in enumerate(ranks)}})
        lists[name] = {"tensors": first["tensors"], "total_bytes": first["total_bytes"],
                       "copy_s": round(first["copy_s"], 6), "cases": rows}
    report: dict[str, Any] = {"lists": lists, **summary(lists)}
    report["hardware"] = _hardware(group, args)
    report["settings"] = {"bucket_mibs": args.bucket_mibs, "buffers": args.buffer_counts,
                          "checksums": args.checksums, "graph_sends": args.graph_sends,
                          "warmup": args.warmup, "keep_graph_senders": args.keep_graph_senders,
                          "reps": args.reps, "scale": args.scale,
                          "timing": "each rank times itself from a barrier; per rep the "
                                    "slowest rank; median; over_copy: over one device copy "
                                    "of the list's bytes, same run"}
    return report


def summary(lists: dict[str, Any]) -> dict[str, float]:
    """The issue's figures: the worst 2-buffer case over one copy, the worst 2 vs 3 buffers;
    untagged for the default sender (`RefitConfig()`: graph replay on CUDA, whose cases say
    `graph_send`; eager on CPU), then the other one (`_eager` on CUDA) where it was measured."""
    out: dict[str, float] = {}
    default = RefitConfig().graph_send
    cuda = any(r.get("graph_send") for v in lists.values() for r in v["cases"])
    for checksum, graph in ((c, g) for g in (default, not default) for c in (False, True)):
        tag = "_checksum" * checksum + ("_eager" if cuda and not graph else "")
        over, ratios = [], []
        for v in lists.values():
            by = {(r["bucket_mib"], r["buffers"]): r for r in v["cases"]
                  if r["checksum"] == checksum and r.get("graph_send", False) == graph}
            over += [r["over_copy"] for (_, nb), r in by.items() if nb == 2]
            ratios += [r["median_s"] / by[mib, 3]["median_s"] for (mib, nb), r in by.items()
                       if nb == 2 and (mib, 3) in by]
        if over:
            out["worst_sender_over_copy_2buf" + tag] = max(over)
        if ratios:
            out["two_over_three_buffers_max" + tag] = round(max(ratios), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, gloo, small lists")
    ap.add_argument("--bucket-mib", default="64,96,128,256", help="comma-separated sizes")
    ap.add_argument("--buffers", default="1,2,3", help="comma-separated buffer counts")
    ap.add_argument("--checksum", default="both", choices=["off", "on", "both"])
    ap.add_argument("--graph-send", default=None, choices=["off", "on", "both"],
                    help="frames by CUDA graph replay (RefitConfig.graph_send); default: both "
                         "on CUDA, off on CPU")
    ap.add_argument("--keep-graph-senders", action="store_true",
                    help="keep each graph-replay case's sender open to the end (its graphs "
                         "alive: a destroyed frame graph slows the later cases' launches)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None, help="timed refits per case (3 / 5)")
    ap.add_argument("--scale", type=float, default=None, help="the model list's scale")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.shapes = "gpu" if args.device == "cuda" else "cpu"
    args.quick = args.device == "cpu"
    args.bucket_mibs = [int(x) for x in args.bucket_mib.split(",")]
    args.buffer_counts = [int(x) for x in args.buffers.split(",")]
    args.checksums = {"off": [False], "on": [True], "both": [False, True]}[args.checksum]
    graph = args.graph_send or ("off" if args.quick else "both")
    args.graph_sends = {"off": [False], "on": [True], "both": [False, True]}[graph]
    args.reps = args.reps or (3 if args.quick else 5)
    args.timeout, args.scale = 300.0, args.scale or DEFAULT_MODEL_SCALE[args.shapes]
    args.deadline = 20 * args.timeout
    world = 1 if args.device == "cuda" else 3  # one GPU: the sender alone; CPU: the wire too
    t0 = time.perf_counter()
    report = run_ranks(world, args, rank_main)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    for name, v in report["lists"].items():
        for r in v["cases"]:
            print(f"{name:14s} checksum={int(r['checksum'])} graph={int(r['graph_send'])} "
                  f"{r['bucket_mib']:4d} MiB "
                  f"{r['buffers']} buf {r['median_s'] * 1e3:9.2f} ms  {r['over_copy']:6.2f}x copy")
    finish(report, summary(report["lists"]), args.out)


if __name__ == "__main__":
    sys.exit(main())
