"""Guarantees of the core that docs/architecture.md states, each held by a test that fails when the
guarantee breaks (`pytest -k guarantee`; the engine-side ones are in
tests/dtensor_vllm/test_guarantees_engine.py). Real gloo groups and shared memory, spawned ranks.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.wire import checksum
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok
from tests.test_failures import check_corrupted, corrupted_rank
from tests.test_transports import NOTICE_S, TRAINERS, WORLD, dying_receiver_rank


def test_guarantee_the_cpu_checksum_covers_every_byte() -> None:
    """A flip of any one byte changes the CRC-32, whatever the payload's length and the
    alignment of its first byte (a checksum that skipped byte 0, or a tail, would pass the
    refit-level tests that flip the last byte)."""
    base = (torch.arange(96, dtype=torch.int64) * 37 % 251).to(torch.uint8)
    for start in range(8):  # each alignment of the payload's first byte
        for size in (1, 7, 8, 9, 64, 67, 96 - start):
            payload = base[start:start + size]
            want = checksum.compute(payload)
            for i in range(size):  # first, interior, last
                payload[i] ^= 0xFF
                got = checksum.compute(payload)
                payload[i] ^= 0xFF
                assert got != want, f"a flip of byte {i} of {size} (from {start}) went unseen"
            assert checksum.compute(payload) == want


def test_guarantee_a_flip_of_a_buckets_first_byte_fails_the_refit_everywhere() -> None:
    """At refit level: byte 0 of a bucket (receiver 2: the first bucket, receiver 3: an
    interior one), not only the last byte, is covered end to end."""
    damage = {2: (0, "flip-first"), 3: (2, "flip-first")}
    check_corrupted(expect_ok(run_ranks(corrupted_rank, 4, damage)), damage)


@pytest.mark.parametrize("kind", ["gloo", "shm"])
def test_guarantee_the_abort_record_alone_carries_a_dead_receiver_to_every_trainer(kind):
    """The receiver dies mid-refit; the trainers keep their processes, and so their sockets,
    alive until both have raised. Trainer 1 waits for a bucket from trainer 0, which is alive
    but has stopped sending: no socket error (nor, on shared memory, a dead source) reaches
    that wait, so only the abort record trainer 0 wrote can end it within the bound (60 s
    timeout)."""
    hold = mp.get_context("spawn").Barrier(TRAINERS)
    res = run_ranks(dying_receiver_rank, WORLD, kind, hold, timeout=120, allow_dead=True)
    assert res[2] == ("dead", 17), res[2]
    for rank in range(TRAINERS):
        status, (err, msg, elapsed) = res[rank]
        assert status == "ok" and err == "RefitCommError", res[rank]
        assert elapsed < NOTICE_S, f"rank {rank} took {elapsed:.1f}s: {msg}"
    assert "refit rank 0/3 (trainer) failed first" in res[1][1][1], res[1]
