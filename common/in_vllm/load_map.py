"""Where each received byte lands in a worker's params, learned once by watching a real load.

`CopyRecorder` is a torch dispatch mode held around the loads of one refit: it sees every
`copy_` of received bytes into a model-format param or buffer the reload materialised (a
`Fill`), each fill of one value into such a tensor (a `ConstFill`: padding the loader zeroes),
and every other write into such a tensor or read of received bytes, which makes the tensors
involved unmappable. `LoadMap.build` turns the fills into byte runs per bucket and
accepts a destination only if its fills tile its loadable bytes exactly, so replaying the runs
is the loaders' own copies (`BucketCopy`: one memcpy loop on CPU, one scatter launch on CUDA).
Nothing here imports vLLM.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from common.kernels import native
from common.kernels.pack_kernel import BufferKernel

MIN_RUN_BYTES = 64  # an element-wise strided copy is no memcpy: leave it to the loaders


@dataclass(frozen=True)
class Dest:
    """A model-format tensor of one layer: `layer` is the module's path in the model."""

    layer: str
    name: str

    @property
    def param_name(self) -> str:
        return f"{self.layer}.{self.name}" if self.layer else self.name


@dataclass(frozen=True)
class Fill:
    """One loader copy: received tensor `index` (from byte `src_offset`, element strides
    `src_strides`) into `dest` (from byte `dst_offset`, strides `dst_strides`)."""

    index: int
    src_offset: int
    src_strides: tuple[int, ...]
    dest: Dest
    dst_offset: int
    dst_strides: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class ConstFill:
    """A loader's write of one value into part of `dest` (the zeros of a vocabulary's padding
    rows): no received byte lands there, and a replay writes the value again."""

    dest: Dest
    dst_offset: int
    dst_strides: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int
    value: float | int | bool

    @property
    def src_offset(self) -> int:  # `byte_runs` walks the destination alone
        return self.dst_offset

    @property
    def src_strides(self) -> tuple[int, ...]:
        return self.dst_strides


_CONST_WRITES = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


class _Ranges:
    """Non-overlapping address intervals [start, end) with a value each."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.spans: list[tuple[int, int, Any]] = []

    def add(self, start: int, end: int, value: Any) -> None:
        self.drop(start, end)
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.spans.insert(i, (start, end, value))

    def drop(self, start: int, end: int) -> None:
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while i < len(self.spans) and self.spans[i][0] < end:
            if self.spans[i][1] > start:
                del self.starts[i], self.spans[i]
            else:
                i += 1

    def find(self, addr: int) -> tuple[int, int, Any] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.spans[i][1]:
            return self.spans[i]
        return None


def _extent(t: torch.Tensor) -> int:
    """Bytes from `t`'s first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.itemsize


class CopyRecorder(TorchDispatchMode):
    """Records the loads of one refit into the layers of `layers` (module -> path)."""

    def __init__(self, layers: dict[torch.nn.Module, str]) -> None:
        super().__init__()
        self.layers = layers
        self.fills: list[Fill] = []
        self.const_fills: list[ConstFill] = []
        self.bad_tensors: dict[int, str] = {}  # plan index -> why
        self.bad_dests: dict[Dest, str] = {}
        self.sources, self.dests = _Ranges(), _Ranges()
        self._hooks: list[Any] = []
        self._finalizers: list[weakref.finalize] = []

    def add_sources(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """The received tensors (plan index, view) about to be loaded."""
        for index, t in items:
            if t.numel() and t.device.type != "meta":
                start, end = t.data_ptr(), t.data_ptr() + t.nbytes
                self.sources.add(start, end, (index, start))
                self._finalizers.append(weakref.finalize(t, self.sources.drop, start, end))

    def add_copy(self, view: torch.Tensor, copy: torch.Tensor) -> None:
        """`copy` (contiguous) replaces `view` of a received tensor that a loader still holds."""
        hit = self.sources.find(view.data_ptr())
        if hit is None:
            return
        index, base = hit[2]
        if not view.is_contiguous():
            self.bad_tensors.setdefault(index, "a held strided view was copied")
            return
        start = copy.data_ptr()
        self.sources.add(start, start + copy.nbytes, (index, start - (view.data_ptr() - base)))
        self._finalizers.append(weakref.finalize(copy, self.sources.drop, start,
                                                 start + copy.nbytes))

    def __enter__(self) -> CopyRecorder:
        self._hooks = [register_module_parameter_registration_hook(self._registered),
                       register_module_buffer_registration_hook(self._registered)]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def _registered(self, module: torch.nn.Module, name: str, tensor: Any) -> None:
        path = self.layers.get(module)
        if path is None or tensor is None or tensor.device.type == "meta" or not tensor.numel():
            return
        start = tensor.data_ptr()
        self.dests.add(start, start + tensor.nbytes, (Dest(path, name), start, tensor.dtype))
        self._finalizers.append(weakref.finalize(tensor, self.dests.drop, start,
                                                 start + tensor.nbytes))

    def close(self) -> None:
        """Stop tracking: the receive buffers' views outlive the refit that was watched."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if not func.is_view:
            self._see(func, args, kwargs)
        return func(*args, **kwargs)

    def _see(self, func: Any, args: tuple, kwargs: dict) -> None:
        tensors = [(a, args[i] if i < len(args) else kwargs.get(a.name))
                   for i, a in enumerate(func._schema.arguments)]
        tensors = [(a, t) for a, t in tensors if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for _, t in tensors):
            return  # the reload's dry runs on meta params
        if func is torch.ops.aten.copy_.default:
            self._copy(args[0], args[1])
            return
        if func in _CONST_WRITES and args[0].numel():
            self._const(func, args[0], args[1] if len(args) > 1 else 0)
            return
        for schema, t in tensors:
            written = schema.alias_info is not None and schema.alias_info.is_write
            if written and (hit := self.dests.find(t.data_ptr())):
                self.bad_dests.setdefault(hit[2][0], f"written by {func}")
            elif not written and (hit := self.sources.find(t.data_ptr())):
                self.bad_tensors.setdefault(hit[2][0], f"read by {func}")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = self.sources.find(src.data_ptr()) if src.numel() else None
        d = self.dests.find(dst.data_ptr()) if dst.numel() else None
        if d is not None and src.data_ptr() == dst.data_ptr():
            return  # a tensor copied onto itself (post-load padding that pads nothing)
        if s is None:
            if d is not None:
                self.bad_dests.setdefault(d[2][0], "written from bytes that did not arrive")
            return
        index, base = s[2]
        if d is None:
            self.bad_tensors.setdefault(index, "copied into a tensor that is not a param")
            return
        dest, dst_base, dtype = d[2]
        if src.dtype != dst.dtype or dst.dtype != dtype or tuple(src.shape) != tuple(dst.shape):
            self.bad_tensors.setdefault(index, f"converted or broadcast into {dest.param_name}")
            return
        if src.data_ptr() + _extent(src) > s[1] or dst.data_ptr() + _extent(dst) > d[1]:
            self.bad_tensors.setdefault(index, "a copy outside the received tensor or param")
            return
        self.fills.append(Fill(index, src.data_ptr() - base, tuple(src.stride()), dest,
                               dst.data_ptr() - dst_base, tuple(dst.stride()),
                               tuple(src.shape), src.itemsize))


    def _const(self, func: Any, dst: torch.Tensor, value: Any) -> None:
        """A fill of one value: kept if it lands inside one param (a replay rewrites it)."""
        d = self.dests.find(dst.data_ptr())
        if d is None:
            return
        dest, dst_base, _ = d[2]
        if isinstance(value, torch.Tensor) or dst.data_ptr() + _extent(dst) > d[1]:
            self.bad_dests.setdefault(dest, f"written by {func}")
            return
        self.const_fills.append(ConstFill(dest, dst.data_ptr() - dst_base, tuple(dst.stride()),
                                          tuple(dst.shape), dst.itemsize, value))


def byte_runs(fill: Fill | ConstFill) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(source offsets, destination offsets, run length) of `fill`'s contiguous byte runs;
    None if its innermost runs are shorter than `MIN_RUN_BYTES`."""
    dims = [(n, s, d) for n, s, d in zip(fill.sizes, fill.src_strides, fill.dst_strides,
                                         strict=True) if n != 1]
    run, k = fill.itemsize, len(dims)
    while k and dims[k - 1][1] * fill.itemsize == run == dims[k - 1][2] * fill.itemsize:
        run *= dims[k - 1][0]
        k -= 1
    if k and run < MIN_RUN_BYTES:
        return None
    if not k:
        return np.array([fill.src_offset]), np.array([fill.dst_offset]), run
    grid = np.indices([n for n, _, _ in dims[:k]], dtype=np.int64).reshape(k, -1)
    src = (np.array([s for _, s, _ in dims[:k]], dtype=np.int64)[:, None] * grid).sum(0)
    dst = (np.array([d for _, _, d in dims[:k]], dtype=np.int64)[:, None] * grid).sum(0)
    return (fill.src_offset + src * fill.itemsize, fill.dst_offset + dst * fill.itemsize, run)


def tiles_exactly(dst_offsets: np.ndarray, lengths: np.ndarray, loadable: int) -> bool:
    """Whether runs at `dst_offsets` cover `loadable` bytes with no byte written twice."""
    order = np.argsort(dst_offsets, kind="stable")
    starts, ends = dst_offsets[order], dst_offsets[order] + lengths[order]
    return int(lengths.sum()) == loadable and bool(np.all(starts[1:] >= ends[:-1]))


def byte_span(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` of `first`'s storage from its first byte, as a uint8 tensor (a bucket's bytes
    from its first received tensor on)."""
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), first.storage_offset() * first.itemsize, (nbytes,))


class BucketCopy:
    """One bucket's byte runs: source offsets from its first tensor, destination (index into
    the caller's base addresses) and offset, length. `run` copies them all: one native
    memcpy loop on CPU, one scatter launch per copy unit on CUDA (`BufferKernel`)."""

    def __init__(self, src: np.ndarray, dest: np.ndarray, dst: np.ndarray,
                 nbytes: np.ndarray) -> None:
        self.src, self.dest, self.dst, self.nbytes = src, dest, dst, nbytes
        self._kernels: tuple[int, list] | None = None  # (source address, per unit) on CUDA

    def __len__(self) -> int:
        return len(self.nbytes)

    def run(self, first: torch.Tensor, bases: np.ndarray) -> None:
        """Copy from the bucket whose first received tensor is `first` into the
        destinations at `bases` (their current addresses)."""
        if not len(self):
            return
        dst = bases[self.dest] + self.dst
        if first.device.type != "cuda":
            native.load().copy_bytes(torch.from_numpy(first.data_ptr() + self.src),
                                     torch.from_numpy(dst), torch.from_numpy(self.nbytes))
            return
        for kernel, idx in self._cuda_kernels(first):
            table = dst[idx]
            bits = int(np.bitwise_or.reduce(table))
            if bits % kernel.unit:
                raise RuntimeError(f"a destination of the direct apply is not aligned to its "
                                   f"{kernel.unit}-byte copy unit (address bits {bits:#x})")
            kernel.run(table, bits)

    def _cuda_kernels(self, first: torch.Tensor) -> list:
        """Scatter kernels over the bucket's bytes, one per copy unit (built on first use;
        rebuilt when the bucket arrives elsewhere: an oversize tensor has its own memory)."""
        if self._kernels is None or self._kernels[0] != first.data_ptr():
            raw = byte_span(first, int((self.src + self.nbytes).max()))
            units = np.gcd(np.gcd(np.gcd(self.src, self.dst), self.nbytes), 8)
            kernels = []
            for unit in np.unique(units)[::-1]:
                idx = np.flatnonzero(units == unit)
                kernels.append((BufferKernel(raw, int(unit), self.src[idx].tolist(),
                                             self.nbytes[idx].tolist(), scatter=True), idx))
            self._kernels = (first.data_ptr(), kernels)
        return self._kernels[1]
