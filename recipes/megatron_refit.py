"""Megatron-Core training -> a running vLLM engine, refit after every optimizer step.

    torchrun --standalone --nproc-per-node 4 recipes/megatron_refit.py [--moe] [--steps 3]

Default: a tiny Qwen3-like GPT on TP2 x PP2; `--moe`: Qwen3-MoE on PP2 x EP2 (x DP2). Each rank
builds its Megatron chunk on CPU/gloo and randomises every tensor; one plain pass of
MegatronWeightSource gathers the model to rank 0, which writes it through transformers
(`save_pretrained`, bf16) as the checkpoint of ONE vLLM engine (own process, driven by rank 0,
refit rank 4). Then AdamW steps on random tokens (Megatron's pipeline schedule and DDP grad
sync), one refit after each step. Checks at the end: vLLM's params equal a fresh engine's started
on the expected weights (bit for bit), and so do its greedy tokens and logprobs; the logprobs
also match transformers' on those weights within LOGPROB_TOL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes.*

from common.broadcast import RefitSender  # noqa: E402
from common.config import RefitConfig  # noqa: E402
from common.engine import EngineConfig, EngineProcess  # noqa: E402
from common.group import RefitGroup, free_port  # noqa: E402
from common.plan import RefitPlan  # noqa: E402
from recipes.mcore_models import (  # noqa: E402
    DENSE,
    MOE,
    VOCAB,
    Layout,
    build_model,
    hf_config,
    megatron_logprobs,
    randomise,
    setup_parallel,
    train_step,
    wrap_for_training,
)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [150, 20, 30, 40]]
LLM_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 128, "max_num_seqs": 4}
NEW_TOKENS = 8
VLLM_TOL = 0.1  # |logprob| diff: vLLM computes in bf16, transformers here in fp32
MEGATRON_TOL = 1e-3  # transformers vs Megatron's own forward, both fp32 on the bf16 weights


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[megatron-refit] {msg}", flush=True)


def gather_full(source, plan: RefitPlan) -> dict[str, torch.Tensor] | None:
    """Every converted tensor, on rank 0 (a plain gather, independent of the refit path)."""
    mine = {name: t.clone() for name, t in source.iter_tensors(plan) if t is not None}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else None


def write_checkpoint(state: dict[str, torch.Tensor], layout: Layout, path: str) -> None:
    """Load the HF tensors into the matching transformers model; `save_pretrained` in bf16."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as raw:
        hf_config(layout).save_pretrained(raw)
        save_file({k: v.contiguous() for k, v in state.items()}, f"{raw}/model.safetensors")
        model, info = AutoModelForCausalLM.from_pretrained(
            raw, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), f"transformers could not take the converted model: {info}"
    model.save_pretrained(path)


def hf_logprobs(path: str, prompts: list, tokens: list) -> list[list[float]]:
    """transformers' (fp32) logprob of each generated token, prompt + tokens teacher-forced."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt, toks in zip(prompts, tokens, strict=True):
        with torch.no_grad():
            lp = model(torch.tensor([prompt + toks])).logits[0].float().log_softmax(-1)
        out.append([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks)])
    return out


def max_diff(xs: list[list[float]], ys: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(xs, ys, strict=True) for a, b in zip(x, y, strict=True))


def final_checks(engine: EngineProcess, ckpt: str, mega: list[list[float]]) -> dict:
    """vLLM after the refits vs a fresh engine on the expected weights (params bit for bit,
    greedy tokens and logprobs exactly), vs transformers, and transformers vs Megatron."""
    from safetensors.torch import load_file

    from recipes.vllm_checks import compare_params, vllm_layout

    got, out = engine.call("read"), engine.call("generate", PROMPTS, NEW_TOKENS)
    with EngineProcess(EngineConfig(model=ckpt, llm_kwargs=LLM_KWARGS)) as fresh:
        ref_params, ref = fresh.call("read"), fresh.call("generate", PROMPTS, NEW_TOKENS)
    assert sorted(got) == sorted(ref_params), "vLLM param names differ from a fresh engine's"
    bad = [n for n in got if not torch.equal(got[n], ref_params[n])]
    assert not bad, f"{len(bad)} vLLM params differ from a fresh engine's, e.g. {bad[:3]}"
    compared = compare_params(got, vllm_layout(load_file(f"{ckpt}/model.safetensors")))
    assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"], (out, ref)
    hf = hf_logprobs(ckpt, PROMPTS, out["tokens"])
    vllm_diff, mega_diff = max_diff(hf, out["logprobs"]), max_diff(hf, mega)
    assert vllm_diff <= VLLM_TOL, f"vLLM logprobs differ from transformers' by {vllm_diff}"
    assert mega_diff <= MEGATRON_TOL, f"transformers' logprobs differ from Megatron's: {mega_diff}"
    return {"params_equal_fresh": len(got), "params_equal_checkpoint": compared,
            "tokens": out["tokens"], "max_logprob_diff_vllm_hf": vllm_diff,
            "max_logprob_diff_hf_megatron": mega_diff, "version": out["version"]}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE on PP2 x EP2 (x DP2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--result", help="rank 0 writes the checks' results here (JSON)")
    args = parser.parse_args(argv)
    layout = MOE if args.moe else DENSE
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # no TE / apex
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engine process inherits it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from recipes import mcore_cpu_shim  # torch.cuda stand-ins megatron-core needs on CPU

    mcore_cpu_shim.install()
    dist.init_process_group("gloo")
    rank, trainers = dist.get_rank(), dist.get_world_size()
    from mcore_refit import MegatronWeightSource, converter_for

    t0 = time.perf_counter()
    setup_parallel(layout)
    chunks = build_model(layout)
    randomise(chunks, seed=7)
    model, opt = wrap_for_training(chunks)
    source = MegatronWeightSource(model, converter_for(layout.model_type), vocab_size=VOCAB,
                                  dtype=torch.bfloat16)
    config = RefitConfig.from_env(bucket_bytes=256 << 10, num_buffers=2, timeout_s=120)
    plan = RefitPlan.build(source.plan_specs(), config)
    log(f"{layout.label} on {trainers} ranks built in {time.perf_counter() - t0:.1f}s; plan "
        f"{plan.digest[:12]}: {len(plan.specs)} tensors, {plan.total_bytes / 1e6:.2f} MB bf16, "
        f"{len(plan.buckets)} buckets, sources {sorted({b.source_rank for b in plan.buckets})}")
    workdir = Path(tempfile.mkdtemp(prefix="megatron_refit_")) if rank == 0 else None
    full = gather_full(source, plan)
    engine = joining = None
    port = [None]
    if rank == 0:
        write_checkpoint(full, layout, str(workdir / "v0"))
        t1 = time.perf_counter()
        engine = EngineProcess(EngineConfig(model=str(workdir / "v0"), llm_kwargs=LLM_KWARGS))
        before = engine.call("generate", PROMPTS, NEW_TOKENS)["tokens"]
        log(f"engine up in {time.perf_counter() - t1:.1f}s; greedy before training: {before}")
        port = [free_port()]
        joining = engine.submit("join", "127.0.0.1", port[0], trainers, trainers + 1, trainers,
                                120.0)
    dist.broadcast_object_list(port, src=0)
    t1 = time.perf_counter()
    group = RefitGroup(host="127.0.0.1", port=port[0], rank=rank, world_size=trainers + 1,
                       num_trainers=trainers, timeout_s=config.timeout_s, device="cpu")
    sender = RefitSender.setup(group, plan)
    if joining is not None:
        log(f"refit group of {trainers} trainers + 1 engine set up in "
            f"{time.perf_counter() - t1:.2f}s; engine vetted the plan: {joining.result(300)}")
    sources, losses = sorted({b.source_rank for b in plan.buckets}), []
    for step in range(1, args.steps + 1):
        t1 = time.perf_counter()
        loss = train_step(model, opt, step)
        train_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        pending = engine.submit("refit") if engine else None
        stats = sender.refit(source, version=step)
        answer = pending.result(300) if pending else None
        total = time.perf_counter() - t1
        every = [None] * trainers
        dist.all_gather_object(every, (stats, loss))
        losses.append(every[-1][1])
        log(f"step {step}: train {train_s:.2f}s, loss {every[-1][1]:.4f}; refit v{step} "
            f"{plan.total_bytes / 1e6:.2f} MB end to end {total * 1e3:.0f} ms "
            f"({plan.total_bytes / total / 1e9:.3f} GB/s)")
        for r in sources:
            log(f"  trainer rank {r} (source): {every[r][0].summary()}")
        if answer is not None:
            log(f"  engine: v{answer['version']} received + loaded in {answer['seconds'] * 1e3:.0f}"
                f" ms (broadcast wait {answer['wait_s'] * 1e3:.0f} ms, load_weights "
                f"{answer['load_s'] * 1e3:.0f} ms); answer {answer}")
            log(f"  greedy: {engine.call('generate', PROMPTS, NEW_TOKENS)['tokens']}")
    full = gather_full(source, plan)  # the expected weights, by the plain route again
    tokens = [engine.call("generate", PROMPTS, NEW_TOKENS)["tokens"] if engine else None]
    dist.broadcast_object_list(tokens, src=0)
    mega = [megatron_logprobs(model, [p + t for p, t in zip(PROMPTS, tokens[0], strict=True)],
                              [len(p) for p in PROMPTS])]
    dist.broadcast_object_list(mega, src=trainers - 1)  # the last rank is on the last stage
    result = None
    if rank == 0:
        write_checkpoint(full, layout, str(workdir / f"v{args.steps}"))
        t1 = time.perf_counter()
        result = final_checks(engine, str(workdir / f"v{args.steps}"), mega[0])
        result |= {"layout": layout.label, "steps": args.steps, "tokens_before": before,
                   "losses": losses}
        log(f"checks passed in {time.perf_counter() - t1:.1f}s: {json.dumps(result)}")
        if args.result:
            Path(args.result).write_text(json.dumps(result))
        engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
    group.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
