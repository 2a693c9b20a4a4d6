"""The recipes' engines: a real `vllm serve` server (default) or an in-process `LLM` in a child
process, both driven through the same `EngineClient` interface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.clients.engine_client import EngineClient
from common.clients.fleet import EngineFleet
from common.config import RefitConfig
from common.plan import RefitPlan
from common.quant.fp8_plan import Fp8Source, Fp8Targets
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port

KINDS = ("serve", "local")
MAX_MODEL_LEN, KV_CACHE_BYTES = 128, 64 << 20


def tiny_llm_kwargs(max_model_len: int = MAX_MODEL_LEN, max_num_seqs: int = 4) -> dict:
    """vLLM settings of every tiny engine (recipes, tests, benchmarks): a fixed KV cache (on
    CPU a memory fraction would reserve part of the NUMA node), short sequences."""
    return {"kv_cache_memory_bytes": KV_CACHE_BYTES, "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs}


LOCAL_LLM_KWARGS = tiny_llm_kwargs()


@contextlib.contextmanager
def open_engine(kind: str, checkpoint: str, log_dir: str | Path) -> Iterator[EngineClient]:
    """An engine started on `checkpoint`, stopped on exit; a server logs to `log_dir`."""
    if kind == "serve":
        from common.clients.serve import ServeConfig, VllmServer

        name = Path(checkpoint).name
        config = ServeConfig(model=checkpoint, max_model_len=MAX_MODEL_LEN,
                             kv_cache_memory_bytes=KV_CACHE_BYTES,
                             log_path=str(Path(log_dir) / f"vllm_serve_{name}.log"))
        with VllmServer(config) as server:
            with server.client() as client:
                yield client
    elif kind == "local":
        from common.clients.local_engine import LocalEngine
        from common.engine.config import EngineConfig

        with LocalEngine(EngineConfig(model=checkpoint, llm_kwargs=LOCAL_LLM_KWARGS)) as client:
            yield client
    else:
        raise ValueError(f"engine kind {kind!r} is not one of {KINDS}")


def greedy(engine: EngineClient, prompts: list[list[int]],
           max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and logprobs of `prompts`, comparable with `==` across engines."""
    outs = engine.generate(prompts, max_tokens)
    return [o.tokens for o in outs], [o.logprobs for o in outs]


def replayed_batches(rows_path: str) -> list[list[list[int]]]:
    """The per-step training batches a Ray recipe recorded (`--result`), for a torchrun
    recipe to replay: then both launches must agree on every loss and greedy token."""
    import json

    rows = json.loads(Path(rows_path).read_text())
    return [r["batch"] for r in rows if "batch" in r]


@dataclass
class OneTrainer:
    """This test process as the only training rank of a refit group with `fleet`'s engines."""

    fleet: EngineFleet
    group: RefitGroup
    sender: RefitSender
    source: DictWeightSource | Fp8Source

    def refit(self, version: int, mode: str = "keep"):
        return self.fleet.refit(lambda: self.sender.refit(self.source, version), version, mode,
                              group=self.group)


def join_one_trainer(engines: list, state: dict[str, torch.Tensor], timeout_s: float = 60.0,
                     bucket_bytes: int = 16 << 10, transport_device: str | None = None,
                     fp8: Fp8Targets | None = None, **config: object) -> OneTrainer:
    """The engines join a fresh refit group; this process sends `state` in each refit;
    `timeout_s` bounds the join and each refit's waits; `transport_device` "cpu": CUDA
    engines join over gloo (host staging); `fp8`: the engines' block-FP8 weights, quantized
    before sending (`Fp8Source`; set `source.inner.tensors` for the next version);
    `config`: other `RefitConfig` fields."""
    fleet, port = EngineFleet(engines), free_port()
    joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=timeout_s,
                               transport_device=transport_device)
    group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=fleet.world_size(1),
                       num_trainers=1, timeout_s=timeout_s, device="cpu",
                       rank_names=fleet.rank_names(1))
    source = DictWeightSource(state) if fp8 is None else Fp8Source(DictWeightSource(state), fp8)
    plan = RefitPlan.build(source.plan_specs(), RefitConfig(
        bucket_bytes=bucket_bytes, timeout_s=timeout_s, **config))  # bounds each refit
    sender = RefitSender.setup(group, plan)
    joining.result(timeout_s)
    return OneTrainer(fleet, group, sender, source)
