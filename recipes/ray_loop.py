"""The Ray recipes' driver: an RL-shaped loop, one step off, for any `SessionTrainer` class.

The trainer class (a `SessionTrainer`: its refits set up with `refit.connect`) implements
`build()` (its weight source), `save_checkpoint(path)` (every rank calls it; the engines start
from what it writes) and `train_step(samples) -> loss`.
Engines (`AsyncLLM` with the refit backend, one async actor each) generate batch k+1 while
the trainers train on batch k; then the engines are paused, refit and resumed, and the weight
version is the step. Every sample carries the versions its tokens came from, read from
vLLM's `weight_versions` (a request a refit aborted continues from where it stopped). Rows
record each step's batch, per-rank losses and the engines' greedy tokens on probe prompts, so
the torchrun recipes can replay the batches (`--batches`) and must reproduce both. One line
per step and a summary table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

import refit
from common.clients.engine_client import PAUSE_MODES, EngineError
from common.clients.fleet import EngineFleet
from common.clients.ray_engine import RayEngine
from common.config import RefitConfig
from common.engine.config import EngineConfig
from common.launch.ray_cluster import (
    RayLayout,
    RayPlacement,
    TrainerActor,
    TrainerFailure,
    TrainerGroup,
    start_trainers,
)
from recipes.engines import greedy

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Batches:
    """What the engines generate: `count` prompts of `prompt_len` tokens, `new_tokens` each."""

    count: int
    prompt_len: int
    new_tokens: int
    vocab: int

    def prompts(self, step: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(1, self.vocab, (self.count, self.prompt_len), generator=g).tolist()


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--pause", choices=PAUSE_MODES, default="keep")
    p.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    p.add_argument("--result", help="write the per-step rows here (JSON)")
    p.add_argument("--workdir", help="where trainer rank 0 writes the engines' starting "
                   "checkpoint: on a multi-node cluster, storage every node sees "
                   "(default: a new temporary directory)")
    p.add_argument("--verbose", action="store_true", help="show the actors' own logs")
    return p


def generate_async(engines: list[RayEngine], batch: list[list[int]], new_tokens: int) -> list:
    share = -(-len(batch) // len(engines))
    return [(e, e.remote("generate", prompts=batch[i * share:(i + 1) * share],
                         max_tokens=new_tokens, sampling={"ignore_eos": True}))
            for i, e in enumerate(engines)]


def collect(pending: list, batch: list[list[int]], new_tokens: int,
            timeout_s: float) -> list[dict]:
    """The batch's samples: prompt + completion and the weight versions its tokens came from.
    A request aborted by a refit (pause mode abort) continues from its partial completion on
    the same engine, so its sample spans the versions before and after the refit."""
    samples = []
    for engine, future in pending:
        for out in ray.get(future, timeout=timeout_s):
            tokens, spans = list(out["tokens"]), list(out["weight_versions"])
            while out["finish_reason"] == "abort" and len(tokens) < new_tokens:
                prompt = batch[len(samples)] + tokens
                (out,) = ray.get(engine.remote("generate", prompts=[prompt],
                                               max_tokens=new_tokens - len(tokens),
                                               sampling={"ignore_eos": True}), timeout=timeout_s)
                tokens, spans = tokens + out["tokens"], spans + list(out["weight_versions"])
            samples.append({"tokens": batch[len(samples)] + tokens,
                            "versions": sorted({v for v, _, _ in spans}, key=int)})
    return samples


def probe(fleet: EngineFleet, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the fixed probe prompts from the first engine (idle when called)."""
    return greedy(fleet.engines[0], prompts, new_tokens)[0]


class SessionTrainer(TrainerActor):
    """A trainer actor that sets up its refits as a torchrun rank does, with `refit.connect`:
    the engines' clients travel to every rank, rank 0 drives them (pause, commit, resume),
    every rank sends its share; `refit(step)` returns or raises one verdict on every rank."""

    def connect(self, engines: list, config: RefitConfig, pause: str, timeout_s: float) -> str:
        self.session = refit.connect(self.source, engines, config=config, pause=pause,
                                     host=ray.util.get_node_ip_address(), timeout_s=timeout_s)
        self.sender = self.session.sender  # the base class's `shutdown` leaves its group
        return self.sender.plan.digest


def start(args, layout: RayLayout, actor_cls: type, actor_args: tuple, llm_kwargs: dict,
          workdir: Path):
    """Placement, trainer actors (their first weights saved as the engines' checkpoint),
    engine actors, and every trainer's `refit.connect` to them (`SessionTrainer`); the
    driver's own fleet of the same engines generates."""
    placement = RayPlacement(layout)
    trainers = start_trainers(actor_cls, placement, *actor_args)
    ckpt = str(workdir / "v0")
    trainers.call("save_checkpoint", ckpt)
    config = EngineConfig(model=ckpt, llm_kwargs=llm_kwargs)
    engines = [RayEngine.start(config, serving=True, name=f"engine-{i}",
                               **placement.engine_options(i)) for i in range(layout.engines)]
    refit_config = RefitConfig.from_env(bucket_bytes=4 << 20, timeout_s=layout.timeout_s)
    trainers.call("connect", engines, refit_config, args.pause, layout.timeout_s)
    return placement, trainers, EngineFleet(engines)


def run(args, tag: str, batches: Batches, trainers: TrainerGroup, fleet: EngineFleet,
        timeout_s: float, probes: tuple[list[list[int]], int]) -> list[dict]:
    """Batch k+1 generates while the trainers learn on batch k, then refit k: batch k+1 comes
    from the weights of step k-1 (one step off; batch 1 from the start). Before each batch
    goes out, the probe prompts' greedy tokens show what the engines serve (row k: version
    k-1); a torchrun recipe given the rows' batches must reproduce the losses and tokens."""
    batch, rows = batches.prompts(1), []
    pending = generate_async(fleet.engines, batch, batches.new_tokens)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        samples = collect(pending, batch, batches.new_tokens, timeout_s)  # batch `step`
        wait_s = time.perf_counter() - t0
        tokens = probe(fleet, *probes)
        batch = batches.prompts(step + 1)
        pending = generate_async(fleet.engines, batch, batches.new_tokens)  # during training
        t0 = time.perf_counter()
        losses = trainers.call("train_step", [s["tokens"] for s in samples])
        train_s, t0 = time.perf_counter() - t0, time.perf_counter()
        trainers.call("whereabouts")  # every rank answers before rank 0 pauses the engines
        stats = trainers.call("refit", step)  # rank 0 pauses, commits and resumes
        finite = [x for x in losses if x == x]  # ranks off the last pipeline stage say nan
        rows.append({"step": step, "loss": sum(finite) / len(finite), "wait_s": wait_s,
                     "train_s": train_s, "refit_s": time.perf_counter() - t0,
                     "versions": [s["versions"] for s in samples],
                     "batch": [s["tokens"] for s in samples], "probe": tokens,
                     "rank_losses": [x if x == x else None for x in losses],
                     "sender": stats[0]["summary"]})
        print_step(tag, rows[-1], args.pause)
    last = collect(pending, batch, batches.new_tokens, timeout_s)
    rows.append({"step": args.steps + 1, "versions": [s["versions"] for s in last],
                 "probe": probe(fleet, *probes)})
    return rows


def print_step(tag: str, row: dict, pause: str) -> None:
    print(f"[{tag}] step {row['step']}: samples from versions "
          f"{sorted({tuple(v) for v in row['versions']})}, generate wait "
          f"{row['wait_s'] * 1e3:.0f} ms, train {row['train_s'] * 1e3:.0f} ms (loss "
          f"{row['loss']:.3f}), refit {row['refit_s'] * 1e3:.0f} ms (pause {pause}): "
          f"{row['sender']}", flush=True)


def summary(rows: list[dict]) -> str:
    lines = ["step | loss   | generate wait ms | train ms | refit ms | sample versions",
             "-----|--------|------------------|----------|----------|----------------"]
    for r in rows[:-1]:
        lines.append(f"{r['step']:>4} | {r['loss']:.3f} | {r['wait_s'] * 1e3:>16.0f} | "
                     f"{r['train_s'] * 1e3:>8.0f} | {r['refit_s'] * 1e3:>8.0f} | "
                     f"{sorted({tuple(v) for v in r['versions']})}")
    return "\n".join(lines)


def main_loop(args, tag: str, layout: RayLayout, actor_cls: type, actor_args: tuple,
              batches: Batches, llm_kwargs: dict,
              probes: tuple[list[list[int]], int]) -> list[dict]:
    """The whole recipe on a local cluster (or `--address`), torn down at the end. `probes`:
    (prompts, new tokens) whose greedy tokens are recorded before each batch."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    ray.init(address=args.address or "local", runtime_env={"env_vars": env},
             include_dashboard=False, log_to_driver=args.verbose,
             **({} if args.address else {"num_cpus": layout.trainers + layout.engines}))
    placement = trainers = fleet = None
    try:
        placement, trainers, fleet = start(args, layout, actor_cls, actor_args, llm_kwargs,
                                           Path(args.workdir or tempfile.mkdtemp(prefix=f"{tag}_")))
        rows = run(args, tag, batches, trainers, fleet, layout.timeout_s, probes)
        print(summary(rows), flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps(rows))
        return rows
    except (TrainerFailure, EngineError) as e:  # the engines say what they now serve
        print(f"[{tag}] stopped: {e}", flush=True)
        raise SystemExit(1) from e
    finally:
        if fleet is not None:
            fleet.close()
        if trainers is not None:
            trainers.kill()
        if placement is not None:
            placement.remove()
        ray.shutdown()
