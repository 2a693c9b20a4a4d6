"""Python's cyclic garbage collector paused for the length of a refit.

A refit makes tens of thousands of short-lived tensors (an FP8 source's values and scales, a
gather's full tensors), each one tracked by the collector; while a bucket holds them they
survive its young collections and trigger full ones, which rescan every object the process
holds (a trainer: its whole model and optimizer). Paused, they are freed by reference counting
as their bucket goes, and the collector resumes, as it was, when the refit ends (Megatron's
`--manual-gc` pauses it for the same reason). What a pause costs: garbage in reference cycles
made during the refit (a source's own cycles, a failure's traceback) waits for the end of the
refit, with whatever tensors it holds. `REFIT_GC_PAUSE=0` leaves the collector alone. No vllm
or megatron import here.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic collection off inside, back to its previous state after (a caller that
    manages collection itself keeps it off); untouched with `REFIT_GC_PAUSE=0`."""
    if os.environ.get("REFIT_GC_PAUSE", "1") == "0":
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
