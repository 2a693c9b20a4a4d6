"""The verdict protocol of the core, on every transport (2 trainer ranks + 1 receiver, processes):
when rank 0 commits a refit after its bytes (`Transport.verdict_by_caller`, what
`EngineFleet.refit(group=)` sets), the other trainers return or raise rank 0's verdict, even
when rank 0 destroys the group the moment it published it; without a commit they return after
the status exchange as before. The end to end cases (a killed engine core, a refusing engine)
are `tests/serve/test_verdict.py`."""

from __future__ import annotations

import time

import pytest
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome, receive_all
from tests.test_transports import TRANSPORTS

TRAINERS, WORLD, TIMEOUT_S, READ_LATE_S = 2, 3, 60.0, 1.0
WHY = "engine http://gen-0:8000: POST /finish_weight_update abandoned: the engine died"


def _late(transport, delay_s: float) -> None:
    """This rank starts waiting for each verdict `delay_s` late."""
    wait = transport.await_verdict

    def late(what: str) -> None:
        time.sleep(delay_s)
        wait(what)

    transport.await_verdict = late


def _rank(rank: int, world: int, port: int, kind: str) -> dict:
    transport = TRANSPORTS[kind](host="127.0.0.1", port=port, rank=rank, world_size=world,
                                 num_trainers=TRAINERS, timeout_s=TIMEOUT_S, device="cpu")
    config = RefitConfig(bucket_bytes=64 << 10, timeout_s=TIMEOUT_S)
    source = DictWeightSource({f"w{i}": torch.full((128, 128), float(i)) for i in range(4)})
    out: dict = {}
    if not transport.is_trainer:
        receiver = RefitReceiver.setup(transport)
        out["landed"] = [len(receive_all(receiver)[1]) for _ in range(3)]
        transport.destroy()
        return out
    sender = RefitSender.setup(transport, RefitPlan.build(source.plan_specs(), config))
    out["plain"] = outcome(lambda: sender.refit(source, 1))  # no commit: no verdict
    if rank == 1:  # a trainer slow to look (a loaded machine): rank 0 leaves first
        _late(transport, READ_LATE_S)
    for version, verdict in ((2, None), (3, WHY)):
        transport.verdict_by_caller = rank == 0
        out[f"v{version}"] = outcome(lambda v=version: sender.refit(source, v))
        if rank == 0:
            transport.publish_verdict(verdict)
    transport.destroy()  # rank 0 at once: it must still wait until rank 1 read the verdict
    return out


@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_verdict_every_trainer_returns_or_raises_rank0s_verdict(kind):
    outs = expect_ok(run_ranks(_rank, WORLD, kind, timeout=120))
    assert outs[2]["landed"] == [4, 4, 4]  # the bytes arrived each time
    for rank in (0, 1):
        assert outs[rank]["plain"] == ("ok", "") and outs[rank]["v2"] == ("ok", "")
    assert outs[0]["v3"] == ("ok", "")  # rank 0 learns its verdict from its own commit
    kind1, msg1 = outs[1]["v3"]
    assert kind1 == "RefitAborted" and WHY in msg1 and "refit v3" in msg1, (kind1, msg1)


def test_status_record_fits_its_slot_cutting_the_error_then_the_last_timings() -> None:
    """A rank's end-of-refit record always fits (it used to loop forever when timings alone
    overflowed): the error is cut first, then the last timings; the loaded-bytes hash stays."""
    from common.transfer.handshake import STATUS_BYTES, decode_status, encode_status

    cut = decode_status(encode_status("x" * 1000, {"seconds": 1.5}))
    assert cut["error"].startswith("xxx") and cut["times"] == {"seconds": 1.5}
    times = {**{f"t{i}_s": 1.234567 for i in range(60)}, "loaded_hash": "a" * 64}
    raw = encode_status("", times, verdict=True)
    kept = decode_status(raw)
    assert len(raw) <= STATUS_BYTES and kept["verdict"]
    assert kept["times"]["loaded_hash"] == "a" * 64 and "t0_s" in kept["times"]
    assert "t59_s" not in kept["times"]
    with pytest.raises(ValueError, match="cannot fit"):
        encode_status("", {"loaded_hash": "a" * 600})
