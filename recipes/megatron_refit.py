"""Megatron-Core training -> a running vLLM engine, refit after every optimizer step.

    torchrun --standalone --nproc-per-node 4 recipes/megatron_refit.py [--moe] [--steps 3]
        [--engine serve|local] [--pause keep|wait|abort] [--batches rows.json] [--result out]

Default: a tiny Qwen3-like GPT on TP2 x PP2; `--moe`: Qwen3-MoE on PP2 x EP2 (x DP2). Each rank
builds its Megatron chunk on CPU/gloo and randomises every tensor; one plain pass of
MegatronWeightSource gathers the model to rank 0, which writes it through transformers
(`save_pretrained`, bf16) as the checkpoint of ONE vLLM engine: a real `vllm serve` server
(`--engine serve`, driven over HTTP) or an in-process `LLM` in a child process (`local`), both
with the `refit` weight-transfer backend, driven by rank 0; its workers follow the trainers in
the refit group. Then AdamW steps on random tokens (Megatron's pipeline schedule and DDP grad
sync); after each, the engine is paused, refit, given the step as its weight version and
resumed, and its logprobs are checked against transformers' on the expected weights. At the
end its greedy tokens and logprobs equal a fresh engine's started on those weights (and, for
a local engine, its params bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
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

import refit  # noqa: E402
from common.clients.engine_client import PAUSE_MODES, EngineClient  # noqa: E402
from common.config import RefitConfig  # noqa: E402
from common.plan import RefitPlan  # noqa: E402
from recipes.engines import KINDS, greedy, open_engine, replayed_batches  # noqa: E402
from recipes.mcore_configs import Layout, hf_config, setup_parallel  # noqa: E402
from recipes.mcore_models import (  # noqa: E402
    DENSE,
    MOE,
    VOCAB,
    build_model,
    dp_share,
    megatron_logprobs,
    randomise,
    train_step,
    wrap_for_training,
)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [150, 20, 30, 40]]
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


def check_step(engine: EngineClient, ckpt: str, step: int, moe: bool) -> list[list[int]]:
    """After refit `step`, against that step's checkpoint (written independently of the refit
    path): the engine reports the version; a local engine's readable params equal the
    checkpoint's bit for bit; dense models' logprobs match transformers' (MoE top-k routing in
    bf16 vs fp32 may flip near-ties: the end's fresh-engine comparison covers MoE exactly)."""
    from safetensors.torch import load_file

    from recipes.vllm_checks import compare_params, vllm_layout

    assert engine.weight_version() == str(step), engine.weight_version()
    if hasattr(engine, "read"):
        compare_params(engine.read(), vllm_layout(load_file(f"{ckpt}/model.safetensors")))
    tokens, logprobs = greedy(engine, PROMPTS, NEW_TOKENS)
    if not moe:
        diff = max_diff(hf_logprobs(ckpt, PROMPTS, tokens), logprobs)
        assert diff <= VLLM_TOL, f"step {step}: vLLM logprobs differ from transformers' by {diff}"
    return tokens


def final_checks(engine: EngineClient, kind: str, ckpt: str, mega: list[list[float]],
                 moe: bool) -> dict:
    """vLLM after the refits vs a fresh engine started on the expected weights (greedy tokens
    and logprobs exactly; params bit for bit where they are readable: local engines), vs
    transformers (dense models: MoE top-k routing in bf16 vs fp32 may flip near-ties, so
    there the fresh engine is the exact check), and transformers vs Megatron."""
    from safetensors.torch import load_file

    from recipes.vllm_checks import compare_params, vllm_layout

    tokens, logprobs = greedy(engine, PROMPTS, NEW_TOKENS)
    result: dict = {}
    with open_engine(kind, ckpt, Path(ckpt).parent) as fresh:
        same = greedy(fresh, PROMPTS, NEW_TOKENS) == (tokens, logprobs)
        assert same, "generation differs from a fresh engine's"
        if kind == "local":
            got, ref = engine.read(), fresh.read()
            assert sorted(got) == sorted(ref), "vLLM param names differ from a fresh engine's"
            bad = [n for n in got if not torch.equal(got[n], ref[n])]
            assert not bad, f"{len(bad)} vLLM params differ from a fresh engine's, e.g. {bad[:3]}"
            result["params_equal_fresh"] = len(got)
            result["params_equal_checkpoint"] = compare_params(
                got, vllm_layout(load_file(f"{ckpt}/model.safetensors")))
    hf = hf_logprobs(ckpt, PROMPTS, tokens)
    vllm_diff, mega_diff = max_diff(hf, logprobs), max_diff(hf, mega)
    assert moe or vllm_diff <= VLLM_TOL, f"vLLM logprobs differ from transformers' by {vllm_diff}"
    assert mega_diff <= MEGATRON_TOL, f"transformers' logprobs differ from Megatron's: {mega_diff}"
    return result | {"tokens": tokens, "max_logprob_diff_vllm_hf": vllm_diff,
                     "max_logprob_diff_hf_megatron": mega_diff,
                     "version": engine.weight_version()}


def log_refit(step: int, stats, total: float, every: list, sources: list[int]) -> None:
    log(f"  refit v{step} {stats.nbytes / 1e6:.2f} MB end to end {total * 1e3:.0f} ms, engine "
        f"paused meanwhile ({stats.nbytes / total / 1e9:.3f} GB/s)")
    for r in sources:
        log(f"  trainer rank {r} (source): {every[r][0].summary()}")
    for r, t in sorted(stats.receivers.items()):
        log(f"  engine worker (refit rank {r}): v{step} received + loaded in "
            f"{t['seconds'] * 1e3:.0f} ms (broadcast wait {t['wait_s'] * 1e3:.0f} ms, "
            f"load_weights + post-load {t['load_s'] * 1e3:.0f} ms)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE on PP2 x EP2 (x DP2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", choices=KINDS, default="serve",
                        help="serve: a `vllm serve` server over HTTP; local: an in-process LLM")
    parser.add_argument("--pause", choices=PAUSE_MODES, default="keep",
                        help="what a refit's pause does to requests in flight")
    parser.add_argument("--result", help="rank 0 writes the checks' results here (JSON)")
    parser.add_argument("--batches", help="train on the batches of a Ray recipe's --result "
                        "rows (one step per batch) instead of random tokens")
    return parser.parse_args(argv)


def build(layout: Layout):
    """Every rank: its Megatron chunk (randomised), optimizer, weight source and the plan."""
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for

    t0 = time.perf_counter()
    setup_parallel(layout)
    chunks = build_model(layout)
    randomise(chunks, seed=7)
    model, opt = wrap_for_training(chunks)
    source = MegatronWeightSource(model, converter_for(layout.model_type), vocab_size=VOCAB,
                                  policy=DtypePolicy(torch.bfloat16))
    config = RefitConfig.from_env(bucket_bytes=256 << 10, num_buffers=2, timeout_s=120)
    plan = RefitPlan.build(source.plan_specs(), config)
    log(f"{layout.label} on {dist.get_world_size()} ranks built in "
        f"{time.perf_counter() - t0:.1f}s; plan {plan.digest[:12]}: {len(plan.specs)} tensors, "
        f"{plan.total_bytes / 1e6:.2f} MB bf16, {len(plan.buckets)} buckets, sources "
        f"{sorted({b.source_rank for b in plan.buckets})}")
    return model, opt, source, plan


def train_and_refit(args, layout, model, opt, source, plan, session, workdir) -> dict:
    """Every rank: a training step (on random tokens, or the `--batches` replayed), then a
    refit (`session.refit`: rank 0 pauses, commits version `step` and resumes), then the
    step's checks on rank 0. Returns per step: the last rank's loss, every rank's loss
    (rank 0) the engine's greedy tokens and the frames that went as deltas (with
    REFIT_DELTA=1)."""
    trainers = dist.get_world_size()
    record = {"losses": [], "rank_losses": [], "greedy": [], "delta_frames": []}
    sources = sorted({b.source_rank for b in plan.buckets})
    replay = replayed_batches(args.batches) if args.batches else None
    for step in range(1, (len(replay) if replay else args.steps) + 1):
        t1 = time.perf_counter()
        loss = train_step(model, opt, step, batches=dp_share(replay[step - 1]) if replay else None)
        train_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        stats = session.refit(step)
        total = time.perf_counter() - t1
        every = [None] * trainers
        dist.all_gather_object(every, (stats, loss))
        record["losses"].append(every[-1][1])
        record["delta_frames"].append(sum(t.get("delta_frames", 0)
                                          for t in stats.receivers.values()))
        record["rank_losses"].append([x if x == x else None for _, x in every])
        full = gather_full(source, plan)  # the expected weights, by the plain route
        log(f"step {step}: train {train_s:.2f}s, loss {every[-1][1]:.4f}")
        if session.fleet is not None:
            log_refit(step, stats, total, every, sources)
            write_checkpoint(full, layout, str(workdir / f"v{step}"))
            engine = session.fleet.engines[0]
            record["greedy"].append(check_step(engine, str(workdir / f"v{step}"), step,
                                               layout.moe))
            log(f"  greedy: {record['greedy'][-1]}")
    return record


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
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
    model, opt, source, plan = build(layout)
    workdir = Path(tempfile.mkdtemp(prefix="megatron_refit_")) if rank == 0 else None
    full = gather_full(source, plan)
    result = engine = None
    with contextlib.ExitStack() as stack:
        if rank == 0:
            write_checkpoint(full, layout, str(workdir / "v0"))
            t1 = time.perf_counter()
            engine = stack.enter_context(open_engine(args.engine, str(workdir / "v0"), workdir))
            before = greedy(engine, PROMPTS, NEW_TOKENS)[0]
            log(f"{args.engine} engine {engine.name} up in {time.perf_counter() - t1:.1f}s "
                f"({engine.num_workers()} worker(s), weight version {engine.weight_version()}); "
                f"greedy before training: {before}")
        t1 = time.perf_counter()
        session = refit.connect(source, [engine] if engine else [], plan=plan, pause=args.pause,
                                timeout_s=plan.config.timeout_s)
        log(f"refit group of {trainers} trainers + {session.group.world_size - trainers} engine "
            f"worker(s) set up in {time.perf_counter() - t1:.2f}s; the engine vetted the plan")
        record = train_and_refit(args, layout, model, opt, source, plan, session, workdir)
        steps = len(record["losses"])
        tokens = [greedy(engine, PROMPTS, NEW_TOKENS)[0] if engine else None]
        dist.broadcast_object_list(tokens, src=0)
        mega = [megatron_logprobs(model, [p + t for p, t in zip(PROMPTS, tokens[0], strict=True)],
                                  [len(p) for p in PROMPTS])]
        dist.broadcast_object_list(mega, src=trainers - 1)  # the last rank is on the last stage
        if rank == 0:
            t1 = time.perf_counter()
            result = final_checks(engine, args.engine, str(workdir / f"v{steps}"), mega[0],
                                  layout.moe)
            result |= {"layout": layout.label, "steps": steps, "tokens_before": before,
                       "engine": args.engine, **record}
            log(f"checks passed in {time.perf_counter() - t1:.1f}s: {json.dumps(result)}")
            if args.result:
                Path(args.result).write_text(json.dumps(result))
    if rank == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    session.close()
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
