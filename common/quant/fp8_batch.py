"""Block-FP8 quantization of many tensors at once: on CUDA one Triton launch per shape
(`common.kernels.fp8_kernel`), from and to addresses in one uploaded table, every non-finite
block marking a flag (and, for a frame, its header's status) without a host wait; elsewhere
`fp8_blocks.quantize` one by one. `Fp8Source` (`fp8_plan`) launches a bucket's targets here,
into buffers of its own (`start_batch`) or straight into the sender's frame
(`launch_into`, from `fp8_fill`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import torch

from common.kernels import fp8_kernel
from common.quant.fp8_blocks import (
    INPUT_DTYPES,
    BlockFp8Format,
    nonfinite_summary,
    quantize,
)

# what one launch needs its tensors to share
_SAME = (attrgetter("shape"), attrgetter("dtype"), torch.Tensor.stride, attrgetter("device"))


def quantize_batch(named: list[tuple[str, torch.Tensor | None]], fmt: BlockFp8Format,
                   groups: Sequence[Sequence[int]] | None = None,
                   addresses: np.ndarray | None = None,
                   ) -> list[tuple[torch.Tensor, torch.Tensor] | str | None]:
    """`quantize` of each (name, tensor), bit for bit the same, or why it cannot be (a
    string naming the tensor); None for a None tensor (not held here): `start_batch`, then
    its results."""
    return start_batch(named, fmt, groups, addresses).results()


def start_batch(named: list[tuple[str, torch.Tensor | None]], fmt: BlockFp8Format,
                groups: Sequence[Sequence[int]] | None = None,
                addresses: np.ndarray | None = None) -> Fp8Batch:
    """Launch `quantize` of each (name, tensor). On CUDA the tensors of one shape, dtype and
    strides go in one launch (`fp8_kernel.launch`), their scales into one buffer whose
    non-finite check is read back when the results are asked for (no wait for the device
    here); elsewhere one by one, now. `groups`: disjoint positions expected to share a shape
    and dtype (a plan's), checked here; found tensor by tensor when not given. `addresses`: every
    tensor's address, from a caller that found them all contiguous on one device with the
    shapes and dtypes `groups` assume (the native bucket scan); the groups are then taken as
    they are."""
    out: list = [None] * len(named)
    if groups is not None and addresses is not None:
        groups = [list(idx) for idx in groups if idx and launchable(named[idx[0]][1], fmt)]
    else:
        addresses = None
        groups = _kernel_groups(named, groups if groups is not None else [range(len(named))],
                                fmt)
    done, finite, at = (_launch_groups(named, groups, fmt, addresses) if groups else
                        ([], None, (np.empty(len(named), np.int64),
                                    np.empty(len(named), np.int64))))
    rest = [] if sum(map(len, groups)) == len(named) else sorted(  # the groups are disjoint
        set(range(len(named))) - set(itertools.chain.from_iterable(groups)))
    for i in rest:
        name, x = named[i]  # the rest (none, when the plan's groups held): one by one
        if x is not None:
            try:
                out[i] = quantize(name, x, fmt)
            except ValueError as e:
                out[i] = str(e)
    return Fp8Batch(named, out, done, finite, at)


class Fp8Batch:
    """A launched batch: `results()` waits for its launches (on CUDA an event, then the
    one-byte non-finite flag already copied to the host) and gives, per tensor, what
    `quantize` would: (e4m3, scale_inv), why not (naming it), or None (not held here)."""

    def __init__(self, named: list, out: list, done: list, finite: _FiniteFlag | None,
                 at: tuple[np.ndarray, np.ndarray]) -> None:
        self._named, self._out, self._done, self._finite = named, out, done, finite
        self._at = at  # the launched tensors' e4m3 and scale addresses, by position

    def addresses(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every tensor's e4m3 values' and scales' addresses (in the batch's order) when all
        were quantized (held here, every scale finite; waits for the launches): a bucket can
        go to the sender by address, no tensor per weight. None otherwise (`results` says
        why). Call before `results`."""
        n, (q_at, s_at) = len(self._named), self._at
        if self._done and not self._finite.value():
            return None
        if sum(len(idx) for idx, _, _ in self._done) < n:  # some one by one (no kernel)
            launched = {i for idx, _, _ in self._done for i in idx}
            for i, result in enumerate(self._out):
                if i not in launched:
                    if not isinstance(result, tuple):  # not held here, or why not
                        return None
                    q_at[i], s_at[i] = result[0].data_ptr(), result[1].data_ptr()
        return q_at, s_at

    def scale(self, i: int) -> torch.Tensor:
        """Tensor `i`'s scales (for a scale sent after its weight's bucket)."""
        for idx, _, s in self._done:
            if i in idx:
                return s[idx.index(i)]
        return self._out[i][1]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The quantized tensors' memory (what a bucket sent by address keeps alive)."""
        launched = sum(len(idx) for idx, _, _ in self._done)
        rest = self._out if launched < len(self._out) else ()  # else all in the launches'
        return (*(t for _, q, s in self._done for t in (q, s)),
                *(t for r in rest if isinstance(r, tuple) for t in r))

    def results(self) -> list[tuple[torch.Tensor, torch.Tensor] | str | None]:
        if self._done:
            finite = self._finite.value()
            for idx, q, s in self._done:
                for i, qi, si in zip(idx, q.unbind(0), s.unbind(0), strict=True):
                    self._out[i] = (qi, si)
                if not finite:  # find the tensors with NaN / inf and say where
                    bad = torch.isfinite(s).flatten(1).all(1).tolist()
                    for i, good in zip(idx, bad, strict=True):
                        if not good:
                            name, x = self._named[i]
                            self._out[i] = (f"{name}: {nonfinite_summary(x, 1 << 16)}; "
                                            "cannot quantize to FP8")
            self._done = []
        return self._out


class _FiniteFlag:
    """Whether a batch's flag (set by a non-finite block) stayed 0, read back without waiting
    now: on CUDA copied into pinned host memory behind the stream's work, an event after it."""

    def __init__(self, flag: torch.Tensor) -> None:
        flag = flag[0] == 0
        self._event = None
        if flag.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            flag = host
        self._flag = flag

    def value(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._flag)


def _kernel_groups(named: list, groups: Sequence[Sequence[int]],
                   fmt: BlockFp8Format) -> list[list[int]]:
    """The `groups` the kernel takes in one launch each: same shape, dtype, strides and
    device (C-level comparisons, no Python per tensor); a group that is not is split by its
    tensors' own keys. All on the first group's device."""
    out: list[list[int]] = []
    device = None
    for idx in groups:
        xs = [named[i][1] for i in idx]
        if not xs:
            continue
        if not _uniform(xs):
            if len(xs) > 1:
                out += _kernel_groups(named, _by_key(named, idx), fmt)
            continue
        if launchable(xs[0], fmt) and device in (None, xs[0].device):
            device = xs[0].device
            out.append(list(idx))
    return out


def launchable(x: torch.Tensor, fmt: BlockFp8Format) -> bool:
    """Whether the CUDA kernel quantizes `x` (2-D, bf16 / fp16 / fp32, on a GPU)."""
    return x.dim() == 2 and x.dtype in INPUT_DTYPES and fp8_kernel.available(x, fmt.block)


def _uniform(xs: list) -> bool:
    try:
        return all(len(set(map(key, xs))) == 1 for key in _SAME)
    except (AttributeError, TypeError):  # a None among them (not held here)
        return False


def _by_key(named: list, idx: Sequence[int]) -> list[list[int]]:
    """`idx` split by each tensor's (shape, dtype, strides, device); None tensors left out."""
    groups: dict[tuple, list[int]] = {}
    for i in idx:
        x = named[i][1]
        if isinstance(x, torch.Tensor):
            groups.setdefault(tuple(key(x) for key in _SAME), []).append(i)
    return list(groups.values())


def _launch_groups(named: list, groups: list[list[int]], fmt: BlockFp8Format,
                   addresses: np.ndarray | None,
                   ) -> tuple[list, _FiniteFlag, tuple[np.ndarray, np.ndarray]]:
    """One launch per group into buffers of its own, every scale in one buffer, one flag for
    all that a non-finite block sets: (positions, e4m3 values, scales) per group, the flag,
    and the e4m3 values' and scales' addresses by position. Each group's scales start 16
    bytes aligned (the pack kernel copies 16-byte words from such sources)."""
    device = named[groups[0][0]][1].device
    order = np.fromiter(itertools.chain.from_iterable(groups), np.int64)
    blocks = [fmt.scale_shape(named[idx[0]][1].shape) for idx in groups]
    sizes = [len(idx) * b[0] * b[1] for idx, b in zip(groups, blocks, strict=True)]
    starts = [0, *itertools.accumulate(-(-n // 4) * 4 for n in sizes)]
    scales = torch.empty(starts[-1], dtype=torch.float32, device=device)
    flag = torch.zeros(1, dtype=torch.int64, device=device)
    q_at, s_at = np.empty(len(named), np.int64), np.empty(len(named), np.int64)
    done = []
    for idx, b, size, at in zip(groups, blocks, sizes, starts, strict=False):
        x = named[idx[0]][1]
        q = torch.empty((len(idx), *x.shape), dtype=fmt.dtype, device=device)
        s = scales[at:at + size].view(len(idx), *b)
        step = np.arange(len(idx), dtype=np.int64)
        q_at[idx] = q.data_ptr() + step * x.numel()
        s_at[idx] = s.data_ptr() + step * (b[0] * b[1] * 4)
        done.append((idx, q, s))
    x_at = addresses[order] if addresses is not None else np.fromiter(
        (named[i][1].data_ptr() for i in order.tolist()), np.int64, len(order))
    launch_into(named, groups, fmt, (x_at, q_at[order], s_at[order]),
                (flag.data_ptr(), flag.data_ptr(), 1))
    return done, _FiniteFlag(flag), (q_at, s_at)


def launch_into(named: list, groups: list[list[int]], fmt: BlockFp8Format,
                at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: tuple[int, int, int],
                ) -> None:
    """Quantize each group of `named`'s tensors (same shape, dtype and strides: one launch
    each) from and to the addresses in `at` (inputs, e4m3 values, scales; in the groups'
    order), with one upload of every table. `marks` (flag, status, status value): a
    non-finite block sets the int64 flag to (group + 1) << 32 | the tensor's place in it
    (`marked_tensor`) and the status word to the value; its scales hold NaN or inf."""
    fp8_kernel.launch_groups([named[idx[0]][1] for idx in groups], list(map(len, groups)), at,
                             marks_rows(len(groups), marks), fmt.block, fmt.ue8m0)


def marks_rows(groups: int, marks: tuple[int, int, int]) -> np.ndarray:
    """Each group's marks (`fp8_kernel.launch_table`) from (flag, status, status value): the
    flag set to (group + 1) << 32 | the tensor's place in it, for `marked_tensor`."""
    flag, status, value = marks
    return np.array([[flag, status, (g + 1) << 32, value] for g in range(groups)],
                    dtype=np.int64)


def marked_tensor(groups: list[list[int]], flag: int) -> int | None:
    """The position of a tensor `launch_into` found not finite, from its flag's value (None:
    all finite)."""
    return None if flag == 0 else groups[(flag >> 32) - 1][flag & 0xFFFFFFFF]
