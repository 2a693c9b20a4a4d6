"""The sender's own host time per bucket: many tiny buckets on a world-size-1 group, so each
refit's time is the per-bucket loop (take and check, pack, header, broadcast call, wait) and
nothing else worth counting. The cost model's per-bucket term on a GPU host is this loop plus
its CUDA calls (`bench/sender_sweep.py` measures that at real sizes).

    OMP_NUM_THREADS=1 .venv/bin/python bench/sender_host_bench.py [--buffers 2] [--out F]
    python3 bench/sender_host_bench.py --device cuda      # NCCL, the pack kernel's launches
    python3 bench/sender_host_bench.py --device cuda --profile 25   # + where its time goes
    python3 bench/sender_host_bench.py --device cuda --graph-send   # each frame a graph replay
    python3 bench/sender_host_bench.py --tensors 20000 --per-bucket 169   # + the per-tensor share

The last line is one JSON object: `us_per_bucket` (median over `--reps` refits) and its split
(`produce_us`, `pack_us`, `wait_us` per bucket, from the refit's own stats), and
`ns_per_tensor`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from profiling import profile_call
from provenance import finish

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffers", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=4000, help="of 1 KiB each")
    ap.add_argument("--per-bucket", type=int, default=2,
                    help="tensors per bucket (many: the per-tensor share of the loop)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--graph-send", action="store_true",
                    help="frames by CUDA graph replay (RefitConfig.graph_send)")
    ap.add_argument("--profile", type=int, default=0,
                    help="then profile one refit: its N costliest calls (own time) to stderr")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60, device=args.device)
    try:
        source = DictWeightSource({f"t{i}": torch.full((512,), float(i % 7),
                                                        dtype=torch.bfloat16,
                                                        device=args.device)
                                   for i in range(args.tensors)})
        plan = RefitPlan.build(source.plan_specs(), RefitConfig(
            bucket_bytes=max(1024, 1024 * args.per_bucket), num_buffers=args.buffers, timeout_s=60,
            graph_send=args.graph_send))
        sender = RefitSender.setup(group, plan)
        for version in range(1, 4):  # warm
            sender.refit(source, version)
        times, stats = [], []
        for version in range(4, 4 + args.reps):
            t0 = time.perf_counter()
            stats.append(sender.refit(source, version))
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if args.profile:
            profile_call(sender.refit, source, 4 + args.reps, top=args.profile)
    finally:
        group.destroy()
    n, graphs = len(plan.buckets), sender.graphs
    summary = {"us_per_bucket": round(statistics.median(times) / n * 1e6, 2), "buckets": n,
               "ns_per_tensor": round(statistics.median(times) / args.tensors * 1e9, 1),
               **({} if graphs is None else {"graph_frames": graphs.captured,
                                             "graph_failure": graphs.failure}),
               **{f"{k}_us": round(statistics.median(getattr(s, f"{k}_s") for s in stats)
                                   / n * 1e6, 2) for k in ("produce", "pack", "wait")}}
    print(f"{n} buckets: {summary['us_per_bucket']} us per bucket")
    finish({"settings": vars(args)}, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
