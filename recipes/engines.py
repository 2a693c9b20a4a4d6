"""The recipes' engines: a real `vllm serve` server (default) or an in-process `LLM` in a child
process, both driven through the same `EngineClient` interface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from common.engine_client import EngineClient

KINDS = ("serve", "local")
MAX_MODEL_LEN, KV_CACHE_BYTES = 128, 64 << 20


@contextlib.contextmanager
def open_engine(kind: str, checkpoint: str, log_dir: str | Path) -> Iterator[EngineClient]:
    """An engine started on `checkpoint`, stopped on exit; a server logs to `log_dir`."""
    if kind == "serve":
        from common.serve import ServeConfig, VllmServer

        name = Path(checkpoint).name
        config = ServeConfig(model=checkpoint, max_model_len=MAX_MODEL_LEN,
                             kv_cache_memory_bytes=KV_CACHE_BYTES,
                             log_path=str(Path(log_dir) / f"vllm_serve_{name}.log"))
        with VllmServer(config) as server:
            with server.client() as client:
                yield client
    elif kind == "local":
        from common.engine import LocalEngine
        from common.engine_config import EngineConfig

        kwargs = {"kv_cache_memory_bytes": KV_CACHE_BYTES, "max_model_len": MAX_MODEL_LEN,
                  "max_num_seqs": 4}
        with LocalEngine(EngineConfig(model=checkpoint, llm_kwargs=kwargs)) as client:
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
