"""FSDP2 training -> a running vLLM engine, refit after every step.

    torchrun --standalone --nproc-per-node 2 recipes/dtensor_fsdp_refit.py [--steps 3]
        [--engine serve|local] [--pause keep|wait|abort] [--result out.json]

Builds a tiny Qwen3 from a config (random init; nothing is downloaded), writes it as the
engine's checkpoint, starts one vLLM engine (`vllm serve` by default, driven over HTTP by rank
0; its worker joins the refit group after the trainers), shards the model with FSDP2 over
gloo, trains a few AdamW steps on random tokens and refits after each step (pause, refit,
weight version = step, resume), printing where the time went (gather, pack, broadcast, load)
and the engine's greedy tokens. At the end the engine's greedy tokens and logprobs must equal
a fresh engine's started on the trained weights (DCP full state dict + `save_pretrained`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes.*

import refit  # noqa: E402
from common.clients.engine_client import PAUSE_MODES  # noqa: E402
from common.config import RefitConfig  # noqa: E402
from dtensor_refit import DTensorWeightSource, DtypePolicy  # noqa: E402
from recipes.engines import KINDS, greedy, open_engine, replayed_batches  # noqa: E402

PROMPTS, PROBE_TOKENS = [[1, 2, 3, 4, 5], [10, 20, 30]], 8


def tiny_qwen3() -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def save_bf16(state: dict[str, torch.Tensor], path: str) -> None:
    model = tiny_qwen3().to(torch.bfloat16)
    model.load_state_dict(state)
    model.save_pretrained(path)


def fsdp_step(model, opt, samples: list[list[int]]) -> float:
    """One AdamW step on this rank's share of `samples` (token lists of one length)."""
    tokens = torch.tensor(samples[dist.get_rank()::dist.get_world_size()])
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def random_batches(steps: int, vocab: int) -> list[list[list[int]]]:
    """The default data: 4 x 32 random tokens per rank and step (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (steps, 4 * dist.get_world_size(), 32), generator=g).tolist()


def train_and_refit(model, session: refit.RefitSession, batches: list) -> dict:
    """Every rank: an AdamW step per batch, a refit after each (`session.refit`: rank 0
    pauses the engine, commits version `step`, resumes it). Per step: every rank's loss and (rank 0)
    the engine's greedy tokens on the probe prompts."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = {"rank_losses": [], "greedy": []}
    for step, batch in enumerate(batches, start=1):
        loss = fsdp_step(model, opt, batch)
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss)
        record["rank_losses"].append(losses)
        t0 = time.perf_counter()
        stats = session.refit(step)
        if session.fleet is None:
            continue
        paused = time.perf_counter() - t0
        engine = session.fleet.engines[0]
        record["greedy"].append(greedy(engine, PROMPTS, PROBE_TOKENS)[0])
        print(f"[recipe] step {step} loss {loss:.3f} | {stats.summary()} | paused "
              f"{paused * 1e3:.0f} ms | v{engine.weight_version()} tokens "
              f"{record['greedy'][-1][0]}", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", choices=KINDS, default="serve")
    parser.add_argument("--pause", choices=PAUSE_MODES, default="keep")
    parser.add_argument("--result", help="rank 0 writes the checks' results here (JSON)")
    parser.add_argument("--batches", help="train on the batches of a Ray recipe's --result "
                        "rows (one step per batch) instead of random tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_qwen3()  # fp32 master weights, the same on every rank (seeded)
    workdir = Path(tempfile.mkdtemp(prefix="refit_dtensor_recipe_"))
    with contextlib.ExitStack() as stack:
        engine = None
        if rank == 0:
            save_bf16(model.state_dict(), str(workdir / "v0"))
            t0 = time.perf_counter()
            engine = stack.enter_context(open_engine(args.engine, str(workdir / "v0"), workdir))
            before = greedy(engine, PROMPTS, PROBE_TOKENS)[0]
            print(f"[recipe] {args.engine} engine {engine.name} up in "
                  f"{time.perf_counter() - t0:.1f}s; before training: {before}", flush=True)
        mesh = init_device_mesh("cpu", (world,))  # gloo on the host, GPUs or not
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = DTensorWeightSource(model, DtypePolicy(torch.bfloat16))
        session = stack.enter_context(refit.connect(
            source, [engine] if engine else [], pause=args.pause,
            config=RefitConfig.from_env(bucket_bytes=4 << 20)))
        if engine is not None:
            print(f"[recipe] engine joined the refit group (world "
                  f"{session.group.world_size})", flush=True)
        batches = (replayed_batches(args.batches) if args.batches
                   else random_batches(args.steps, model.config.vocab_size))
        record = train_and_refit(model, session, batches)
        steps = len(batches)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            save_bf16(full, str(workdir / f"v{steps}"))
            got = greedy(engine, PROMPTS, PROBE_TOKENS)
            with open_engine(args.engine, str(workdir / f"v{steps}"), workdir) as fresh:
                ref = greedy(fresh, PROMPTS, PROBE_TOKENS)
            assert got == ref, f"refit engine {got} != fresh engine {ref}"
            assert got[0] != before, "training changed nothing the engine serves"
            print(f"[recipe] checks passed: greedy tokens and logprobs equal a fresh engine's "
                  f"on v{steps}", flush=True)
            if args.result:
                Path(args.result).write_text(json.dumps(
                    {"tokens": got[0], "tokens_before": before, "fresh_tokens": ref[0],
                     "version": engine.weight_version(), "engine": args.engine, **record}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
