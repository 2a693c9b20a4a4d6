"""Pack a bucket's tensors into one flat uint8 buffer and unpack typed zero-copy views.

Packing is batched, never a Python loop of `copy_` (per-tensor copies of many small tensors
run at a small fraction of the memory bandwidth): on CUDA with Triton one launch per copy unit
over a pointer table (`pack_kernel`); on CPU, when the sender's native scan has the addresses, one
C++ loop of memcpy, else one `torch.cat` per run of adjacent slots of one dtype; otherwise (and
for what is left) one `torch._foreach_copy_` per dtype. A bucket's place in its buffer never
changes, so its destination views and chunk tables are built once (`BucketLayout`) and reused
by every refit: building 20,000 views per refit costs more than the copy itself. Per-tensor
Python work on the hot path is kept to a few attribute reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from common.kernels import native
from common.kernels.pack_kernel import BufferKernel, kernel_available
from common.plan import TensorSpec
from common.source import PreparedBucket


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous, non-empty tensor's bytes as a flat uint8 view (0-d included); a lazy
    negation or conjugation is applied first (a copy) so the bytes hold the values."""
    return tensor.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


class BucketLayout:
    """One bucket's tensors at their offsets in a uint8 buffer (the payload region).

    Aligned slots get a typed view made once; `unpack` returns them (zero-copy). A slot left
    misaligned by a plan alignment smaller than the element size is packed as bytes and
    unpacked into a copy.
    """

    def __init__(
        self, buffer: torch.Tensor, specs: Sequence[TensorSpec], offsets: Sequence[int]
    ) -> None:
        self.buffer, self.specs, self.offsets = buffer, tuple(specs), tuple(offsets)
        views: list[torch.Tensor | None] = []
        groups: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        self.misaligned: list[int] = []
        base = buffer.data_ptr()
        for i, (spec, offset) in enumerate(zip(self.specs, self.offsets, strict=True)):
            if spec.nbytes == 0:
                views.append(torch.empty(spec.shape, dtype=spec.dtype, device=buffer.device))
            elif (base + offset) % spec.dtype.itemsize == 0:
                view = buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)
                views.append(view)
                idx, dsts = groups.setdefault(spec.dtype, ([], []))
                idx.append(i)
                dsts.append(view)
            else:
                views.append(None)
                self.misaligned.append(i)
        self.views = views
        # the pack kernels, built by the first pack (or `warm`): a layout that only unpacks
        # (every receiver's) never pays their tables, pinned staging and events
        self._built_kernels: list[tuple[np.ndarray | None, BufferKernel]] | None = None
        # CPU: runs of back-to-back slots of one dtype are packed by one `torch.cat` each
        self.runs = self._runs() if buffer.device.type == "cpu" else []
        in_runs = {i for lo, hi, _ in self.runs for i in range(lo, hi)}
        # (indices or None for "all of them, in order", destination views) per dtype
        everything = list(range(len(self.specs)))
        self.groups = []
        for idx, dsts in groups.values():
            keep = [k for k, i in enumerate(idx) if i not in in_runs]
            if keep:
                idx, dsts = [idx[k] for k in keep], [dsts[k] for k in keep]
                self.groups.append((None if idx == everything else idx, dsts))
        self.device_index = buffer.get_device()
        self._cpu_table: tuple[torch.Tensor, torch.Tensor] | None = None  # copy_bytes' tables
        self._unpacked: list[tuple[str, torch.Tensor]] | None = None
        self._offsets = np.array(self.offsets, dtype=np.int64)
        self._others: dict[bytes, tuple] = {}  # `fill`'s other slots and their kernels
        self._last_other: tuple[np.ndarray, tuple] | None = None  # (filled, its entry)

    @property
    def kernels(self) -> list[tuple[np.ndarray | None, BufferKernel]]:
        """One pointer-table kernel per copy unit (the widest of 8/4/2/1 bytes that fits);
        none without Triton on CUDA."""
        if self._built_kernels is None:
            self._built_kernels = (self._kernels(self.buffer.data_ptr())
                                   if kernel_available(self.buffer.device) else [])
        return self._built_kernels

    def _kernels(self, base: int, among: Sequence[int] | None = None,
                 ) -> list[tuple[np.ndarray | None, BufferKernel]]:
        """The kernels of every slot, or of the slots `among`."""
        by_unit: dict[int, list[int]] = {}
        for i in range(len(self.specs)) if among is None else among:
            if self.views[i] is not None and self.specs[i].nbytes:
                unit = math.gcd(8, base + self.offsets[i], self.specs[i].nbytes)
                by_unit.setdefault(unit, []).append(i)
        everything = list(range(len(self.specs)))
        return [
            (None if idx == everything else np.array(idx, dtype=np.int64),
             BufferKernel(self.buffer, unit, [self.offsets[i] for i in idx],
                        [self.specs[i].nbytes for i in idx]))
            for unit, idx in sorted(by_unit.items(), reverse=True)
        ]

    def _runs(self) -> list[tuple[int, int, torch.Tensor]]:
        """(first, end, typed destination) per run of 2+ adjacent aligned slots of one dtype.

        On CPU `torch._foreach_copy_` is a loop of `copy_` (a dispatch per tensor); `torch.cat`
        into the run's bytes is one call with a memcpy per input.
        """
        runs, lo = [], 0
        n = len(self.specs)
        for i in range(1, n + 1):
            if i < n and self._adjacent(i - 1, i):
                continue
            if i - lo >= 2:
                start, stop = self.offsets[lo], self.offsets[i - 1] + self.specs[i - 1].nbytes
                runs.append((lo, i, self.buffer[start:stop].view(self.specs[lo].dtype)))
            lo = i
        return runs

    def _adjacent(self, i: int, j: int) -> bool:
        a, b = self.specs[i], self.specs[j]
        return (a.dtype == b.dtype and a.nbytes > 0 and b.nbytes > 0
                and self.views[i] is not None and self.views[j] is not None
                and self.offsets[i] + a.nbytes == self.offsets[j])

    def pack(self, tensors: Sequence[torch.Tensor], ptrs: np.ndarray | None = None) -> None:
        """Copy `tensors` (already checked against the specs) into the buffer. `ptrs`: their
        addresses, given only when every tensor is known to be contiguous on this device
        (`native.BucketScan`); otherwise they are read and checked here."""
        if ptrs is not None and self.device_index < 0 and (module := native.load()):
            if self._cpu_table is None:  # built on the sender's first pack; receivers never
                base = self.buffer.data_ptr()
                self._cpu_table = (
                    torch.tensor([base + o for o in self.offsets], dtype=torch.int64),
                    torch.tensor([s.nbytes for s in self.specs], dtype=torch.int64))
            module.copy_bytes(torch.from_numpy(ptrs), *self._cpu_table)
            return
        for lo, hi, out in self.runs:
            torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors[lo:hi]], out=out)
        if not self._pack_kernel(tensors, ptrs):
            for idx, dsts in self.groups:
                srcs = tensors if idx is None else [tensors[i] for i in idx]
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for i in self.misaligned:
            o, n = self.offsets[i], self.specs[i].nbytes
            self.buffer[o : o + n].copy_(byte_view(tensors[i].contiguous()), non_blocking=True)

    def _pack_kernel(self, tensors: Sequence[torch.Tensor], ptrs: np.ndarray | None) -> bool:
        """Pack every aligned slot with the one-launch kernels; False: use the foreach copy.

        The checks and the pointer table are C-level `map`s and numpy: at tens of thousands of
        tensors per plan each Python bytecode per tensor shows up against the kernel's time.
        """
        if not self.kernels:
            return False
        if ptrs is None:
            if (set(map(torch.Tensor.get_device, tensors)) != {self.device_index}
                    or not all(map(torch.Tensor.is_contiguous, tensors))
                    or any(map(torch.Tensor.is_neg, tensors))  # lazy sign: raw bytes differ
                    or any(map(torch.Tensor.is_conj, tensors))):
                return False
            ptrs = np.fromiter(map(torch.Tensor.data_ptr, tensors), np.int64, len(tensors))
        if (tables := kernel_tables(self.kernels, ptrs)) is None:
            return False  # a source not aligned to its slot's copy unit
        for kernel, table, bits in tables:
            kernel.run(table, bits)
        return True

    def fill(self, prepared: PreparedBucket,
             mark: tuple[int, int]) -> Callable[[], str | None] | None:
        """Let `prepared` write its `filled` slots itself (`PreparedBucket.fill`, given the
        slots' addresses and `mark`: the frame header's status word and the value that says
        its bytes are wrong) and copy the others from `prepared.ptrs` (the pack kernel on
        CUDA, the native memcpy loop on CPU); its check, or None where this layout cannot (a
        misaligned slot, no kernel or native module, a source not aligned to its copy unit):
        pack its tensors instead."""
        if self.misaligned:
            return None
        slots = self.slot_addresses()
        if self.device_index < 0:
            if (module := native.load()) is None:
                return None
            rest, _, sizes = self._other_slots(prepared.filled)
            check = prepared.fill(slots, mark)
            module.copy_bytes(*map(torch.from_numpy, (prepared.ptrs[rest], slots[rest], sizes)))
            return check
        if (tables := self.other_tables(prepared)) is None:
            return None
        check = prepared.fill(slots, mark)
        for kernel, table, bits in tables:
            kernel.run(table, bits)
        return check

    def other_tables(self, prepared: PreparedBucket) -> list | None:
        """On CUDA, the pack kernels of the slots `prepared` does not fill, with their tables
        (`kernel_tables`); None where they cannot take them (no kernel, a misaligned slot or
        source)."""
        if self.misaligned or not self.kernels:
            return None
        return kernel_tables(self._other_slots(prepared.filled)[1], prepared.ptrs)

    def slot_addresses(self) -> np.ndarray:
        """Each slot's address in the buffer."""
        return self.buffer.data_ptr() + self._offsets

    def _other_slots(self, filled: np.ndarray) -> tuple[np.ndarray, list, np.ndarray]:
        """The non-empty slots not in `filled`, their pack kernels (CUDA) and sizes, made
        once per set of filled slots (a source that passes the same `filled` array each refit
        skips hashing its bytes)."""
        if self._last_other is not None and self._last_other[0] is filled:
            return self._last_other[1]
        key = filled.tobytes()
        if (known := self._others.get(key)) is None:
            rest = np.setdiff1d(np.arange(len(self.specs)), filled)
            rest = rest[[self.specs[i].nbytes > 0 for i in rest.tolist()]]
            kernels = self._kernels(self.buffer.data_ptr(), rest.tolist()) if self.kernels \
                else []
            sizes = np.array([self.specs[i].nbytes for i in rest.tolist()], dtype=np.int64)
            known = self._others[key] = (rest, kernels, sizes)
        self._last_other = (filled, known)
        return known

    def release(self) -> None:
        """Destroy the graphs of this bucket's pack kernels (the endpoint is being replaced)."""
        for _, kernel in [*(self._built_kernels or []),
                          *(k for _, ks, _ in self._others.values() for k in ks)]:
            kernel.release()

    def warm(self) -> None:
        """Compile and capture this bucket's pack kernels (CUDA) before the first refit needs
        them: ~1 s of Triton compiling and graph capture otherwise lands in that refit."""
        for _, kernel in self.kernels:
            kernel.warm()

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) per spec; views alias the buffer and are valid until it is reused."""
        if not self.misaligned:
            if self._unpacked is None:
                self._unpacked = [(s.name, v) for s, v in zip(self.specs, self.views, strict=True)]
            return list(self._unpacked)
        out = []
        for spec, offset, view in zip(self.specs, self.offsets, self.views, strict=True):
            if view is None:  # misaligned: copy the bytes into an aligned tensor
                raw = self.buffer[offset : offset + spec.nbytes].clone()
                view = raw.view(spec.dtype).view(spec.shape)
            out.append((spec.name, view))
        return out


def kernel_tables(kernels: Sequence[tuple[np.ndarray | None, BufferKernel]],
                  ptrs: np.ndarray) -> list[tuple[BufferKernel, np.ndarray, int]] | None:
    """Per pointer-table kernel (its slots' indices or None for all, the kernel): the
    kernel, its sources' addresses out of `ptrs` and their bitwise or (its low bits: their
    alignment); None when a source is not aligned to its kernel's copy unit."""
    tables = []
    for idx, kernel in kernels:
        table = ptrs if idx is None else ptrs[idx]
        bits = int(np.bitwise_or.reduce(table)) if len(table) else 0
        if bits % kernel.unit:
            return None
        tables.append((kernel, table, bits))
    return tables


def first_differing(specs: Sequence[TensorSpec], offsets: Sequence[int], a: torch.Tensor,
                    b: torch.Tensor) -> int | None:
    """The position of the first tensor of a packed payload (`specs` at `offsets`) whose bytes
    differ between `a` and `b`, or None; the alignment padding between tensors is not
    compared (it holds whatever the buffer held before: another bucket's bytes)."""
    at = (a.to(b.device) != b).nonzero().flatten().cpu().numpy()
    starts = np.asarray(offsets, dtype=np.int64)
    slot = np.searchsorted(starts, at, side="right") - 1
    inside = (slot >= 0) & (at < (starts + [s.nbytes for s in specs])[np.maximum(slot, 0)])
    return int(slot[inside][0]) if inside.any() else None


def pack(
    buffer: torch.Tensor,
    specs: Sequence[TensorSpec],
    offsets: Sequence[int],
    tensors: Sequence[torch.Tensor],
) -> None:
    """One-off pack of `tensors` into `buffer` at `offsets` (see `BucketLayout` to reuse views)."""
    BucketLayout(buffer, specs, offsets).pack(tensors)


def unpack(
    buffer: torch.Tensor, specs: Sequence[TensorSpec], offsets: Sequence[int]
) -> list[tuple[str, torch.Tensor]]:
    """One-off unpack of (name, typed view) per spec from `buffer`."""
    return BucketLayout(buffer, specs, offsets).unpack()
