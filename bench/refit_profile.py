"""Where one refit's device time goes, against its wall time: the kernels of a few refits of a
sweep list (world size 1, NCCL: the sender's own work) by `torch.profiler`, per kernel name its
count and device time a refit, and how much of the refit the device was busy. A refit whose
device is busy far less than its wall time is host-bound (`--host N`: then its N costliest
calls by cProfile, to stderr); one whose device time exceeds the copy's is the kernels'.

    python3 bench/refit_profile.py --list qwen3_30b_a3b --bucket-mib 64 --graph-send
    python3 bench/refit_profile.py --list moe --bucket-mib 256 --fp8 --host 40
    python3 bench/refit_profile.py --list qwen3_30b_a3b --graph-send --after 1  # later case
    python3 bench/refit_profile.py --list qwen3_30b_a3b --graph-send --after 1 --after-mode open
    python3 bench/refit_profile.py --list moe --bucket-mib 256 --fp8 --graph-send --timeline 60
    python3 bench/refit_profile.py --list moe --bucket-mib 256 --fp8 --graph-send --host-timeline

A later sender (`--after`) of a process whose earlier sender's frame graphs were destroyed
ran slower than the first on the H100 lends (the device idle between graph launches); the
`--after-mode` variants and `--eager-broadcast` (no captured broadcast) narrow down why.

The last line is one JSON object: `wall_ms`, `device_busy_ms`, `copy_ms` (one copy of the
list's bf16 bytes), `kernels` (name -> [count, ms] a refit), `idle` (the device's gaps of over
20 us between its first and last kernel of the profiled refits: count and ms a refit, the
largest five with the kernel that ended before each) and `stats` (the timed refits' median
replan / produce / pack / wait / send seconds and the whole, in ms).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
from broadcast_bench import DEFAULT_MODEL_SCALE, sync
from fp8_bench import lists
from host_timeline import print_calls, recording
from profiling import profile_call
from sender_sweep import copy_seconds
from torch.profiler import ProfilerActivity, profile

from common.config import RefitConfig
from common.plan import RefitPlan
from common.quant.fp8_blocks import BlockFp8Format
from common.quant.fp8_plan import Fp8Source, Fp8Targets
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port


def kernels(prof: Any, refits: int) -> dict[str, list]:
    """Per kernel (or copy) name: [count, device ms] a refit."""
    rows: dict[str, list] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            row = rows.setdefault(event.name[:80], [0, 0.0])
            row[0] += 1
            row[1] += event.device_time / 1e3
    return {name: [n // refits, round(ms / refits, 3)]
            for name, (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])}


def device_spans(prof: Any) -> list[tuple[float, float, str]]:
    """Every device event's (start us, end us, name), in start order."""
    return sorted((e.time_range.start, e.time_range.end, e.name[:50]) for e in prof.events()
                  if e.device_type.name == "CUDA")


def idle_gaps(prof: Any, refits: int, least_us: float = 20.0) -> dict[str, Any]:
    """The device's idle gaps of over `least_us` between kernels (a host-bound stretch, or a
    frame held back): count and ms a refit, the five largest (us, the kernel before)."""
    spans = device_spans(prof)
    gaps, end, before = [], None, ""
    for start, stop, name in spans:
        if end is not None and start - end > least_us:
            gaps.append((round(start - end, 1), before))
        if end is None or stop > end:
            end, before = stop, name
    return {"count": len(gaps) // refits, "ms": round(sum(g for g, _ in gaps) / 1e3 / refits, 3),
            "largest_us": sorted(gaps, reverse=True)[:5]}


def print_timeline(prof: Any, count: int) -> None:
    """The profiled refits' first `count` device events: start (us after the first), idle
    before it, duration, name (to stderr)."""
    spans = device_spans(prof)[:count]
    end = spans[0][0] if spans else 0
    for start, stop, name in spans:
        print(f"  {start - spans[0][0]:9.1f} us  idle {max(start - end, 0):7.1f}  "
              f"{stop - start:7.1f} us  {name}", file=sys.stderr)
        end = max(end, stop)


def median_stats(all_stats: list) -> dict[str, float]:
    """The refits' median of each sender time, in ms."""
    return {key: round(statistics.median(getattr(s, key) for s in all_stats) * 1e3, 3)
            for key in ("replan_s", "produce_s", "pack_s", "wait_s", "send_s", "seconds")}


def profile_refits(sender: RefitSender, source: Any, args: argparse.Namespace) -> dict:
    """Warm refits, timed refits (median wall), then profiled ones (their kernels)."""
    version = iter(range(1, 1 << 30))
    for _ in range(3):
        sender.refit(source, next(version))
    walls, all_stats = [], []
    for _ in range(args.reps):
        sync(args.device)
        t0 = time.perf_counter()
        all_stats.append(sender.refit(source, next(version)))
        sync(args.device)
        walls.append(time.perf_counter() - t0)
    activity = ProfilerActivity.CPU if args.device.type == "cpu" else ProfilerActivity.CUDA
    with profile(activities=[activity]) as prof:
        for _ in range(args.reps):
            sender.refit(source, next(version))
        sync(args.device)
    if args.timeline:
        print_timeline(prof, args.timeline)
    if args.host:
        profile_call(sender.refit, source, next(version), top=args.host)
    if args.host_timeline:
        with recording() as log:
            sync(args.device)
            t0 = time.perf_counter()
            sender.refit(source, next(version))
        print_calls(log, t0)
    table = kernels(prof, args.reps)
    return {"wall_ms": round(statistics.median(walls) * 1e3, 3),
            "device_busy_ms": round(sum(ms for _, ms in table.values()), 3), "kernels": table,
            "idle": idle_gaps(prof, args.reps) if activity is ProfilerActivity.CUDA else {},
            "stats": median_stats(all_stats)}


def setup_sender(group: RefitGroup, plan: RefitPlan, args: argparse.Namespace) -> RefitSender:
    """A sender of `plan`; with `--eager-broadcast` its frames' graphs hold no broadcast (each
    frame's goes eagerly after its replay, as where capturing it failed)."""
    sender = RefitSender.setup(group, plan)
    if args.eager_broadcast and sender.graphs is not None:
        sender.graphs.failure = "--eager-broadcast"
    return sender


def release(earlier: list[RefitSender], mode: str) -> None:
    """The last earlier sender as `--after-mode` says: closed (and dropped), left open, only
    its frames' graphs or only its pack kernels' destroyed (kept), closed but kept, closed
    and the allocator's cache emptied."""
    sender = earlier[-1]
    if mode in ("closed", "new-group", "closed-kept", "closed-emptied"):
        sender.close()
    elif mode == "frames-released":
        sender.graphs.release()
    elif mode == "kernels-released":
        for layout in sender.layouts.values():
            layout.release()
    if mode in ("closed", "new-group", "closed-emptied"):
        earlier.pop()
    if mode == "closed-emptied":
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", default="moe", choices=["moe", "qwen3_30b_a3b"])
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--buffers", type=int, default=2)
    ap.add_argument("--graph-send", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="every 2-D *proj.weight in block FP8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host", type=int, default=0, help="cProfile one more refit: top N")
    ap.add_argument("--eager-broadcast", action="store_true",
                    help="graph frames without their NCCL broadcast (sent eagerly after each)")
    ap.add_argument("--timeline", type=int, default=0,
                    help="print the profiled refits' first N device events (idle before each)")
    ap.add_argument("--host-timeline", action="store_true",
                    help="one more refit with its host calls timestamped (host_timeline.py)")
    ap.add_argument("--cpu", action="store_true", help="a small CPU run (gloo; no kernels)")
    ap.add_argument("--after", type=int, default=0,
                    help="first set up, use (3 refits) and close this many senders of the "
                         "same plan: a sweep's later cases")
    ap.add_argument("--after-mode", default="closed",
                    choices=["closed", "open", "new-group", "frames-released",
                             "kernels-released", "closed-kept", "closed-emptied"],
                    help="the earlier senders closed (as the sweep's), left open, or closed "
                         "with their refit group destroyed and a new one made (`release`)")
    args = ap.parse_args()
    args.kind, args.quick, args.warmup = "cpu" if args.cpu else "gpu", False, 1
    args.scale = DEFAULT_MODEL_SCALE[args.kind]
    device = args.device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    shapes = lists(args)[args.list]
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {n: torch.randn(s, generator=g, device=device).bfloat16() for n, s in shapes}
    source: Any = DictWeightSource(tensors)
    if args.fp8:
        source = Fp8Source(source, Fp8Targets(BlockFp8Format(), frozenset(
            n for n, s in shapes if n.endswith("proj.weight") and len(s) == 2)))
    config = RefitConfig(bucket_bytes=args.bucket_mib << 20, num_buffers=args.buffers,
                         timeout_s=600, graph_send=args.graph_send)
    def new_group() -> RefitGroup:
        return RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                          num_trainers=1, timeout_s=600, device=device)

    group, earlier = new_group(), []
    try:
        plan = RefitPlan.build(source.plan_specs(), config)
        for _ in range(args.after):
            earlier.append(setup_sender(group, plan, args))
            for version in range(1, 4):
                earlier[-1].refit(source, version)
            release(earlier, args.after_mode)
            if args.after_mode == "new-group":
                group.destroy()
                group = new_group()
        report = profile_refits(setup_sender(group, plan, args), source, args)
    finally:
        group.destroy()
    args.reps = 5
    report["copy_ms"] = round(copy_seconds(sum(t.numel() * 2 for t in tensors.values()), args,
                                           device) * 1e3, 3)
    print(f"{args.list} {args.bucket_mib} MiB {args.buffers} buffers graph={args.graph_send} "
          f"fp8={args.fp8} after {args.after} senders ({args.after_mode}): wall "
          f"{report['wall_ms']} ms, device busy {report['device_busy_ms']} ms, "
          f"one copy {report['copy_ms']} ms", file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
