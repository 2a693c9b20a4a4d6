"""Concurrent sources: do the sources' streams overlap, and how evenly does a plan spread?

1. Overlap (gloo, 4 trainer ranks + 2 receivers, OMP_NUM_THREADS=1): one list of equal buckets
   whose every gather takes a fixed time (a sleep inside the source, the same for every
   source), sent by K = 1, 2 and 4 of the trainers (each its share of the buckets). A refit's
   time is trainer rank 0's, from its call to the verdict; `concurrency_efficiency_kK` =
   t(K = 1) / (K x t(K)): 1.0 when K sources take 1/K of the time. The receivers check every
   tensor bit for bit (`bitwise_equal`).
2. Spread: the Qwen3-30B-A3B-shaped list (bench/model_shapes.py) at PP4 x EP4 as the Megatron
   source plans it: each expert sent by its owner, the dense tensors of a stage spread over
   that stage's ranks (`common.plan.balance_sources`); `source_imbalance` = the busiest
   source's bytes over the mean, `worker_imbalance` the busiest engine worker's (every worker
   takes whole buckets here), `imbalance_max` the larger, with 12 layers a stage;
   `imbalance_max_edge` the same with 11 layers on the first and the last stage (which also
   hold the 622 MB embedding and head).

    OMP_NUM_THREADS=1 .venv/bin/python bench/concurrent_bench.py --quick [--out FILE]

Prints a table, then as its last line one JSON object with every figure of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.*, recipes.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_shapes import QWEN3_30B_A3B, qwen3_shapes  # noqa: E402
from provenance import save  # noqa: E402

from common.config import RefitConfig  # noqa: E402
from common.plan import RefitPlan, TensorSpec, balance_sources  # noqa: E402
from common.source import DictWeightSource  # noqa: E402
from common.transfer.schedule import Schedule  # noqa: E402
from common.transfer.sender import RefitReceiver, RefitSender  # noqa: E402
from common.wire.group import RefitGroup  # noqa: E402
from recipes.rank_runner import run_ranks  # noqa: E402

TRAINERS, RECEIVERS = 4, 2
KS = (1, 2, 4)


class SleepySource(DictWeightSource):
    """Each bucket this rank sources costs `gather_s` before its first tensor (a gather);
    the others' tensors are skipped at once. Trainer r sources the r-th of `k` shares."""

    def __init__(self, tensors: dict, rank: int, k: int, gather_s: float) -> None:
        super().__init__(tensors)
        self.rank, self.k, self.gather_s = rank, k, gather_s

    def plan_specs(self) -> list[TensorSpec]:
        specs = super().plan_specs()
        return [TensorSpec(s.name, s.shape, s.dtype, i * self.k // len(specs))
                for i, s in enumerate(specs)]

    def iter_tensors(self, plan: RefitPlan):
        firsts = {b.start for b in plan.buckets if b.source_rank == self.rank}
        for i, spec in enumerate(plan.specs):
            if i in firsts:
                time.sleep(self.gather_s)
            yield spec.name, self.tensors[spec.name] if spec.source_rank == self.rank else None


def equal_tensors(count: int, numel: int, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layer.{i}.weight": torch.randn(numel, generator=g).bfloat16()
            for i in range(count)}


def overlap_rank(rank: int, world: int, port: int, k: int, buckets: int, gather_s: float,
                 refits: int) -> dict:
    """One K: `refits` timed refits after a warm-up; trainer 0 returns its times, receivers
    whether every tensor arrived bit for bit."""
    torch.set_num_threads(1)
    numel = 16 << 10  # 32 KiB a tensor, one bucket each
    config = RefitConfig(bucket_bytes=numel * 2, num_buffers=2, timeout_s=120,
                         direct_bytes=1 << 30)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=TRAINERS, timeout_s=120)
    if group.is_trainer:
        specs = SleepySource(equal_tensors(buckets, numel, 0), rank, k, 0).plan_specs()
        sender = RefitSender.setup(group, RefitPlan.build(specs, config))
        times = []
        for version in range(refits + 1):
            source = SleepySource(equal_tensors(buckets, numel, version), rank, k, gather_s)
            t0 = time.perf_counter()
            stats = sender.refit(source, version)
            times.append(time.perf_counter() - t0)
        group.destroy()
        return {"times": times[1:], "sources": stats.sources}
    receiver = RefitReceiver.setup(group)
    equal = True
    for version in range(refits + 1):
        want = equal_tensors(buckets, numel, version)

        def check(items: list, want: dict = want) -> None:
            nonlocal equal
            equal &= all(torch.equal(t.view(torch.int16), want[n].view(torch.int16))
                         for n, t in items)

        receiver.receive(check, version=version)
    group.destroy()
    return {"equal": equal}


def overlap(buckets: int, gather_s: float, refits: int) -> dict:
    """Each K's median refit time, the efficiencies, and whether every byte arrived."""
    out: dict = {"gather_s": gather_s, "buckets": buckets}
    equal = True
    for k in KS:
        res = run_ranks(overlap_rank, TRAINERS + RECEIVERS, k, buckets, gather_s, refits,
                        timeout=300)
        bad = {r: v for r, (s, v) in res.items() if s != "ok"}
        if bad:
            raise RuntimeError(f"K={k}: ranks failed: {bad}")
        out[f"t_k{k}_s"] = statistics.median(res[0][1]["times"])
        out[f"sources_k{k}"] = res[0][1]["sources"]
        equal &= all(res[r][1]["equal"] for r in range(TRAINERS, TRAINERS + RECEIVERS))
    for k in KS[1:]:
        out[f"concurrency_efficiency_k{k}"] = round(out["t_k1_s"] / (k * out[f"t_k{k}_s"]), 3)
    out["bitwise_equal"] = equal
    return out


def stage_of(layer: int, layers: int, pp: int, edge: int | None) -> int:
    """The pipeline stage of `layer`: an even split, or with `edge` that many layers on the
    first and the last stage and the rest split evenly between the others (Megatron's
    `decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers`)."""
    if edge is None:
        return layer * pp // layers
    if layer < edge:
        return 0
    if layer >= layers - edge:
        return pp - 1
    return 1 + (layer - edge) * (pp - 2) // (layers - 2 * edge)


def megatron_spread(pp: int, ep: int, edge: int | None = None) -> RefitPlan:
    """The Qwen3-30B-A3B-shaped list at PP x EP as the Megatron source plans it (module doc);
    rank = stage * ep + ep rank; embedding first, head last."""
    cfg = QWEN3_30B_A3B
    specs, candidates = [], {}
    for name, shape in qwen3_shapes(cfg):
        layer = re.search(r"layers\.(\d+)\.", name)
        stage = (stage_of(int(layer.group(1)), cfg.layers, pp, edge) if layer
                 else 0 if "embed" in name else pp - 1)
        expert = re.search(r"experts\.(\d+)\.", name)
        owner = int(expert.group(1)) * ep // cfg.experts if expert else 0
        specs.append(TensorSpec(name, shape, torch.bfloat16, stage * ep + owner))
        if not expert:
            candidates[name] = tuple(stage * ep + e for e in range(ep))
    return RefitPlan.build(balance_sources(specs, candidates), RefitConfig())


def spread(pp: int = 4, ep: int = 4, edge: int = 11) -> dict:
    """Even layers per stage, and `edge` layers on the first and last stage (which also hold
    the embedding and the head, 311 M elements each, whole tensors that no split can share)."""
    even = Schedule.of(megatron_spread(pp, ep))
    uneven = Schedule.of(megatron_spread(pp, ep, edge))
    worker = 1.0  # whole buckets: every worker takes every byte
    return {"layout": f"Qwen3-30B-A3B PP{pp} x EP{ep}", "sources": len(even.sources),
            "source_imbalance": round(even.source_imbalance(), 4), "worker_imbalance": worker,
            "imbalance_max": round(max(even.source_imbalance(), worker), 4),
            "edge_layers": edge,
            "imbalance_max_edge": round(max(uneven.source_imbalance(), worker), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, a few minutes on 2 cores")
    ap.add_argument("--buckets", type=int, default=16)
    ap.add_argument("--gather-ms", type=float, default=60.0)
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    result = {**overlap(a.buckets, a.gather_ms / 1e3, a.refits), **spread()}
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    for k in KS:
        print(f"K={k}: {result[f't_k{k}_s'] * 1e3:8.1f} ms a refit "
              f"({result[f'sources_k{k}']} source streams)")
    print(f"{result['layout']}: {result['sources']} sources, busiest source "
          f"{result['source_imbalance']:.3f}x the mean (even layers per stage), "
          f"{result['imbalance_max_edge']:.3f}x ({result['edge_layers']} layers on the first "
          f"and last stage)")
    save(result, a.out)
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}))


if __name__ == "__main__":
    main()
