"""FP8 buckets quantized straight into the sender's frame: one pass over the bf16 bytes.

Quantizing into buffers of the source's own and then packing those into the frame reads and
writes the e4m3 bytes a second time. A bucket whose inner tensors the native scan found (all
contiguous on one GPU, the kernel able to take every target) goes to the sender as a
`PreparedBucket` with a `fill`: when the sender packs the frame it hands over the frame's slot
addresses and the frame header's status word, and one launch per shape writes each target's
e4m3 values and scales into their slots (a scale whose slot is in a later bucket into a tensor
of the source's, which that bucket packs by address). The pack kernel copies the rest. The
launches are kept per bucket from one refit to the next (`FillState`): where the addresses stay
put (a dict's tensors, the frames' slots) their table is uploaded once and they replay as a
CUDA graph, so a bucket's fill costs the host one replay, not a Triton launch per shape.

A non-finite weight cannot be refused before its bytes are in the frame without waiting for
the device, so the kernel marks it: the header's status becomes NONFINITE (receivers load
nothing of that frame and stop loading), and the refit's flag word for the bucket names the
tensor; the sender reads the flags once, after its last frame, and fails the refit on every
rank naming it. Any other path to the frame (a delta or compact frame, a direct bucket)
takes `views()`: the tensors quantized into buffers of their own and checked first.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from common.kernels import fp8_kernel
from common.quant.fp8_batch import launchable, marked_tensor, marks_rows, quantize_batch
from common.quant.fp8_blocks import BlockFp8Format
from common.source import PreparedBucket, StagedFill


class FillFlags:
    """One int64 word per bucket of a refit, set by a non-finite block of its fill. Read
    back once per set of fills launched (a read waits for the stream): the sender checks
    every frame after its last. Zeroed (`reset`) when a refit's first fill comes."""

    def __init__(self, buckets: int, device: torch.device) -> None:
        self.words = torch.zeros(buckets, dtype=torch.int64, device=device)
        self.launched = 0  # fills so far
        self._host: tuple[int, np.ndarray] | None = None  # (fills then, the words)

    def reset(self) -> None:
        """A refit starts: every word 0 again (behind the last refit's fills, on the stream)."""
        self.words.zero_()
        self.launched, self._host = 0, None

    def address(self, bucket: int) -> int:
        return self.words.data_ptr() + 8 * bucket

    def marked(self, bucket: int) -> int:
        if self._host is None or self._host[0] != self.launched:
            self._host = (self.launched, self.words.cpu().numpy())
        return int(self._host[1][bucket])


class FillState:
    """What an FP8 source's fills keep from one refit to the next (one per plan and device),
    so that a bucket's addresses stay put: the flags, the scales sent with a later bucket than
    their weight's, and each bucket's launches (`fp8_kernel.QuantizeLaunches`: a table uploaded
    once, launches replayed as a CUDA graph)."""

    def __init__(self, buckets: int, device: torch.device) -> None:
        self.flags = FillFlags(buckets, device)
        self._later: dict[str, torch.Tensor] = {}
        self._launches: dict[int, fp8_kernel.QuantizeLaunches] = {}

    def later_scale(self, name: str, shape: tuple[int, int],
                    device: torch.device) -> torch.Tensor:
        """Scale `name`'s tensor (the fill writes it, a later bucket sends it)."""
        if (s := self._later.get(name)) is None or s.shape != shape or s.device != device:
            s = self._later[name] = torch.empty(shape, dtype=torch.float32, device=device)
        return s

    def launches(self, bucket: int, targets: list, groups: list[list[int]],
                 fmt: BlockFp8Format) -> fp8_kernel.QuantizeLaunches:
        """Bucket `bucket`'s launches, one per group of `targets` (made on its first fill)."""
        if (known := self._launches.get(bucket)) is None:
            known = self._launches[bucket] = fp8_kernel.QuantizeLaunches(
                [fp8_kernel.like(targets[g[0]]) for g in groups], list(map(len, groups)),
                fmt.block, fmt.ue8m0)
        return known


def fillable(targets: list[torch.Tensor], groups, fmt: BlockFp8Format) -> bool:
    """Whether the kernel takes every group of the bucket's targets (each group's tensors
    share a shape and dtype: the plan's groups, the native scan checked them)."""
    return bool(targets) and all(launchable(targets[g[0]], fmt) for g in groups)


def fill_bucket(layout, tensors: list, targets: list, inner_at: np.ndarray, scales: dict,
                state: FillState, bucket: int, fmt: BlockFp8Format,
                held: bool) -> PreparedBucket | None:
    """The bucket (`layout`: its `Fp8Layout`; `tensors`: its inner tensors, `targets` the FP8
    ones among them, `inner_at` their addresses; `held`: they outlive the send, a dict's) as
    a `PreparedBucket` the sender fills; None
    when a scale of an earlier bucket's target is not a tensor (its items then say why).
    Takes that bucket's scales out of `scales` and puts this one's later scales (tensors the
    fill writes, kept in `state`) in."""
    a = layout.addressing
    carried = [scales.get(n) for _, n in a.carried_in]
    if not all(isinstance(c, torch.Tensor) for c in carried):
        return None
    for _, n in a.carried_in:
        del scales[n]
    device = targets[0].device
    later = {}  # target -> the tensor its scale goes to (sent with a later bucket)
    for t, n in a.carried_out:
        later[t] = scales[n] = state.later_scale(n, fmt.scale_shape(targets[t].shape), device)
    ptrs = bucket_addresses(layout, inner_at, carried)
    groups, order = a.groups, a.order  # made once per plan: no Python per weight here
    flags = state.flags

    def tables(slots: np.ndarray, mark: tuple[int, int]) -> tuple:
        """The launches' addresses (inputs, values, scales) and marks for the frame's slots
        (counted as a fill launched: the flags are read afresh after it)."""
        s_at = np.empty(len(targets), np.int64)
        s_at[a.scale_target] = slots[a.scale_pos]
        for t, s in later.items():
            s_at[t] = s.data_ptr()
        flags.launched += 1
        return ((inner_at[a.order_inner], slots[a.order_pos], s_at[order]),
                marks_rows(len(groups), (flags.address(bucket), *mark)))

    def check() -> str | None:  # no per-refit list held: the next refit frees none
        return _why(layout, marked_tensor(groups, flags.marked(bucket)))

    def fill(slots: np.ndarray, mark: tuple[int, int]) -> Callable[[], str | None]:
        state.launches(bucket, targets, groups, fmt).run(*tables(slots, mark))
        return check

    def stage_fill(slots: np.ndarray, mark: tuple[int, int]) -> StagedFill:
        launches = state.launches(bucket, targets, groups, fmt)
        key = launches.stage(*tables(slots, mark))
        return StagedFill(key, (lambda: launches.launch(key)) if launches.compiled(key)
                          else None, check)

    def views() -> list[torch.Tensor]:
        named = [(layout.names[k], x) for (k, _), x in zip(layout.targets, targets, strict=True)]
        results = quantize_batch(named, fmt, groups, inner_at[a.target_inner])
        for result in results:
            if not isinstance(result, tuple):
                raise ValueError(result)  # names the tensor
        for t, s in later.items():
            s.copy_(results[t][1])
        return bucket_tensors(layout, tensors, results, carried)

    return PreparedBucket(layout.names, ptrs, views, device, (tensors, carried, later), fill,
                          a.filled,
                          stage_fill if device.type == "cuda" else None, held)


def bucket_addresses(layout, inner_at: np.ndarray, carried: list) -> np.ndarray:
    """A bucket's addresses by slot: its inner tensors' (`inner_at`) and the scales carried
    from earlier buckets'; 0 in the targets' and their scales' slots (the caller's)."""
    a = layout.addressing
    ptrs = np.zeros(len(layout.names), np.int64)
    ptrs[a.inner_pos] = inner_at
    for (k, _), c in zip(a.carried_in, carried, strict=True):
        ptrs[k] = c.data_ptr()
    return ptrs


def bucket_tensors(layout, tensors: list, results: list, carried: list) -> list[torch.Tensor]:
    """A bucket's tensors by slot: its inner tensors (`tensors`), each target's (e4m3,
    scales) from `results`, the scales carried from earlier buckets."""
    a, out = layout.addressing, [None] * len(layout.names)
    for k, tensor in zip(layout.inner, tensors, strict=True):
        out[k] = tensor
    for k, (q, _) in zip(a.target_pos.tolist(), results, strict=True):
        out[k] = q
    for k, t in zip(a.scale_pos.tolist(), a.scale_target.tolist(), strict=True):
        out[k] = results[t][1]
    for (k, _), c in zip(a.carried_in, carried, strict=True):
        out[k] = c
    return out


def _why(layout, marked: int | None) -> str | None:
    """Target `marked` (an index into the layout's targets) named, or None."""
    if marked is None:
        return None
    name = layout.names[layout.targets[marked][0]]
    return (f"{name!r} has NaN or inf values: it cannot be quantized to FP8 (its frame went "
            "with a NONFINITE status: no receiver loaded it)")
