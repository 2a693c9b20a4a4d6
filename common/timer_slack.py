"""The calling thread's timer slack cut to a microsecond for the length of a CUDA refit (Linux).

A refit's waits poll a collective's completion and sleep between polls (20 us on NCCL); the
kernel may stretch each sleep by the thread's timer slack, 50 us by default, so a
`time.sleep(20e-6)` lasts ~75 us, and a sender that waits for a buffer wakes ~50 us after it
was free, once per bucket. With a slack of 1 us the same sleep lasts ~25 us; the previous
slack comes back when the refit ends. A CPU (gloo) refit, whose collectives take milliseconds
and whose processes share few cores, keeps its slack. `REFIT_TIMER_SLACK_NS` sets the slack
for every refit (0: never touched); elsewhere than Linux, nothing happens. No vllm or megatron
import here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL | None:
    """The C library's `prctl`, loaded once (None off Linux or where it cannot be)."""
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def current_slack_ns() -> int | None:
    """This thread's timer slack in ns (None where it cannot be read)."""
    if (libc := _libc()) is None:
        return None
    value = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    return value if value >= 0 else None


@contextlib.contextmanager
def fine_timer_slack(cuda: bool) -> Iterator[None]:
    """This thread's timer slack inside: `REFIT_TIMER_SLACK_NS` if set, else 1 us for a
    `cuda` refit (left alone for others); as it was after."""
    raw = os.environ.get("REFIT_TIMER_SLACK_NS", "1000" if cuda else "0")
    if not raw.strip().isdigit():
        raise ValueError(f"REFIT_TIMER_SLACK_NS={raw!r}: a whole number of nanoseconds "
                         "(0: leave the timer slack alone)")
    wanted = int(raw)
    before = current_slack_ns() if wanted > 0 else None
    if before is None or before == wanted:
        yield
        return
    libc = _libc()
    libc.prctl(_PR_SET_TIMERSLACK, wanted, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_TIMERSLACK, before, 0, 0, 0)
