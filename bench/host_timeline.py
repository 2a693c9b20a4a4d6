"""Host timestamps of one refit's calls (the sender's steps, the graph frames' launches, an FP8
source's takes and fills), in order: where the host's time goes before the first launch and
between launches, which cProfile's totals per function do not show.

    with recording() as log:
        t0 = time.perf_counter(); sender.refit(source, version)
    print_calls(log, t0)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator

from common.kernels.fp8_kernel import QuantizeLaunches
from common.quant.fp8_fill import FillFlags
from common.quant.fp8_plan import Fp8Source
from common.transfer.endpoint import Endpoint
from common.transfer.graph_frames import GraphFrames
from common.transfer.sender import RefitSender

WATCHED = [(Endpoint, ("agree_on_needs",)),
           (RefitSender, ("header_table", "_send", "_settle", "_filled_error")),
           (GraphFrames, ("start_refit", "send", "send_filled", "flush", "_launch")),
           (Fp8Source, ("_take",)), (FillFlags, ("reset", "marked")),
           (QuantizeLaunches, ("stage",))]


def _timed(f, name: str, log: list):
    @functools.wraps(f)
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            log.append((t0, time.perf_counter(), name))
    return call


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[float, float, str]]]:
    """Every `WATCHED` method timed while inside: (start, end, "Class.method") appended to the
    list yielded; the methods restored after."""
    log: list[tuple[float, float, str]] = []
    saved = [(owner, name, owner.__dict__[name]) for owner, names in WATCHED for name in names]
    try:
        for owner, name, f in saved:
            setattr(owner, name, _timed(f, f"{owner.__name__}.{name}", log))
        yield log
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)


def print_calls(log: list[tuple[float, float, str]], t0: float) -> None:
    """The calls in start order, microseconds after `t0` (to stderr)."""
    for start, end, name in sorted(log):
        print(f"  {1e6 * (start - t0):9.1f} .. {1e6 * (end - t0):9.1f} us  "
              f"{1e6 * (end - start):8.1f}  {name}", file=sys.stderr)
