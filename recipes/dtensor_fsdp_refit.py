"""FSDP2 training -> a running vLLM engine, refit after every step.

    torchrun --standalone --nproc-per-node 2 recipes/dtensor_fsdp_refit.py [--steps 3]

Builds a tiny Qwen3 from a config (random init; nothing is downloaded), writes it as the
engine's checkpoint, starts one vLLM engine in its own process (rank 0 drives it), shards the
model with FSDP2 over gloo, trains a few AdamW steps on random tokens and refits after each
step, printing where the time went (gather, pack, broadcast, load) and the engine's greedy
tokens. The engine joins the refit group as the last rank.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from common.broadcast import RefitSender
from common.config import RefitConfig
from common.engine import EngineConfig, EngineFleet, EngineProcess
from common.group import RefitGroup
from common.plan import RefitPlan
from dtensor_refit import DTensorWeightSource, DtypePolicy

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30]]
LLM_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 128, "max_num_seqs": 4}


def tiny_qwen3() -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_qwen3()  # fp32 master weights, the same on every rank (seeded)
    ckpt = os.path.join(tempfile.gettempdir(), "refit_dtensor_recipe_ckpt")
    engine = None
    if rank == 0:
        start = tiny_qwen3().to(torch.bfloat16)
        start.load_state_dict(model.state_dict())
        start.save_pretrained(ckpt)
        t0 = time.perf_counter()
        engine = EngineFleet([EngineProcess(EngineConfig(model=ckpt, llm_kwargs=LLM_KWARGS))])
        print(f"[recipe] engine up in {time.perf_counter() - t0:.1f}s; before training: "
              f"{engine.call('generate', PROMPTS, 8)[0]['tokens']}", flush=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    source = DTensorWeightSource(model, DtypePolicy(torch.bfloat16))
    plan = RefitPlan.build(source.plan_specs(), RefitConfig.from_env(bucket_bytes=4 << 20))
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    join = engine.join_async(host, port, num_trainers=world) if engine else None
    group = RefitGroup(host=host, port=port, rank=rank, world_size=world + 1,
                       num_trainers=world, timeout_s=120, device="cpu")
    sender = RefitSender.setup(group, plan)
    if join is not None:
        print(f"[recipe] engine joined: {join.result()}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        pending = engine.refit_async() if engine else None
        stats = sender.refit(source, version=step)
        if engine is None:
            continue
        (loaded,) = pending.result()
        (out,) = engine.call("generate", PROMPTS, 8)
        print(f"[recipe] step {step} loss {loss.item():.3f} | trainer {stats.summary()} | engine "
              f"load {loaded['load_s'] * 1e3:.1f} ms of {loaded['seconds'] * 1e3:.1f} ms "
              f"({loaded['nbytes'] / loaded['seconds'] / 1e9:.2f} GB/s) | v{out['version']} "
              f"tokens {out['tokens']}", flush=True)
    if engine is not None:
        engine.close()
    group.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
