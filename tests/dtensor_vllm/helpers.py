"""Shared pieces of the vLLM end-to-end tests: tiny HF models, random refits, expected params."""

from __future__ import annotations

import time

import torch

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from common.source import DictWeightSource
from recipes.engines import (  # noqa: F401 - the tests' trainer
    OneTrainer,
    join_one_trainer,
    tiny_llm_kwargs,
)
from recipes.vllm_checks import vllm_layout

LLM_KWARGS = tiny_llm_kwargs(64)
# A trainer's join that waits while its engine child starts (a fresh interpreter importing
# vLLM): a minute on a 2-core machine running the other test group beside it.
JOIN_TIMEOUT_S = 240.0
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 20, 30, 40]]


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, llm_kwargs=LLM_KWARGS)


def start_engine(model_dir: str) -> LocalEngine:
    """The default test engine: an in-process `LLM` with the refit backend, in a child."""
    return LocalEngine(engine_config(model_dir))


def greedy(engine, prompts=PROMPTS, max_tokens: int = 8) -> dict:
    """Tokens and logprobs of greedy completions, comparable with `==`."""
    outs = engine.generate(prompts, max_tokens)
    return {"tokens": [o.tokens for o in outs], "logprobs": [o.logprobs for o in outs]}


def expected_params(checkpoint_dir) -> dict[str, torch.Tensor]:
    """A reference checkpoint (written by save_pretrained) in vLLM's own layout."""
    from safetensors.torch import load_file

    return vllm_layout(load_file(f"{checkpoint_dir}/model.safetensors"))


def new_version(state: dict[str, torch.Tensor], seed: int) -> None:
    """A new version of every tensor, in place (dtypes kept: the fp32 router bias too)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        state[name] = (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)


def perturb(state: dict[str, torch.Tensor], seed: int, density: float = 0.03) -> None:
    """`density` of each floating tensor's elements changed, in place (dtypes kept)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point():
            flat = t.reshape(-1).clone()
            pick = torch.rand(flat.numel(), generator=g) < density
            flat[pick] += (0.05 * torch.randn(int(pick.sum()), generator=g)).to(t.dtype)
            state[name] = flat.view(t.shape)


class DriftAt(DictWeightSource):
    """Yields tensor `name` as fp32 where the plan says bf16: the sender aborts there."""

    def __init__(self, tensors, name: str) -> None:
        super().__init__(tensors)
        self.name = name

    def iter_tensors(self, plan):
        for name, t in super().iter_tensors(plan):
            yield name, (t.float() if name == self.name else t)


class KillingSource(DictWeightSource):
    """Yields one tensor per `delay_s` and calls `kill()` before tensor `after` (a peer dying
    mid-refit, some buckets already loaded); `killed_at` records when."""

    def __init__(self, tensors, kill, after: int, delay_s: float = 0.15) -> None:
        super().__init__(tensors)
        self.kill, self.after, self.delay_s = kill, after, delay_s
        self.killed_at: float | None = None

    def iter_tensors(self, plan):
        for i, item in enumerate(super().iter_tensors(plan)):
            if self.kill is not None and i == self.after:
                self.kill()
                self.killed_at = time.monotonic()
            time.sleep(self.delay_s)
            yield item


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of `pids` runs (zombies count as gone); returns the survivors."""
    import psutil

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def apply_paths(engine) -> list[dict]:
    """What each of the engine's workers reports of its last apply (path, map layers, hash)."""
    keys = ("path", "tensors", "bytes", "why", "needs_bytes", "loaded_hash", "rolled_back",
            "layers")
    return [{k: r[k] for k in keys if k in r} for r in engine.apply_reports()]


def same_params(name: str, got: dict, want: dict) -> None:
    """Every param (after vLLM's processing) equals a fresh engine's, bit for bit."""
    assert sorted(got) == sorted(want), f"{name}: param names differ from a fresh engine's"
    as_bytes = [(n, got[n].contiguous().reshape(-1).view(torch.uint8),
                 want[n].contiguous().reshape(-1).view(torch.uint8)) for n in want]
    differ = [n for n, a, b in as_bytes if not torch.equal(a, b)]
    assert not differ, f"{name}: {len(differ)} of {len(want)} params differ, e.g. {differ[:3]}"
    print(f"[engine] {name}: {len(want)} params equal a fresh engine's bit for bit")
