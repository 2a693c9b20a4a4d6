"""Native fast path for the sender's per-tensor checks: one C++ pass per bucket.

At tens of thousands of MoE tensors the sender's Python work per tensor (name, dtype, shape,
device, contiguity, address) takes longer than NVLink needs to move them. `BucketScan.take`
checks a whole bucket's (name, tensor) items in one call that borrows every reference and
collects the addresses for the pack kernel (`take_mapping`: the tensors a dict holds under the
bucket's names, looked up in the same call). The extension is built once per (source, Python,
torch) by torch's JIT loader (a C++ compiler and ninja) under TORCH_EXTENSIONS_DIR; any later
process imports the built library directly, whichever ninja is on PATH (two ninja versions
cannot read each other's build logs, so letting torch's loader decide meant a full rebuild
inside `RefitSender.setup` while the peers wait). `make setup` builds it (`python -m
common.kernels.native`); when it cannot be built, the Python path is used and one warning says why.
`REFIT_NATIVE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_SOURCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")
_NAME = "refit_native"
_FUNCTIONS = ["scalar_type", "take", "take_mapping", "copy_bytes", "delta_mask", "delta_gather",
              "delta_count", "delta_scatter"]

_module: ModuleType | None = None
_tried = False


def _build_directory(source: str) -> str:
    """Where the library for this source, Python and torch is (or will be) built."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    key = f"{source}|{sys.version}|{torch.__version__}"
    return os.path.join(root, f"{_NAME}_{hashlib.sha1(key.encode()).hexdigest()[:12]}")


def _import_built(directory: str) -> ModuleType | None:
    """The library a finished build left in `directory` (its stamp written last), or None."""
    library = os.path.join(directory, f"{_NAME}.so")
    if not os.path.exists(os.path.join(directory, "built")) or not os.path.exists(library):
        return None
    spec = importlib.util.spec_from_file_location(_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(source: str, directory: str) -> ModuleType:
    """Compile with torch's JIT loader (the venv's ninja first on PATH), then stamp."""
    from torch.utils.cpp_extension import load_inline

    os.makedirs(directory, exist_ok=True)
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), path])
    try:
        module = load_inline(_NAME, cpp_sources=source, functions=_FUNCTIONS,
                             extra_cflags=["-O2"], build_directory=directory)
    finally:
        os.environ["PATH"] = path
    with open(os.path.join(directory, "built"), "w") as f:
        f.write(f"{sys.version}|{torch.__version__}\n")
    return module


def load() -> ModuleType | None:
    """The compiled extension (imported if built, else built now); None when off or not
    buildable here."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("REFIT_NATIVE", "1") == "0":
        return None
    t0 = time.perf_counter()
    try:
        with open(_SOURCE_FILE) as f:
            source = f.read()
        directory = _build_directory(source)
        _module, how = _import_built(directory), "imported"
        if _module is None:
            _module, how = _build(source, directory), "built (once per source, Python, torch)"
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the Python path still works
        log.warning("refit native checks unavailable, using the Python path: %s", e)
        return None
    log.info("refit native checks %s in %.1fs: %s", how, time.perf_counter() - t0, directory)
    return _module


class BucketScan:
    """One bucket's expected names, dtypes and shapes (`common.plan.TensorSpec`s), laid out
    for the native `take`."""

    def __init__(self, module: ModuleType, specs: Sequence[Any],
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
        self.ptrs_view = self.ptrs.numpy()  # the same memory, made once

    def take(self, items: list) -> tuple[list[torch.Tensor] | None, np.ndarray | None]:
        """(the tensors when every name, dtype and shape is as planned, else None; their
        addresses when every one is also contiguous on the device, else None). The addresses
        are valid until the next `take` of this bucket."""
        return self._call(self.module.take, items)

    def take_mapping(self, mapping: dict) -> tuple[list[torch.Tensor] | None, np.ndarray | None]:
        """`take` of the tensors `mapping` (a dict) holds under the bucket's names, with no
        (name, tensor) item made; (None, None) when one is missing or differs."""
        return self._call(self.module.take_mapping, mapping)

    def _call(self, take, given) -> tuple[list[torch.Tensor] | None, np.ndarray | None]:
        try:
            code, tensors = take(given, self.names, self.dtypes, self.shapes, self.offsets,
                                 *self.device, self.ptrs)
        except (TypeError, RuntimeError):  # not a list, no storage, ...: Python decides
            return None, None
        return tensors, self.ptrs_view if code == -1 else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if load() is not None else 1)
