"""Refit broadcast benchmark: naive per-tensor vs coalesced (1 and 2 buffers) vs one raw buffer.

CPU (`--quick`): gloo, 3 spawned processes (2 trainer ranks + 1 receiver), OMP_NUM_THREADS=1.
CUDA (default when available): NCCL, one rank per GPU (half trainers, half receivers; a single
GPU runs a world-size-1 group, where a broadcast is a local no-op). Each rank times itself; rank 0
gathers every rank's times and computes the report. Prints a table and, as the last line, one
JSON object with every figure.

    OMP_NUM_THREADS=1 .venv/bin/python bench/broadcast_bench.py --quick --out bench/results/x.json

`--sweep` runs the sender sweep instead (every bucket size x buffer count, `bench/sender_sweep.py`,
the other arguments passed on): `python3 bench/broadcast_bench.py --sweep --out ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from bench_report import DTYPE, build_report, emit, print_table  # beside this script
from forward_source import ForwardingSource
from model_shapes import MODELS, Shapes, qwen3_shapes, scaled

from common.config import RefitConfig
from common.packing import BucketLayout, byte_view
from common.plan import RefitPlan, TensorSpec, align_up
from common.source import DictWeightSource, WeightSource
from common.transfer.bucket_check import BucketChecker
from common.transfer.endpoint import Endpoint
from common.transfer.sender import RefitReceiver, RefitSender, RefitStats
from common.wire.group import RefitGroup, free_port

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # recipes.*

# shape -> (tensor count, elements per bf16 tensor)
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "cpu": {"moe": (20_000, 16_384), "dense": (64, 4 << 20)},
    "gpu": {"moe": (20_000, 196_608), "dense": (400, 16 << 20)},
}
# NVLink multicast stays off on the shared H200 hosts (the device README says why)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_MODEL_SCALE = {"cpu": 0.002, "gpu": 0.5}  # --models: fits 2 cores / one H200 per rank


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shape_lists(args: argparse.Namespace) -> dict[str, Shapes]:
    """The two lists the run measures: "moe" and "dense", synthetic or (--models) shaped like
    Qwen3-30B-A3B and Qwen3-8B."""
    if args.models:
        return {k: scaled(qwen3_shapes(c), args.scale) for k, (_, c) in MODELS.items()}
    return {name: [(f"{name}.{i}", (numel,)) for i in range(count)]
            for name, (count, numel) in SHAPES[args.shapes].items()}


def make_specs(shapes: Shapes, trainers: int) -> list[TensorSpec]:
    """Contiguous slices of the tensor list, one per trainer (e.g. pipeline stages)."""
    n = len(shapes)
    return [TensorSpec(name, shape, DTYPE, i * trainers // n)
            for i, (name, shape) in enumerate(shapes)]


def make_tensors(specs: list[TensorSpec], device: torch.device) -> list[torch.Tensor]:
    return [torch.full(s.shape, float(i % 251), dtype=DTYPE, device=device)
            for i, s in enumerate(specs)]


def timed(fn: Callable[[], object], args: argparse.Namespace, device: torch.device,
          barrier: Callable[[], None] | None = None, reps: int | None = None,
          warm: Callable[[], object] | None = None) -> list[float]:
    """Warm-up runs (of `warm` if given), then `reps` timed runs, each after a barrier."""
    out = []
    for i in range(args.warmup + (reps or args.reps)):
        if barrier is not None:
            barrier()
        sync(device)
        t0 = time.perf_counter()
        (warm or fn)() if i < args.warmup else fn()
        sync(device)
        if i >= args.warmup:
            out.append(time.perf_counter() - t0)
    return out


def stats_dict(stats: RefitStats | None) -> dict[str, float]:
    if stats is None:
        return {}
    keys = ("seconds", "produce_s", "pack_s", "wait_s", "load_s", "checksum_s")
    return {"num_buckets": stats.num_buckets, **{k: round(getattr(stats, k), 6) for k in keys}}


def bench_shape(group: RefitGroup, name: str, shapes: Shapes,
                args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Every method on one shape; returns this rank's times and its last refit stats."""
    dev = group.device
    specs = make_specs(shapes, group.num_trainers)
    tensors = make_tensors(specs, dev)  # sources on their rank, receive targets elsewhere
    total = sum(s.nbytes for s in specs)

    def barrier() -> None:
        group.all_gather_bytes(b"", 8, f"{name} barrier")

    def naive(step: int = 1) -> None:
        for spec, t in zip(specs[::step], tensors[::step], strict=True):
            group.wait(group.broadcast(t, spec.source_rank), f"naive {spec.name}")

    # The naive warm-up sends every 10th tensor (both sources, all pairs): enough to warm up,
    # and --quick stays under a minute.
    times = {"naive": timed(naive, args, dev, barrier, args.naive_reps, lambda: naive(10))}
    stats: dict[str, Any] = {}
    mine = {s.name: t for s, t in zip(specs, tensors, strict=True)
            if s.source_rank == group.rank}
    for nb in args.buffer_counts:
        source = DictWeightSource(mine) if group.is_trainer else None
        times[f"coalesced_{nb}buf"], stats[f"coalesced_{nb}buf"] = time_refits(
            group, specs, source, nb, args, barrier)
    if args.forward and group.num_trainers > 1:
        # rank 0 the only source: the other owners' tensors reach it first over the training
        # ranks' own group, instead of each owner feeding the refit group
        forward = ForwardingSource(mine, specs, group.rank, dev) if group.is_trainer else None
        times["forwarded_2buf"], stats["forwarded_2buf"] = time_refits(
            group, [replace(s, source_rank=0) for s in specs], forward, 2, args, barrier)
    # Real bytes: on CPU a never-written buffer reads as the kernel's shared zero page, which
    # made the raw send ~25% cheaper than sending any real weights.
    raw = torch.full((total,), 7, dtype=torch.uint8, device=dev)
    times["raw"] = timed(lambda: group.wait(group.broadcast(raw, 0), "raw broadcast"),
                         args, dev, barrier)
    return times, stats


def time_refits(group: RefitGroup, specs: list[TensorSpec], source: WeightSource | None,
                buffers: int, args: argparse.Namespace, barrier: Callable[[], None],
                keep: list | None = None) -> tuple[list[float], dict[str, Any]]:
    """Set up this rank's end (a sender of `source` on a training rank) of a plan of `specs`
    with `buffers` buffers, time its refits; (times, the last refit's stats). A sender is
    closed after, unless it sent frames by graph replay and `keep` is given: then it goes
    there, its graphs alive (a frame graph destroyed slows every one captured later)."""
    config = RefitConfig.from_env(bucket_bytes=args.bucket_bytes, num_buffers=buffers,
                                  timeout_s=args.timeout)  # REFIT_CHECKSUM=0 measures its cost
    plan = RefitPlan.build(specs, config)
    end = (RefitSender.setup(group, plan) if group.is_trainer
           else RefitReceiver.setup(group, plan))
    last: list[RefitStats] = []
    times = timed(partial(coalesced_step, end, source, last), args, group.device, barrier)
    graphs = getattr(end, "graphs", None)  # frames sent by graph replay (graph_send)
    stats = {**stats_dict(last[-1]), "buckets": len(plan.buckets),
             "buffer_bytes": plan.buffer_bytes,
             **({} if graphs is None else {"graph_frames": graphs.captured,
                                           "graph_failure": graphs.failure})}
    if isinstance(end, RefitSender):
        if keep is not None and graphs is not None:
            keep.append(end)
        else:
            end.close()  # its graphs go now: the next case's launches meet none of them
    return times, stats


def coalesced_step(end: RefitSender | RefitReceiver, source: WeightSource | None,
                   last: list[RefitStats]) -> None:
    """One refit; the receiver's callback touches nothing (it gets views into the buffer)."""
    if isinstance(end, RefitSender):
        assert source is not None
        last.append(end.refit(source, len(last) + 1))
    else:
        last.append(end.receive(lambda items: None))


def bench_pack(group: RefitGroup, shapes: Shapes, args: argparse.Namespace) -> dict[str, float]:
    """GB/s (bytes read + written) of packing the MoE list: bucket by bucket as a refit does
    (the sender's checks, native when built, then the pack), with the Python checks, in
    one layout, with a foreach copy and a per-tensor copy_ loop, against one big copy_."""
    device = group.device
    direct = RefitConfig().direct_bytes  # such tensors are sent from their own memory: no pack
    specs = [s for s in make_specs(shapes, 1) if s.nbytes < direct]
    tensors = make_tensors(specs, device)
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=args.bucket_bytes, num_buffers=2))
    layouts = Endpoint(group, plan).layouts  # a refit's per-bucket layouts; nothing is sent

    # fresh name strings, as a source yields them (the plan's own would compare by identity)
    items = [(spec.name.encode().decode(), t) for spec, t in zip(specs, tensors, strict=True)]
    native_checks = BucketChecker(plan, 0, device, "bench")  # what the sender runs
    # its fallback: whole-list comparisons, then the pack's own reads
    python_checks = BucketChecker(plan, 0, device, "bench", use_native=False)

    def refit_pack(checker: BucketChecker) -> None:
        it = iter(items)
        for b in plan.buckets:
            part, ptrs = checker.take(it, b, 1)
            layouts[b.index].pack(part, ptrs)

    offsets, end = [], 0
    for s in specs:
        offsets.append(end)
        end = align_up(end + s.nbytes, 256)
    total = sum(s.nbytes for s in specs)
    buf = torch.empty(end, dtype=torch.uint8, device=device)

    def loop() -> None:
        for o, s, t in zip(offsets, specs, tensors, strict=True):
            buf[o : o + s.nbytes].copy_(byte_view(t), non_blocking=True)

    layout = BucketLayout(buf, specs, offsets)  # all 20,000 in one layout

    def foreach() -> None:
        dsts = [v for v in layout.views if v is not None]
        torch._foreach_copy_(dsts, tensors)

    # On the H200 host the first few passes run slower (the host side bounds this figure)
    args = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, 3)})
    out = {
        "pack": timed(partial(refit_pack, native_checks), args, device),
        "pack_python_checks": timed(partial(refit_pack, python_checks), args, device),
        "pack_one_layout": timed(lambda: layout.pack(tensors), args, device),
        "pack_foreach": timed(foreach, args, device),
        "per_tensor_copy_loop": timed(loop, args, device),
    }
    if layout.kernels:  # the one-launch kernel alone: source pointers prepared beforehand
        ((_, kernel),) = layout.kernels
        ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        bits = int(np.bitwise_or.reduce(ptrs))
        out["pack_kernel_gpu_only"] = timed(lambda: kernel.run(ptrs, bits), args, device)
    layouts.clear()
    items.clear()
    tensors.clear()  # at most ~3 copies of the data at once
    src = torch.full((total,), 7, dtype=torch.uint8, device=device)  # real pages (see raw)
    out["one_big_copy"] = timed(lambda: buf[:total].copy_(src), args, device)
    return {k: round(2 * total / statistics.median(v) / 1e9, 3) for k, v in out.items()}


def rank_device(rank: int, args: argparse.Namespace) -> torch.device:
    """This rank's device: its own GPU, or the CPU with one thread (2-core machines)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any] | None:
    device = rank_device(rank, args)
    trainers = args.trainers or (max(1, world // 2) if args.device == "cuda" else 2)
    if args.forward and rank < trainers:  # the training ranks' own group, as torchrun makes it
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.train_port}",
                                rank=rank, world_size=trainers,
                                device_id=device if args.device == "cuda" else None)
        dist.barrier()  # every rank's communicator exists before any point-to-point
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=trainers, timeout_s=args.timeout, device=device)
    try:
        return measure(group, args)
    finally:
        group.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(group: RefitGroup, args: argparse.Namespace) -> dict[str, Any] | None:
    """Every shape on every rank; rank 0 gathers the times and returns the report."""
    mine: dict[str, Any] = {"rank": group.rank,
                            "role": "trainer" if group.is_trainer else "receiver"}
    lists = shape_lists(args)
    for name, shapes in lists.items():
        mine[name] = dict(zip(("times", "stats"), bench_shape(group, name, shapes, args),
                              strict=True))
    sync(group.device)
    gathered = group.all_gather_bytes(json.dumps(mine).encode(), 1 << 20, "gather results")
    if group.rank != 0:
        return None
    ranks = [json.loads(g.decode()) for g in gathered]
    report = build_report(ranks, group, args, lists)
    report["pack_gbps"] = bench_pack(group, lists["moe"], args)
    return report


RankMain = Callable[[int, int, int, argparse.Namespace], Any]


def run_ranks(world: int, args: argparse.Namespace, main: RankMain | None = None) -> Any:
    """`main(rank, world, port, args)` on `world` spawned processes; rank 0's result (every
    rank's error, or which ranks gave none, fails the run). Default: this benchmark's ranks."""
    from recipes import rank_runner

    results = rank_runner.run_ranks(main or rank_main, world, args, timeout=args.deadline,
                                    allow_dead=True, threads=None)
    errors = [f"rank {r}:\n{v[2]}" for r, (s, v) in sorted(results.items()) if s == "error"]
    missing = [r for r, (s, _) in sorted(results.items()) if s == "dead"]
    if errors or missing or results[0][1] is None:
        raise SystemExit("benchmark failed:\n" + "\n".join(errors)
                         + (f"\nranks {missing} gave no result (died)" if missing else ""))
    return results[0][1]


def main() -> None:
    if "--sweep" in sys.argv[1:]:  # the sender sweep, its own arguments (module doc)
        sys.argv.remove("--sweep")
        from sender_sweep import main as sweep  # it imports this module: not at the top

        return sweep()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, gloo, small shapes (< 1 min)")
    ap.add_argument("--bucket-mib", type=int, default=None, help="256 on GPU, 64 on CPU")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None, help="timed runs (3 quick, 5 full)")
    ap.add_argument("--naive-reps", type=int, default=None, help="timed naive runs (1 quick)")
    ap.add_argument("--timeout", type=float, default=None, help="RefitConfig.timeout_s")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--models", action="store_true",
                    help="lists shaped like Qwen3-30B-A3B (moe) and Qwen3-8B (dense)")
    ap.add_argument("--scale", type=float, default=None,
                    help="--models: first-dimension scale (0.5 on GPU, 0.002 on CPU)")
    ap.add_argument("--forward", action="store_true",
                    help="also: rank 0 the only source, other owners' tensors forwarded to it")
    ap.add_argument("--world", type=int, default=None, help="ranks (GPUs; 3 on CPU)")
    ap.add_argument("--trainers", type=int, default=None,
                    help="training ranks, the first ones (half the world on GPU, 2 on CPU); "
                         "1 = the minimal group (rank 0 sends everything)")
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    os.environ["OMP_NUM_THREADS"] = "1" if args.quick else os.environ.get("OMP_NUM_THREADS", "1")
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.shapes = "gpu" if args.device == "cuda" else "cpu"
    args.bucket_bytes = (args.bucket_mib or (256 if args.device == "cuda" else 64)) << 20
    args.reps = args.reps or (3 if args.quick else 5)
    args.buffer_counts = (1, 2) if args.quick else (1, 2, 3)  # --quick stays under a minute
    args.naive_reps = args.naive_reps or (1 if args.quick else 3)  # ~14 s per MoE rep on CPU
    args.timeout = args.timeout or (60.0 if args.quick else 300.0)
    args.deadline = 10 * args.timeout
    args.scale = args.scale or DEFAULT_MODEL_SCALE[args.shapes]
    args.backend, args.train_port = ("nccl" if args.device == "cuda" else "gloo"), free_port()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 3)
    if args.trainers is not None and not 1 <= args.trainers < world:
        ap.error(f"--trainers {args.trainers}: needs 1 <= trainers < world ({world})")
    t0 = time.perf_counter()
    report = run_ranks(world, args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(report)
    sys.stdout.flush()
    emit(report, args.out)


if __name__ == "__main__":
    main()
