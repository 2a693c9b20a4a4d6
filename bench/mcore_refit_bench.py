"""Megatron TP/PP/EP training ranks refitting receivers on other GPUs (a benchmark, not a test).

    python3 bench/mcore_refit_bench.py --tp 2 --receivers 2 [--out x.json]
    python3 bench/mcore_refit_bench.py --moe --ep 2 --receivers 2
    python3 bench/mcore_refit_bench.py --quick    # a CPU check of the bench: gloo, tiny model

Ranks 0..T-1 train (T = TP x PP x EP, one GPU each, their own NCCL default group as torchrun
makes it); ranks T..T+R-1 only receive. Per rep, every rank in step:
  gather: one full pass of `MegatronWeightSource.iter_tensors` (the TP / EP / PP gathers and the
          HF conversion), nothing broadcast;
  refit:  `RefitSender.refit` with 2 buffers, the gathers of bucket k+1 overlapping the
          broadcast of bucket k, into receivers whose callback touches nothing;
  raw:    one broadcast of the plan's bytes from rank 0 (the wire's ceiling).
The report gives each median (slowest rank per rep) and refit / raw, refit / (gather + raw):
below 1 means the overlap hides part of the gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from bench_report import emit
from broadcast_bench import NO_MULTICAST, run_ranks, timed

from common.config import RefitConfig
from common.plan import RefitPlan
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup, free_port

GPU_VOCAB = 32768


def gpu_model(layout: Any) -> list[torch.nn.Module]:
    """A 2 B-parameter dense (or 8-layer, 64-expert MoE) Qwen3-like chunk on this rank's GPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
        kv_channels=128, ffn_hidden_size=6144, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, qk_layernorm=True, activation_func=torch.nn.functional.silu,
        params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=torch.bfloat16)
    if layout.moe:
        kw.update(num_moe_experts=64, moe_router_topk=4, moe_ffn_hidden_size=768,
                  moe_token_dispatcher_type="allgather", expert_model_parallel_size=layout.ep)
    spec = get_gpt_layer_local_spec(num_experts=64 if layout.moe else None, qk_layernorm=True,
                                    normalization="RMSNorm")
    return [GPTModel(TransformerConfig(**kw), spec, vocab_size=GPU_VOCAB,
                     max_sequence_length=512, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False,
                     position_embedding_type="rope").cuda()]


def trainer_source(rank: int, trainers: int, args: argparse.Namespace) -> Any:
    """This training rank's Megatron chunk and its weight source (default group first)."""
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # no TE / apex
    if args.quick:
        from recipes import mcore_cpu_shim  # torch.cuda stand-ins megatron-core needs on CPU

        mcore_cpu_shim.install()
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for
    from recipes import mcore_configs, mcore_models

    layout = mcore_configs.Layout("qwen3_moe" if args.moe else "qwen3", tp=args.tp, pp=args.pp,
                                  ep=args.ep)
    dist.init_process_group("gloo" if args.quick else "nccl",
                            init_method=f"tcp://127.0.0.1:{args.train_port}", rank=rank,
                            world_size=trainers,
                            device_id=None if args.quick else torch.device("cuda", rank))
    mcore_configs.setup_parallel(layout)
    chunks = mcore_models.build_model(layout) if args.quick else gpu_model(layout)
    vocab = mcore_models.VOCAB if args.quick else GPU_VOCAB
    return MegatronWeightSource(chunks, converter_for(layout.model_type), vocab_size=vocab,
                                policy=DtypePolicy(torch.bfloat16))


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict | None:
    trainers = args.tp * args.pp * args.ep
    device = torch.device("cpu") if args.quick else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = trainer_source(rank, trainers, args) if rank < trainers else None
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=trainers, timeout_s=args.timeout, device=device)
    try:
        return measure(group, source, args)
    finally:
        group.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(group: RefitGroup, source: Any, args: argparse.Namespace) -> dict | None:
    config = RefitConfig(bucket_bytes=args.bucket_mib << 20, num_buffers=2,
                         timeout_s=args.timeout)
    if source is not None:
        end = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
    else:
        end = RefitReceiver.setup(group)
    plan = end.plan
    versions = iter(range(1, 1 << 30))

    def barrier() -> None:
        group.all_gather_bytes(b"", 8, "barrier")

    def gather() -> None:
        if source is not None:
            for _ in source.iter_tensors(plan):
                pass

    def refit() -> None:
        if isinstance(end, RefitSender):
            end.refit(source, next(versions))
        else:
            end.receive(lambda items: None)

    raw = torch.full((plan.total_bytes,), 7, dtype=torch.uint8, device=group.device)
    times = {"gather": timed(gather, args, group.device, barrier),
             "refit": timed(refit, args, group.device, barrier),
             "raw": timed(lambda: group.wait(group.broadcast(raw, 0), "raw"), args,
                          group.device, barrier)}
    every = group.all_gather_bytes(json.dumps(times).encode(), 1 << 16, "gather times")
    if group.rank != 0:
        return None
    ranks = [json.loads(b.decode()) for b in every]
    med = {k: statistics.median(max(r[k][i] for r in ranks) for i in range(len(times[k])))
           for k in times}
    return {"tensors": len(plan.specs), "bytes": plan.total_bytes, "buckets": len(plan.buckets),
            "sources": sorted({b.source_rank for b in plan.buckets}),
            "median_s": {k: round(v, 6) for k, v in med.items()},
            "refit_gbps": round(plan.total_bytes / med["refit"] / 1e9, 3),
            "raw_gbps": round(plan.total_bytes / med["raw"] / 1e9, 3),
            "refit_time_over_raw": round(med["refit"] / med["raw"], 3),
            "refit_time_over_gather_plus_raw": round(med["refit"] / (med["gather"] + med["raw"]),
                                                     3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (MoE; TP must be 1)")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mib", type=int, default=None, help="256 on GPU, 1 with --quick")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="CPU check: gloo, the tiny model")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.ep > 1 and not args.moe:
        ap.error("--ep needs --moe")
    args.bucket_mib = args.bucket_mib or (1 if args.quick else 256)
    args.train_port, args.deadline = free_port(), 10 * args.timeout
    os.environ.update({**NO_MULTICAST, "OMP_NUM_THREADS": "1"})
    world = args.tp * args.pp * args.ep + args.receivers
    if not args.quick and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs (one per rank), {torch.cuda.device_count()} "
                         "visible; --quick checks the bench on CPU")
    t0 = time.perf_counter()
    report = run_ranks(world, args, rank_main)
    report |= {"layout": {k: getattr(args, k) for k in ("tp", "pp", "ep", "moe", "receivers")},
               "bucket_mib": args.bucket_mib, "torch": torch.__version__,
               "gpu": None if args.quick else torch.cuda.get_device_name(0),
               "wall_s": round(time.perf_counter() - t0, 1)}
    emit(report, args.out)


if __name__ == "__main__":
    main()
