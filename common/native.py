"""Native fast path for the sender's per-tensor checks: one C++ pass per bucket.

At 20,000 MoE tensors the sender's Python work per tensor (dtype, shape, device, contiguity,
address: ~1 µs on an H200 host) takes longer than NVLink needs to move them. `BucketScan`
checks a whole bucket in one call (~80 ns per tensor there) and collects the addresses for the
pack kernel. The extension is built once per machine by torch's JIT loader (a C++ compiler and
ninja; cached under TORCH_EXTENSIONS_DIR, rebuilt when this source changes); when it cannot be
built, the Python path is used and one warning says why. `REFIT_NATIVE=0` turns it off.
`python -m common.native` builds it ahead of time (e.g. in a container image): the first
build takes ~25 s, which otherwise falls into the first `RefitSender.setup`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from common.plan import TensorSpec

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>

int64_t scalar_type(const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); }

// -1: every tensor matches its dtype and shape and is contiguous on the device (addresses in
// `ptrs`); -2: all match but some cannot go through the pointer kernel; i >= 0: tensor i does
// not match (the caller's Python path names the problem).
int64_t scan(const std::vector<at::Tensor>& ts, const at::Tensor& dtypes,
             const at::Tensor& shapes, const at::Tensor& offsets, int64_t device_type,
             int64_t device_index, at::Tensor ptrs) {
  const int8_t* dt = dtypes.data_ptr<int8_t>();
  const int64_t* sh = shapes.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  int64_t* out = ptrs.data_ptr<int64_t>();
  if (static_cast<int64_t>(ts.size()) != dtypes.numel()) return 0;
  bool direct = true;
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!t.defined() || static_cast<int8_t>(t.scalar_type()) != dt[i]) return i;
    auto sizes = t.sizes();
    if (static_cast<int64_t>(sizes.size()) != of[i + 1] - of[i]) return i;
    for (size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] != sh[of[i] + d]) return i;
    if (!direct) continue;
    auto dev = t.device();
    if (static_cast<int64_t>(dev.type()) != device_type || dev.index() != device_index ||
        !t.is_contiguous() || t.is_neg() || t.is_conj()) {  // lazy sign/conj: not raw bytes
      direct = false;
      continue;
    }
    out[i] = reinterpret_cast<int64_t>(t.data_ptr());
  }
  return direct ? -1 : -2;
}
"""

_module: ModuleType | None = None
_tried = False


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

        _module = load_inline("refit_native", cpp_sources=_SOURCE,
                              functions=["scalar_type", "scan"], extra_cflags=["-O2"])
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the Python path still works
        log.warning("refit native checks unavailable, using the Python path: %s", e)
        return None
    log.info("refit native checks ready in %.1fs", time.perf_counter() - t0)
    return _module


class BucketScan:
    """One bucket's expected dtypes and shapes, laid out for `scan`."""

    def __init__(self, module: ModuleType, specs: Sequence[TensorSpec],
                 device: torch.device) -> None:
        self.module = module
        codes = {d: module.scalar_type(torch.empty(0, dtype=d)) for d in {s.dtype for s in specs}}
        self.dtypes = torch.tensor([codes[s.dtype] for s in specs], dtype=torch.int8)
        self.shapes = torch.tensor([d for s in specs for d in s.shape], dtype=torch.int64)
        dims = itertools.accumulate((len(s.shape) for s in specs), initial=0)
        self.offsets = torch.tensor(list(dims), dtype=torch.int64)
        self.device = (1 if device.type == "cuda" else 0,
                       device.index if device.type == "cuda" else -1)
        self.ptrs = torch.zeros(len(specs), dtype=torch.int64)

    def scan(self, tensors: Sequence[torch.Tensor]) -> tuple[bool, np.ndarray | None]:
        """(every dtype and shape as planned, source addresses or None); the addresses are
        given only when every tensor is contiguous on the device, and are valid until the
        next scan of this bucket."""
        try:
            code = self.module.scan(tensors, self.dtypes, self.shapes, self.offsets,
                                    *self.device, self.ptrs)
        except (TypeError, RuntimeError):  # None, not a tensor, no storage: Python decides
            return False, None
        if code >= 0:
            return False, None
        return True, self.ptrs.numpy() if code == -1 else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if load() is not None else 1)
