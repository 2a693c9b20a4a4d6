"""`refit.connect` among training ranks alone (no engine: every rank is a trainer), over
gloo: the one call sets up the group and the sender on every rank and `refit(step)` returns on
every rank; a rank that never calls it is named by rank 0 within the timeout; a dead engine's
error reaches every rank (`pytest -k newcomer` also runs the README's quick start)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import refit
from common.wire.group import free_port
from recipes.rank_runner import run_ranks


def _trainer(rank: int, world: int, port: int, case: str, url: str) -> object:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    source = refit.DictWeightSource({"w": torch.full((64, 8), float(rank), dtype=torch.bfloat16)})
    t0 = time.monotonic()
    try:
        if case == "wrong_rank" and rank == 1:
            return "skipped connect"
        engines = [url] if case == "dead_engine" else []
        with refit.connect(source, engines, timeout_s=5.0) as session:
            stats = session.refit(1)
            return ("refit", stats.version, session.group.world_size)
    except refit.RefitError as e:
        return ("error", type(e).__name__, str(e), time.monotonic() - t0)


def test_newcomer_connect_among_trainers_refits_on_every_rank() -> None:
    out = run_ranks(_trainer, 2, "ok", "", timeout=60)
    assert out == {0: ("ok", ("refit", 1, 2)), 1: ("ok", ("refit", 1, 2))}, out


def test_newcomer_connect_names_a_rank_that_never_calls_it() -> None:
    out = run_ranks(_trainer, 2, "wrong_rank", "", timeout=60)
    status, (kind, name, message, seconds) = out[0]
    assert kind == "error" and "training ranks [1] did not call refit.connect" in message, out
    assert seconds < 15, seconds


def test_newcomer_connect_a_dead_engine_fails_every_rank() -> None:
    out = run_ranks(_trainer, 2, "dead_engine", f"http://127.0.0.1:{free_port()}", timeout=60)
    for rank in (0, 1):
        status, (kind, name, message, seconds) = out[rank]
        assert kind == "error" and "could not set up the engines" in message, out
        assert "http://127.0.0.1" in message and seconds < 15, out


def test_newcomer_every_public_name_of_refit_resolves() -> None:
    missing = [name for name in refit.__all__ if getattr(refit, name, None) is None]
    assert not missing and "connect" in refit.__all__, missing
