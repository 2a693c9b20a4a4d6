"""Check one bucket's tensors from a weight source against the plan (names, dtypes, shapes).

The check runs per bucket, not per tensor: a Python loop over 20,000 MoE tensors costs more
than their broadcast on NVLink. One native pass over the bucket's (name, tensor) items
(`native.BucketScan`, which also collects the addresses for the pack kernel; from a dict
source's `MappingItems` it looks the bucket's names up itself, no item made per tensor), else
whole-list comparisons; only a bucket that fails them goes through the per-tensor path that
names the first mismatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from operator import attrgetter, itemgetter

import numpy as np
import torch

from common.errors import RefitError, TensorMismatchError
from common.kernels import native
from common.plan import Bucket, RefitPlan, TensorSpec, dtype_name
from common.source import MappingItems, PreparedBucket, RefusedTensor

_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_NAME, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("dtype"), attrgetter("shape")


def check_tensor(spec: TensorSpec, name: str, tensor: torch.Tensor | None) -> str | None:
    """Why `tensor` cannot be sent as `spec`, or None."""
    if name != spec.name:
        return f"weight source yielded {name!r} where the plan expects {spec.name!r}"
    if tensor is None:
        return f"{spec.name!r}: no tensor on its source rank {spec.source_rank}"
    if isinstance(tensor, RefusedTensor):
        return f"{spec.name!r}: {tensor.reason}"
    if tuple(tensor.shape) != spec.shape:
        return f"{spec.name!r}: shape {list(tensor.shape)} but the plan says {list(spec.shape)}"
    if tensor.dtype != spec.dtype:
        return (f"{spec.name!r}: dtype {dtype_name(tensor.dtype)} but the plan says "
                f"{dtype_name(spec.dtype)} (the plan holds the declared output dtype; convert "
                f"before yielding)")
    return None


class BucketChecker:
    """Per training rank: the expected names, dtypes and shapes of the buckets it sends."""

    def __init__(self, plan: RefitPlan, rank: int, device: torch.device, label: str,
                 use_native: bool = True) -> None:
        self.plan, self.rank, self.label, self.device = plan, rank, label, device
        mine = [b for b in plan.buckets if b.source_rank == rank]
        module = native.load() if use_native else None
        self.scans = {} if module is None else {
            b.index: native.BucketScan(module, plan.bucket_specs(b), device) for b in mine}
        self._names: dict[int, tuple[str, ...]] = {}
        # whether the last bucket taken came from a dict that keeps its tensors alive (a
        # source's own copies are freed once the sender drops them)
        self.held = False
        self.expected = {  # for the Python path
            b.index: tuple(list(map(f, plan.bucket_specs(b))) for f in (_NAME, _DTYPE, _SHAPE))
            for b in mine if b.index not in self.scans
        }

    def take(self, it: Iterator, bucket: Bucket,
             version: int) -> tuple[list, np.ndarray | None]:
        """The bucket's tensors (none on a rank that does not send it), checked against the
        plan, and their addresses when the native scan collected them. (The bucket's specs
        are sliced only where the items are checked one by one: a slice touches every spec
        object, a cache miss each after a training step.)"""
        count = bucket.stop - bucket.start
        if isinstance(it, MappingItems) and it.position == bucket.start:
            if self.rank != bucket.source_rank:
                it.advance(count)
                return [], None
            if (scan := self.scans.get(bucket.index)) is not None:
                tensors, ptrs = scan.take_mapping(it.mapping)
                if tensors is not None:
                    it.advance(count)
                    self.held = True
                    return tensors, ptrs
        self.held = False
        first = next(it, None)
        if isinstance(first, PreparedBucket):
            return self._prepared(first, bucket, version)
        items = [first, *itertools.islice(it, count - 1)] if first is not None else []
        if len(items) < count:
            missing = self.plan.specs[bucket.start + len(items)]
            raise RefitError(f"weight source ended at {missing.name!r} (tensor "
                             f"#{bucket.start + len(items)}); the plan has {len(self.plan.specs)}")
        if self.rank != bucket.source_rank:
            return [], None  # not needed here: free them before this rank's buffer fills
        if scan := self.scans.get(bucket.index):
            tensors, ptrs = scan.take(items)
            if tensors is not None:
                return tensors, ptrs
        elif self._same(bucket, items):
            return list(map(_SECOND, items)), None
        specs = self.plan.bucket_specs(bucket)
        for i, (spec, (name, tensor)) in enumerate(zip(specs, items, strict=True)):
            if why := check_tensor(spec, name, tensor):
                raise TensorMismatchError(f"{self.label}: refit v{version} bucket "
                                          f"{bucket.index} tensor #{bucket.start + i} {why}")
        return list(map(_SECOND, items)), None  # a mismatch only the native scan saw

    def _prepared(self, prepared: PreparedBucket, bucket: Bucket,
                  version: int) -> tuple[Sequence[torch.Tensor], np.ndarray | None]:
        """A bucket its source checked (`PreparedBucket`): its names must be the plan's."""
        if prepared.names != self.names(bucket):
            raise RefitError(f"{self.label}: refit v{version} bucket {bucket.index}: the "
                             f"weight source prepared {len(prepared.names)} tensors from "
                             f"{prepared.names[:1]}; the plan has {len(self.names(bucket))} "
                             f"from {self.names(bucket)[:1]}")
        if self.rank != bucket.source_rank:
            return [], None
        # the group's device has its index, as a tensor's has; elsewhere the pack moves them.
        # A bucket the source fills has only its other slots' addresses: the sender asks the
        # tensors (`LazyTensors.prepared`) whether it may fill the frame.
        mine = prepared.device == self.device and prepared.fill is None
        return LazyTensors(prepared), prepared.ptrs if mine else None

    def names(self, bucket: Bucket) -> tuple[str, ...]:
        """The bucket's planned names (a tuple, compared as one)."""
        if (known := self._names.get(bucket.index)) is None:
            known = self._names[bucket.index] = tuple(map(_NAME, self.plan.bucket_specs(bucket)))
        return known

    def _same(self, bucket: Bucket, items: list) -> bool:
        """Whole-list comparisons: C-level `map`s, no Python bytecode per tensor."""
        names, dtypes, shapes = self.expected[bucket.index]
        if list(map(_FIRST, items)) != names:
            return False
        tensors = list(map(_SECOND, items))
        try:
            return list(map(_DTYPE, tensors)) == dtypes and list(map(_SHAPE, tensors)) == shapes
        except AttributeError:  # a None (or not-a-tensor) item: the per-tensor path names it
            return False


class LazyTensors(Sequence):
    """A `PreparedBucket`'s tensors, made on first use only (the pack kernel takes the
    addresses; a compact frame or a fallback pack takes the tensors)."""

    def __init__(self, prepared: PreparedBucket) -> None:
        self.prepared, self._made = prepared, None

    def __len__(self) -> int:
        return len(self.prepared.names)

    def __getitem__(self, i):
        if self._made is None:
            self._made = self.prepared.views()
        return self._made[i]
