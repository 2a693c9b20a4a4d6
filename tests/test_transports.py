"""Every transport passes the same conformance cases through the real sender and receiver:
the gloo refit group and same-host shared memory, 2 trainer ranks + 1 receiver (processes).

- round trips: two refits arrive bit for bit;
- abort: the sending trainer's drifted tensor fails the refit on every rank (the sender
  names it, the others get the ABORT), and the next refit lands;
- dead peer: the receiver dies mid-refit; with a 60 s timeout both trainers raise within
  seconds, naming themselves.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from common.wire.shm_transport import ShmTransport
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome, receive_all

TRANSPORTS = {"gloo": RefitGroup, "shm": ShmTransport}
TRAINERS, WORLD, TIMEOUT_S, NOTICE_S = 2, 3, 60.0, 5.0


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)}
    out["layers.1.weight"] = out["layers.1.weight"].bfloat16()
    out["router.bias"] = torch.randn(16, generator=g)
    return out


def _join(kind: str, rank: int, world: int, port: int):
    transport = TRANSPORTS[kind](host="127.0.0.1", port=port, rank=rank, world_size=world,
                                 num_trainers=TRAINERS, timeout_s=TIMEOUT_S, device="cpu")
    config = RefitConfig(bucket_bytes=128 << 10, num_buffers=2, timeout_s=TIMEOUT_S)
    return transport, config


class _Drifted(DictWeightSource):
    def iter_tensors(self, plan):
        for name, t in super().iter_tensors(plan):
            yield name, (t.double() if t is not None and name == "layers.5.weight" else t)


def conformance_rank(rank: int, world: int, port: int, kind: str) -> dict:
    transport, config = _join(kind, rank, world, port)
    out: dict = {}
    if transport.is_trainer:
        source = DictWeightSource(_weights(1))
        sender = RefitSender.setup(transport, RefitPlan.build(source.plan_specs(), config))
        sender.refit(source, 1)
        source.tensors = _weights(2)
        sender.refit(source, 2)
        bad = _Drifted(source.tensors) if rank == 0 else source  # rank 0 sends everything
        out["abort"] = outcome(lambda: sender.refit(bad, 3))
        source.tensors = _weights(4)
        sender.refit(source, 4)
    else:
        receiver = RefitReceiver.setup(transport)
        for version in (1, 2):
            stats, got = receive_all(receiver)
            out[version] = stats.version == version and all(
                torch.equal(got[n], t) for n, t in _weights(version).items())
        out["abort"] = outcome(lambda: receive_all(receiver))
        stats, got = receive_all(receiver)
        out[4] = all(torch.equal(got[n], t) for n, t in _weights(4).items())
    transport.destroy()
    return out


@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_round_trips_and_an_abort_behave_alike_on_every_transport(kind: str) -> None:
    res = expect_ok(run_ranks(conformance_rank, WORLD, kind, timeout=120))
    assert res[2][1] and res[2][2] and res[2][4], res[2]
    assert res[0]["abort"][0] == "TensorMismatchError" and "layers.5.weight" in res[0]["abort"][1]
    for rank in (1, 2):
        assert res[rank]["abort"][0] == "RefitAborted" and "rank 0" in res[rank]["abort"][1]


def dying_receiver_rank(rank: int, world: int, port: int, kind: str, hold=None) -> tuple:
    """`hold` (a barrier of the trainers): keep the process, and so its sockets, alive after
    raising until every trainer has raised; only the abort record can then carry the death."""
    transport, config = _join(kind, rank, world, port)
    source = DictWeightSource(_weights(1))
    if transport.is_trainer:
        sender = RefitSender.setup(transport, RefitPlan.build(source.plan_specs(), config))
        t0 = time.monotonic()
        kind_msg = outcome(lambda: sender.refit(source, 1))
        elapsed = time.monotonic() - t0
        if hold is not None:
            with contextlib.suppress(threading.BrokenBarrierError):  # the other one never raised
                hold.wait(TIMEOUT_S / 2)
        return (*kind_msg, elapsed)
    receiver = RefitReceiver.setup(transport)
    calls = []

    def load(items):
        calls.append(1)
        if len(calls) == 2:
            os._exit(17)  # dies mid-refit
        time.sleep(0.05)

    receiver.receive(load)
    return ("not killed", "", 0.0)


@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_a_dead_receiver_fails_every_trainer_in_seconds_on_every_transport(kind: str) -> None:
    res = run_ranks(dying_receiver_rank, WORLD, kind, timeout=120, allow_dead=True)
    assert res[2] == ("dead", 17), res[2]
    for rank in range(TRAINERS):
        status, (err, msg, elapsed) = res[rank]
        assert status == "ok" and err == "RefitCommError", res[rank]
        assert f"refit rank {rank}/3" in msg, msg
        assert elapsed < NOTICE_S, f"rank {rank} took {elapsed:.1f}s: {msg}"
