"""The broadcast benchmark's report: per-method medians, the issue's ratios, hardware, table."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from typing import Any

import torch
from model_shapes import MODELS, Shapes
from provenance import cpu_model, save

from common.kernels import native
from common.wire.group import RefitGroup

METHODS = ("naive", "coalesced_1buf", "coalesced_2buf", "coalesced_3buf", "forwarded_2buf",
           "raw")
DTYPE = torch.bfloat16


def build_report(ranks: list[dict[str, Any]], group: RefitGroup, args: argparse.Namespace,
                 lists: dict[str, Shapes]) -> dict[str, Any]:
    """Per method: median over reps of the slowest rank's time (each rank timed itself)."""
    report: dict[str, Any] = {"shapes": {name: _shape_report(ranks, name, shapes, args)
                                         for name, shapes in lists.items()}}
    report.update(_ratios(report))
    report["hardware"] = _hardware(group, args)
    report["settings"] = {
        "mode": "quick" if args.quick else "full", "bucket_bytes": args.bucket_bytes,
        "warmup": args.warmup, "reps": args.reps, "naive_reps": args.naive_reps,
        "timeout_s": args.timeout, "alignment": 256,
        "timing": "each rank times itself from a barrier; per rep the slowest rank; median",
        "gbps": "payload bytes once (not counting fan-out) / time; pack: 2x bytes / time",
        "sources": "tensor list cut in contiguous slices, one per trainer; raw from rank 0",
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE",
                                                "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
    }
    if args.device == "cuda" and group.world_size == 1:
        report["note"] = ("world size 1: a 1-GPU NCCL broadcast is a local no-op, so only "
                          "packing/stream/launch overhead is measured, not transfer speed")
    return report


def _shape_report(ranks: list[dict[str, Any]], name: str, shapes: Shapes,
                  args: argparse.Namespace) -> dict[str, Any]:
    numels = {math.prod(s) for _, s in shapes}
    nbytes = sum(math.prod(s) for _, s in shapes) * DTYPE.itemsize
    shape: dict[str, Any] = {
        "tensors": len(shapes), "dtype": "bfloat16", "total_bytes": nbytes,
        "numel_per_tensor": numels.pop() if len(numels) == 1 else None,
        "like": f"{MODELS[name][0]} at scale {args.scale}" if args.models else "synthetic",
        "methods": {}}
    for m in (m for m in METHODS if m in ranks[0][name]["times"]):
        per_rep = [max(r[name]["times"][m][i] for r in ranks)
                   for i in range(len(ranks[0][name]["times"][m]))]
        med = statistics.median(per_rep)
        shape["methods"][m] = {
            "median_s": round(med, 6), "gbps": round(nbytes / med / 1e9, 3),
            "reps_s": [round(t, 6) for t in per_rep],
            "per_rank_median_s": [round(statistics.median(r[name]["times"][m]), 6)
                                  for r in ranks],
        }
    shape["refit_stats"] = {f"rank{r['rank']}_{r['role']}": r[name]["stats"] for r in ranks}
    return shape


def _ratios(report: dict[str, Any]) -> dict[str, float]:
    """The issue's figures: speed-ups over naive, times over raw, fractions of the ceiling."""
    out: dict[str, float] = {}
    t = {n: {m: v["median_s"] for m, v in s["methods"].items()}
         for n, s in report["shapes"].items()}
    out["moe_coalesced_speedup_vs_naive"] = round(
        t["moe"]["naive"] / t["moe"]["coalesced_2buf"], 3)
    out["moe_double_buffer_time_over_raw"] = round(
        t["moe"]["coalesced_2buf"] / t["moe"]["raw"], 3)
    out["dense_double_buffer_time_over_raw"] = round(
        t["dense"]["coalesced_2buf"] / t["dense"]["raw"], 3)
    for n in t:
        # refit bytes/s over raw broadcast bytes/s (the multi-GPU issue's figure)
        out[f"{n}_double_buffer_fraction_of_ceiling"] = round(
            t[n]["raw"] / t[n]["coalesced_2buf"], 3)
        out[f"{n}_single_buffer_time_over_raw"] = round(
            t[n]["coalesced_1buf"] / t[n]["raw"], 3)
        if "forwarded_2buf" in t[n]:  # rank 0 the only source vs every owner feeding the group
            out[f"{n}_forwarded_time_over_owner_fed"] = round(
                t[n]["forwarded_2buf"] / t[n]["coalesced_2buf"], 3)
        if "coalesced_3buf" in t[n]:
            out[f"{n}_triple_buffer_time_over_raw"] = round(
                t[n]["coalesced_3buf"] / t[n]["raw"], 3)
    return out


def _hardware(group: RefitGroup, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "machine": platform.machine(),
        "gpu_name": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if args.device == "cuda" else 0,
        "torch": torch.__version__, "backend": group.backend, "world_size": group.world_size,
        "num_trainers": group.num_trainers,
        "native_checks": native.load() is not None,  # else the sender's slower Python path
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),  # > cores: others share the box
    }


def print_table(report: dict[str, Any]) -> None:
    hw = report["hardware"]
    print(f"refit broadcast bench: {hw['backend']} world {hw['world_size']} "
          f"({hw['num_trainers']} trainers), torch {hw['torch']}, "
          f"{hw['gpu_name'] or hw['cpu_model']}, "
          f"bucket {report['settings']['bucket_bytes'] >> 20} MiB")
    print(f"{'shape':<7}{'method':<16}{'median ms':>11}{'GB/s':>11}{'x raw':>10}{'x naive':>10}")
    for name, shape in report["shapes"].items():
        ms = shape["methods"]
        for m, v in ms.items():
            print(f"{name:<7}{m:<16}{v['median_s'] * 1e3:>11.2f}{v['gbps']:>11.2f}"
                  f"{v['median_s'] / ms['raw']['median_s']:>10.2f}"
                  f"{ms['naive']['median_s'] / v['median_s']:>10.2f}")
        each = shape["numel_per_tensor"] or "mixed"
        like = "" if shape["like"] == "synthetic" else f", like {shape['like']}"
        print(f"{'':<7}({shape['tensors']} x {each} bf16 = "
              f"{shape['total_bytes'] / 1e6:.0f} MB{like})")
    print("pack of the MoE list, GB/s (read+write): "
          + ", ".join(f"{k} {v:.2f}" for k, v in report["pack_gbps"].items()))
    if "note" in report:
        print("note:", report["note"])


def emit(report: dict[str, Any], out: str | None) -> None:
    """The report as JSON, stamped with its provenance: indented into `out` (if given), one
    line as stdout's last line."""
    save(report, out)
    print(json.dumps(report, separators=(",", ":")), flush=True)
