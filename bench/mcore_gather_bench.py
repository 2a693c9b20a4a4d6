"""Megatron gather + convert throughput on one GPU (a benchmark, not a test).

    python bench/mcore_gather_bench.py [--out bench/results/mcore_gather_h200.json]

Builds a Megatron-Core GPT model (local spec, bf16, on CUDA; dense Qwen3-like and Qwen3-MoE-like
with 64 experts), lists its refit plan with `MegatronWeightSource`, and times one full pass of
`iter_tensors` (names, QKV de-interleave, gate/up split, dtype policy) against one device copy
of the same bytes, measured in the same run. With one GPU there is no TP/EP collective: this is
the conversion's own cost. Also times a world-size-1 NCCL refit of the whole model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from bench_report import emit
from mcore_refit_bench import GPU_VOCAB, gpu_model


def build(moe: bool) -> torch.nn.Module:
    """mcore_refit_bench's GPU model on one rank (TP1 x PP1)."""
    from recipes.mcore_configs import Layout

    return gpu_model(Layout("qwen3_moe" if moe else "qwen3"))[0]


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench(moe: bool, group) -> dict:
    from common.config import RefitConfig
    from common.plan import RefitPlan
    from common.transfer.sender import RefitSender
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for

    model = build(moe)
    source = MegatronWeightSource([model], converter_for("qwen3_moe" if moe else "qwen3"),
                                  vocab_size=GPU_VOCAB, policy=DtypePolicy(torch.bfloat16))
    plan = RefitPlan.build(source.plan_specs(), RefitConfig(bucket_bytes=256 << 20))
    nbytes = plan.total_bytes

    def gather() -> None:
        for _ in source.iter_tensors(plan):
            pass

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    sender = RefitSender.setup(group, plan)
    versions = iter(range(1, 100))
    t_gather = timed(gather)
    t_copy = timed(lambda: dst.copy_(src))
    t_refit = timed(lambda: sender.refit(source, next(versions)))
    return {"tensors": len(plan.specs), "bytes": nbytes, "gather_s": t_gather,
            "gather_gbps": nbytes / t_gather / 1e9, "copy_gbps": 2 * nbytes / t_copy / 1e9,
            "gather_time_over_copy": t_gather / t_copy, "refit_ws1_s": t_refit,
            "refit_ws1_gbps": nbytes / t_refit / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from common.wire.group import RefitGroup, free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=120)
    import megatron.core

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "megatron_core": megatron.core.__version__,
              "dense": bench(False, group), "moe": bench(True, group)}
    for k in ("dense", "moe"):
        r = report[k]
        print(f"{k:5s} {r['tensors']:5d} tensors {r['bytes'] / 1e9:6.2f} GB: gather+convert "
              f"{r['gather_gbps']:7.1f} GB/s ({r['gather_time_over_copy']:.2f}x one device copy "
              f"at {r['copy_gbps']:.0f} GB/s r+w); world-1 refit {r['refit_ws1_gbps']:.1f} GB/s")
    emit(report, args.out)


if __name__ == "__main__":
    main()
