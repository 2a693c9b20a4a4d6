"""Native fast path for the sender's per-tensor checks: one C++ pass per bucket.

At tens of thousands of MoE tensors the sender's Python work per tensor (name, dtype, shape,
device, contiguity, address) takes longer than NVLink needs to move them. `BucketScan.take`
checks a whole bucket's (name, tensor) items in one call that borrows every reference and
collects the addresses for the pack kernel. The
extension is built once per machine by torch's JIT loader (a C++ compiler and ninja; cached
under TORCH_EXTENSIONS_DIR per ninja, Python and torch, rebuilt when this source changes);
when it cannot be built, the Python path is used and one warning says why. `REFIT_NATIVE=0`
turns it off.
`python -m common.native` builds it ahead of time (e.g. in a container image): the first
build takes ~25 s, which otherwise falls into the first `RefitSender.setup`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from common.plan import TensorSpec

log = logging.getLogger(__name__)

_SOURCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")

_module: ModuleType | None = None
_tried = False


def _build_directory() -> str:
    """One build per (ninja, Python, torch): two ninja versions on one machine (a venv's and
    the system's, picked by PATH) cannot read each other's build logs, so sharing a directory
    made every switch a full ~25 s rebuild, inside `RefitSender.setup` while peers wait."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    key = f"{shutil.which('ninja')}|{sys.version}|{torch.__version__}"
    path = os.path.join(root, f"refit_native_{hashlib.sha1(key.encode()).hexdigest()[:12]}")
    os.makedirs(path, exist_ok=True)
    return path


def load() -> ModuleType | None:
    """The compiled extension, built on first use; None when off or not buildable here."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("REFIT_NATIVE", "1") == "0":
        return None
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load_inline

        with open(_SOURCE_FILE) as f:
            source = f.read()
        _module = load_inline("refit_native", cpp_sources=source,
                              functions=["scalar_type", "take", "copy_bytes"],
                              extra_cflags=["-O2"], build_directory=_build_directory())
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the Python path still works
        log.warning("refit native checks unavailable, using the Python path: %s", e)
        return None
    log.info("refit native checks ready in %.1fs", time.perf_counter() - t0)
    return _module


class BucketScan:
    """One bucket's expected names, dtypes and shapes, laid out for the native `take`."""

    def __init__(self, module: ModuleType, specs: Sequence[TensorSpec],
                 device: torch.device) -> None:
        self.module = module
        self.names = [s.name for s in specs]
        codes = {d: module.scalar_type(torch.empty(0, dtype=d)) for d in {s.dtype for s in specs}}
        self.dtypes = torch.tensor([codes[s.dtype] for s in specs], dtype=torch.int8)
        self.shapes = torch.tensor([d for s in specs for d in s.shape], dtype=torch.int64)
        dims = itertools.accumulate((len(s.shape) for s in specs), initial=0)
        self.offsets = torch.tensor(list(dims), dtype=torch.int64)
        self.device = (1 if device.type == "cuda" else 0,
                       device.index if device.type == "cuda" else -1)
        self.ptrs = torch.zeros(len(specs), dtype=torch.int64)

    def take(self, items: list) -> tuple[list[torch.Tensor] | None, np.ndarray | None]:
        """(the tensors when every name, dtype and shape is as planned, else None; their
        addresses when every one is also contiguous on the device, else None). The addresses
        are valid until the next `take` of this bucket."""
        try:
            code, tensors = self.module.take(items, self.names, self.dtypes, self.shapes,
                                             self.offsets, *self.device, self.ptrs)
        except (TypeError, RuntimeError):  # not a list, no storage, ...: Python decides
            return None, None
        return tensors, self.ptrs.numpy() if code == -1 else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if load() is not None else 1)
