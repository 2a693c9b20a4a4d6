"""Native fast path for the sender's per-tensor checks: one C++ pass per bucket.

At 20,000 MoE tensors the sender's Python work per tensor (name, dtype, shape, device,
contiguity, address: ~1 µs on an H200 host) takes longer than NVLink needs to move them.
`BucketScan.take` checks a whole bucket's (name, tensor) items in one call that borrows every
reference (~70 ns per tensor there) and collects the addresses for the pack kernel. The
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

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

int64_t scalar_type(const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); }

// Item i's tensor object when it is a (name, plain tensor or Parameter) pair, else nullptr.
static const at::Tensor* plain_tensor(PyObject* items, Py_ssize_t i) {
  PyObject* item = PyList_GET_ITEM(items, i);
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) return nullptr;
  PyObject* obj = PyTuple_GET_ITEM(item, 1);
  return THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

// The scan runs right after a training step has evicted these objects from the host caches:
// fetch item i + 12's tuple, i + 8's name and tensor object, i + 4's TensorImpl and i + 2's
// StorageImpl ahead (20,000 cold items on an H200 host: 4.0 -> 3.0 ms).
static void prefetch_ahead(PyObject* items, Py_ssize_t i, Py_ssize_t n) {
  if (i + 12 < n) __builtin_prefetch(PyList_GET_ITEM(items, i + 12));
  if (i + 8 < n) {
    PyObject* item = PyList_GET_ITEM(items, i + 8);
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) {
      __builtin_prefetch(PyTuple_GET_ITEM(item, 0));
      __builtin_prefetch(PyTuple_GET_ITEM(item, 1));
    }
  }
  if (i + 4 < n)
    if (const at::Tensor* t = plain_tensor(items, i + 4)) {
      const char* impl = reinterpret_cast<const char*>(t->unsafeGetTensorImpl());
      for (int line = 0; line < 4; ++line) __builtin_prefetch(impl + 64 * line);
    }
  if (i + 2 < n)
    if (const at::Tensor* t = plain_tensor(items, i + 2); t && t->has_storage())
      __builtin_prefetch(t->unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

// One pass over a bucket's (name, tensor) items, borrowing every reference (no tensor copies,
// no refcount traffic). Returns (code, tensors): code -1 when every name, dtype and shape is as
// planned and every tensor is contiguous on the device (addresses in `ptrs`); -2 when all match
// but some cannot go through the pointer kernel; i >= 0 when item i does not match (tensors is
// None; the caller's Python path names the problem).
py::tuple take(const py::list& items, const py::list& names, const at::Tensor& dtypes,
               const at::Tensor& shapes, const at::Tensor& offsets, int64_t device_type,
               int64_t device_index, at::Tensor ptrs) {
  const int8_t* dt = dtypes.data_ptr<int8_t>();
  const int64_t* sh = shapes.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  int64_t* out = ptrs.data_ptr<int64_t>();
  const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
  if (n != PyList_GET_SIZE(names.ptr()) || n != dtypes.numel())
    return py::make_tuple(0, py::none());
  py::list tensors(n);
  bool direct = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    auto bad = [&] { return py::make_tuple(i, py::none()); };
    prefetch_ahead(items.ptr(), i, n);
    PyObject* item = PyList_GET_ITEM(items.ptr(), i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) return bad();
    PyObject* name = PyTuple_GET_ITEM(item, 0);
    PyObject* want = PyList_GET_ITEM(names.ptr(), i);
    if (name != want && (!PyUnicode_Check(name) || PyUnicode_Compare(name, want) != 0)) {
      PyErr_Clear();
      return bad();
    }
    PyObject* obj = PyTuple_GET_ITEM(item, 1);
    if (!THPVariable_Check(obj)) return bad();
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || static_cast<int8_t>(t.scalar_type()) != dt[i]) return bad();
    auto sizes = t.sizes();
    if (static_cast<int64_t>(sizes.size()) != of[i + 1] - of[i]) return bad();
    for (size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] != sh[of[i] + d]) return bad();
    Py_INCREF(obj);
    PyList_SET_ITEM(tensors.ptr(), i, obj);
    if (!direct) continue;
    auto dev = t.device();
    if (static_cast<int64_t>(dev.type()) != device_type || dev.index() != device_index ||
        !t.is_contiguous() || t.is_neg() || t.is_conj()) {  // lazy sign/conj: not raw bytes
      direct = false;
      continue;
    }
    out[i] = reinterpret_cast<int64_t>(t.data_ptr());
  }
  return py::make_tuple(direct ? -1 : -2, tensors);
}

// The CPU pack of a bucket whose sources `take` found contiguous on the CPU: one memcpy per
// slot, no per-tensor dispatch (a `torch.cat` needs a flattened view of every 2-D source).
void copy_bytes(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& nbytes) {
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* n = nbytes.data_ptr<int64_t>();
  const int64_t count = nbytes.numel();
  TORCH_CHECK(src.numel() == count && dst.numel() == count, "copy_bytes: table sizes differ");
  py::gil_scoped_release no_gil;
  for (int64_t i = 0; i < count; ++i)
    if (n[i] > 0)
      std::memcpy(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]), n[i]);
}
"""

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

        _module = load_inline("refit_native", cpp_sources=_SOURCE,
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
