"""Where a benchmark's host time goes: one call under cProfile, its costliest functions."""

from __future__ import annotations

import cProfile
import pstats
import sys
from collections.abc import Callable
from typing import Any


def profile_call(fn: Callable[..., Any], *args: Any, top: int = 25) -> Any:
    """`fn(*args)` under cProfile; its `top` costliest functions by own time, to stderr."""
    profiler = cProfile.Profile()
    result = profiler.runcall(fn, *args)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(top)
    return result
