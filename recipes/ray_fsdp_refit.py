"""FSDP2 trainer actors and vLLM engine actors on Ray: an RL-shaped loop, one step off.

    python recipes/ray_fsdp_refit.py [--steps 3] [--trainers 2] [--engines 1]
        [--pause keep|wait|abort] [--address auto] [--result out.json]

Engines (`AsyncLLM` with the refit backend, one async actor each) generate batch k+1 while
the trainers (FSDP2 over gloo, one actor per rank) train on batch k; then the engines are
paused, refit (the trainers broadcast) and resumed, and the weight version is the step.
Every sample carries the versions its tokens came from, read from vLLM's `weight_versions`
(a sample still generating during a refit in mode keep carries two). The trainers learn on
the samples (next-token loss on prompt + completion). Timings per step and a summary table.
`--address` joins a running cluster (`ray start --head` on one node, `ray start --address`
on the others); the checkpoint directory must then be visible to every node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # recipes.*

from common.config import RefitConfig  # noqa: E402
from common.engine_client import PAUSE_MODES, EngineFleet  # noqa: E402
from common.engine_config import EngineConfig  # noqa: E402
from common.ray_cluster import RayLayout, RayPlacement, TrainerActor, start_trainers  # noqa: E402
from common.ray_engine import RayEngine  # noqa: E402
from recipes.dtensor_fsdp_refit import tiny_qwen3  # noqa: E402

PROMPT_LEN, NEW_TOKENS, SAMPLES_PER_RANK = 6, 16, 2
LLM_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 128, "max_num_seqs": 8}


class FSDPTrainer(TrainerActor):
    """One trainer rank: the tiny Qwen3 (same seed on every rank), FSDP2, AdamW."""

    def build(self):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from dtensor_refit import DTensorWeightSource, DtypePolicy

        self.model = tiny_qwen3()
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        return DTensorWeightSource(self.model, DtypePolicy(torch.bfloat16))

    def train_step(self, samples: list[list[int]]) -> float:
        """Next-token loss on this rank's share of the samples (all of one length)."""
        tokens = torch.tensor(samples[self.rank::self.world])
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def prompts(step: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, 1000, (count, PROMPT_LEN), generator=g).tolist()


def generate_async(engines: list[RayEngine], batch: list[list[int]]) -> list:
    """Start a batch on the engines (split evenly); returns the actors' futures."""
    share = -(-len(batch) // len(engines))
    return [e.actor.generate.remote(batch[i * share:(i + 1) * share], NEW_TOKENS,
                                    {"ignore_eos": True}) for i, e in enumerate(engines)]


def collect(futures: list, batch: list[list[int]], timeout_s: float) -> list[dict]:
    outs = [o for part in ray.get(futures, timeout=timeout_s) for o in part]
    return [{"tokens": p + o["tokens"], "versions": sorted({v for v, _, _ in
                                                           o["weight_versions"]}, key=int),
             "spans": o["weight_versions"]} for p, o in zip(batch, outs, strict=True)]


def start(args: argparse.Namespace, workdir: Path):
    """Placement, trainer actors, engine actors, and the refit group across them."""
    layout = RayLayout(trainers=args.trainers, engines=args.engines)
    placement = RayPlacement(layout)
    tiny_qwen3().to(torch.bfloat16).save_pretrained(str(workdir / "v0"))
    trainers = start_trainers(FSDPTrainer, placement)
    config = EngineConfig(model=str(workdir / "v0"), llm_kwargs=LLM_KWARGS)
    engines = [RayEngine.start(config, serving=True, name=f"engine-{i}",
                               **placement.engine_options(i)) for i in range(args.engines)]
    fleet = EngineFleet(engines)
    host, port = ray.get(trainers[0].address.remote(), timeout=layout.timeout_s)
    joining = fleet.join_async(host, port, args.trainers, timeout_s=layout.timeout_s)
    refit_config = RefitConfig.from_env(bucket_bytes=4 << 20, timeout_s=layout.timeout_s)
    ray.get([t.join_refit.remote(host, port, fleet.world_size(args.trainers),
                                 fleet.rank_names(args.trainers), refit_config,
                                 layout.timeout_s) for t in trainers], timeout=layout.timeout_s)
    joining.result(layout.timeout_s)
    return placement, trainers, fleet


def run(args: argparse.Namespace, trainers: list, fleet: EngineFleet, timeout_s: float) -> list:
    """The loop: batch k+1 generates while the trainers learn on batch k, then refit k, so
    batch k+1 comes from the weights of step k-1 (one step off; batch 1 from the start)."""
    count = SAMPLES_PER_RANK * args.trainers
    batch = prompts(1, count)
    pending = generate_async(fleet.engines, batch)
    rows = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        samples = collect(pending, batch, timeout_s)  # batch `step`
        wait_s = time.perf_counter() - t0
        batch = prompts(step + 1, count)
        pending = generate_async(fleet.engines, batch)  # batch step+1, during training
        t0 = time.perf_counter()
        losses = ray.get([t.train_step.remote([s["tokens"] for s in samples])
                          for t in trainers], timeout=timeout_s)
        train_s, t0 = time.perf_counter() - t0, time.perf_counter()
        stats = fleet.refit(lambda s=step: ray.get([t.refit.remote(s) for t in trainers],
                                                   timeout=timeout_s), step, args.pause)
        refit_s = time.perf_counter() - t0
        rows.append({"step": step, "loss": sum(losses) / len(losses), "wait_s": wait_s,
                     "train_s": train_s, "refit_s": refit_s, "versions": [
                         s["versions"] for s in samples], "sender": stats[0]["summary"]})
        print(f"[ray-fsdp] step {step}: samples from versions "
              f"{sorted({tuple(v) for v in rows[-1]['versions']})}, generate wait "
              f"{wait_s * 1e3:.0f} ms, train {train_s * 1e3:.0f} ms (loss "
              f"{rows[-1]['loss']:.3f}), refit {refit_s * 1e3:.0f} ms (pause {args.pause}): "
              f"{stats[0]['summary']}", flush=True)
    last = collect(pending, batch, timeout_s)
    rows.append({"step": args.steps + 1, "versions": [s["versions"] for s in last]})
    return rows


def summary(rows: list[dict]) -> str:
    lines = ["step | loss   | generate wait ms | train ms | refit ms | sample versions",
             "-----|--------|------------------|----------|----------|----------------"]
    for r in rows[:-1]:
        lines.append(f"{r['step']:>4} | {r['loss']:.3f} | {r['wait_s'] * 1e3:>16.0f} | "
                     f"{r['train_s'] * 1e3:>8.0f} | {r['refit_s'] * 1e3:>8.0f} | "
                     f"{sorted({tuple(v) for v in r['versions']})}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--pause", choices=PAUSE_MODES, default="keep")
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--result", help="write the per-step rows here (JSON)")
    parser.add_argument("--verbose", action="store_true", help="show the actors' own logs")
    args = parser.parse_args(argv)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    ray.init(address=args.address or "local", runtime_env={"env_vars": env},
             include_dashboard=False, log_to_driver=args.verbose,
             **({} if args.address else {"num_cpus": args.trainers + args.engines}))
    workdir = Path(tempfile.mkdtemp(prefix="ray_fsdp_refit_"))
    placement = trainers = fleet = None
    try:
        placement, trainers, fleet = start(args, workdir)
        rows = run(args, trainers, fleet, placement.layout.timeout_s)
        print(summary(rows), flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps(rows))
    finally:
        if fleet is not None:
            fleet.close()
        for t in trainers or []:
            ray.kill(t)
        if placement is not None:
            placement.remove()
        ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
