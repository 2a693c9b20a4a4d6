"""FP8 refit benchmark: the sender's quantize + pack of a refit against one copy of the bf16 bytes.

A world-size-1 refit group (the wire is free: a broadcast is a local no-op), so a refit's time
is the sender's own work: the weight source's tensors quantized to block FP8 where the engine's
checkpoint holds them so (`common.quant.fp8_plan.Fp8Source`: every `*proj.weight`, as Qwen3-FP8
and DeepSeek-V3 checkpoints quantize their linear layers), checked and packed into the
buckets. Lists: the synthetic 20,000-tensor MoE list (each tensor 2-D) and the Qwen3-30B-A3B-
shaped list (scale 0.5 on a GPU). On a GPU both refits send their frames by CUDA graph
replay (`RefitConfig.graph_send`), as a user with many small tensors would. The last line is
one JSON object: `quantize_pack_over_copy` (the worse list: an FP8 refit over one device copy
of the bf16 bytes; target <= 1.5), `wire_fraction_fp8` (the FP8 plan's bytes over the bf16
plan's), `quantize_alone_over_copy` (the worse list's quantize kernels alone, launched per
bucket and shape into buffers of their own: what the refit adds to it is the fill's share,
the rest's pack and the host's take), and per list the bf16 refit over the same copy.

    python3 bench/fp8_bench.py --out bench/results/fp8_h200.json             # one GPU
    python3 bench/fp8_bench.py --profile 30      # + where one FP8 refit's host time goes
    OMP_NUM_THREADS=1 .venv/bin/python bench/fp8_bench.py --quick            # CPU, small
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import numpy as np
import torch
from bench_report import _hardware
from broadcast_bench import DEFAULT_MODEL_SCALE, sync, timed
from model_shapes import MODELS, Shapes, qwen3_shapes, scaled
from profiling import profile_call
from provenance import bench_args, finish
from sender_sweep import copy_seconds

from common.config import RefitConfig
from common.plan import RefitPlan
from common.quant.fp8_batch import start_batch
from common.quant.fp8_blocks import BlockFp8Format
from common.quant.fp8_plan import Fp8Source, Fp8Targets
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port

SYNTHETIC = {"gpu": (20_000, (384, 512)), "cpu": (2_000, (128, 256))}


def lists(args: argparse.Namespace) -> dict[str, Shapes]:
    count, shape = SYNTHETIC[args.kind]
    return {"moe": [(f"layers.{i}.mlp.experts.0.down_proj.weight", shape) for i in range(count)],
            "qwen3_30b_a3b": scaled(qwen3_shapes(MODELS["moe"][1]), args.scale)}


def refit_seconds(group: RefitGroup, source, config: RefitConfig,
                  args: argparse.Namespace) -> tuple[float, RefitPlan]:
    """Median seconds of a refit of `source` (a world-size-1 group) and its plan. The sender
    stays open in `args.kept` (closed at the end): a frame graph destroyed, as a collected
    sender's are, slows every one captured after it."""
    plan = RefitPlan.build(source.plan_specs(), config)
    sender = RefitSender.setup(group, plan)
    args.kept.append(sender)
    version = iter(range(1, 1 << 30))
    times = timed(lambda: sender.refit(source, next(version)), args, group.device)
    if args.profile and isinstance(source, Fp8Source):
        profile_call(sender.refit, source, next(version), top=args.profile)
    return statistics.median(times), plan


def quantize_seconds(tensors: dict, targets: Fp8Targets, plan: RefitPlan,
                     args: argparse.Namespace, device: torch.device) -> float:
    """Median seconds of the quantize alone: every FP8 target into buffers of its own, one
    batch per bucket of the FP8 plan with its groups of one shape and its addresses, as the
    refit's source launches them (no frame, no pack)."""
    batches = []
    for bucket in plan.buckets:
        named = [(s.name, tensors[s.name]) for s in plan.bucket_specs(bucket)
                 if s.name in targets.names]
        by_shape: dict[tuple, list[int]] = {}
        for i, (_, x) in enumerate(named):
            by_shape.setdefault(tuple(x.shape), []).append(i)
        at = np.array([x.data_ptr() for _, x in named], np.int64)
        if named:
            batches.append((named, list(by_shape.values()), at))
    return statistics.median(timed(
        lambda: [start_batch(n, targets.fmt, g, at) for n, g, at in batches], args, device))


def measure_list(group: RefitGroup, name: str, shapes: Shapes,
                 args: argparse.Namespace) -> dict[str, Any]:
    device = group.device
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {n: torch.randn(s, generator=g, device=device).bfloat16() for n, s in shapes}
    bf16 = DictWeightSource(tensors)
    targets = Fp8Targets(BlockFp8Format(), frozenset(n for n, s in shapes
                                                       if n.endswith("proj.weight")
                                                       and len(s) == 2))
    config = RefitConfig(bucket_bytes=args.bucket_mib << 20, num_buffers=2, timeout_s=600,
                         graph_send=args.kind == "gpu")
    copy_s = copy_seconds(sum(t.numel() * 2 for t in tensors.values()), args, device)
    bf16_s, bf16_plan = refit_seconds(group, bf16, config, args)
    fp8 = Fp8Source(bf16, targets)
    fp8_s, fp8_plan = refit_seconds(group, fp8, config, args)
    quantize_s = quantize_seconds(tensors, targets, fp8_plan, args, device)
    sync(device)
    bf16_bytes, fp8_bytes = bf16_plan.total_bytes, fp8_plan.total_bytes
    return {"tensors": len(shapes), "fp8_tensors": len(targets.names), "bf16_bytes": bf16_bytes,
            "fp8_bytes": fp8_bytes, "copy_s": round(copy_s, 6), "bf16_refit_s": round(bf16_s, 6),
            "fp8_refit_s": round(fp8_s, 6), "fp8_over_copy": round(fp8_s / copy_s, 3),
            "bf16_over_copy": round(bf16_s / copy_s, 3), "quantize_s": round(quantize_s, 6),
            "quantize_over_copy": round(quantize_s / copy_s, 3),
            "wire_fraction": round(fp8_bytes / bf16_bytes, 4), "graph_send": config.graph_send,
            "buckets_by_address": f"{fp8.by_address} of {len(fp8_plan.buckets)}"}


def main() -> int:
    args = bench_args(__doc__, "on the GPU (the default where CUDA is available)", profile=True)
    args.kind = "gpu" if torch.cuda.is_available() and not args.quick else "cpu"
    args.scale = DEFAULT_MODEL_SCALE[args.kind]
    # two warm refits: an FP8 source's fills run eagerly in the first (their kernels compile),
    # its filled frames are captured as graphs in the second; the timed refits come after
    args.warmup, args.reps = 2, 3 if args.quick else 5
    args.bucket_mib = 256 if args.kind == "gpu" else 64
    device = torch.device("cuda", 0) if args.kind == "gpu" else torch.device("cpu")
    torch.set_num_threads(1 if args.kind == "cpu" else torch.get_num_threads())
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=600, device=device)
    args.kept = []
    try:
        report: dict[str, Any] = {name: measure_list(group, name, shapes, args)
                                  for name, shapes in lists(args).items()}
        args.device = device.type
        report["hardware"] = _hardware(group, args)
    finally:
        for sender in args.kept:
            sender.close()
        group.destroy()
    for name, r in ((n, v) for n, v in report.items() if n != "hardware"):
        print(f"{name:14s} fp8 refit {r['fp8_refit_s'] * 1e3:9.2f} ms ({r['fp8_over_copy']:.2f}x "
              f"copy), bf16 {r['bf16_refit_s'] * 1e3:9.2f} ms ({r['bf16_over_copy']:.2f}x), "
              f"wire {r['wire_fraction']:.3f} of bf16, by address {r['buckets_by_address']}")
    runs = [v for k, v in report.items() if k != "hardware"]
    summary = {"quantize_pack_over_copy": max(r["fp8_over_copy"] for r in runs),
               "wire_fraction_fp8": max(r["wire_fraction"] for r in runs),
               "quantize_alone_over_copy": max(r["quantize_over_copy"] for r in runs),
               **{f"bf16_refit_over_copy_{k}": v["bf16_over_copy"]
                  for k, v in report.items() if k != "hardware"}}
    finish(report, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
