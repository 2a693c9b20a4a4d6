"""The weight-source protocol that the Megatron and DTensor gatherers implement."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from common.dtype_policy import DtypePolicy
from common.plan import RefitPlan, TensorSpec


class RefusedTensor:
    """What a weight source yields in place of a tensor it could not produce (an FP8 weight
    with non-finite values, say): the sender's check turns it into this refit's error, naming
    the tensor and `reason`, while the source keeps yielding the rest (its gathers stay in step
    on every training rank)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"RefusedTensor({self.reason!r})"


@dataclass(frozen=True)
class PreparedBucket:
    """What a source may yield in place of a whole bucket's `len(names)` items: the tensors by
    address, the source having checked them itself (each of its spec's dtype and shape,
    contiguous on `device`), so the sender makes no tensor per item. `views()` makes the
    tensors for the paths that need them (a compact frame, a slot the pack kernel cannot
    take, another device); `keep` holds their memory.

    With `fill`, the source writes the slots in `filled` itself, straight into the frame
    (an FP8 source quantizes into it: no second pass over the bytes), and `ptrs` holds only
    the other slots' addresses: `fill(slot_addresses, (address, value))` launches the writes
    (in stream order) and returns a check to call once the stream's work is done: why the
    filled bytes are wrong (a non-finite weight; it then also wrote the int64 `value` at
    `address`, the frame header's status word, so that no receiver loads them), or None.
    `stage_fill` (on CUDA), the same in two steps for a frame sent as a CUDA graph replay: it
    makes the writes ready for those addresses and returns them as a `StagedFill`; `held`:
    what they read stays alive after the send (a dict's tensors, the source's own scales),
    so such a frame may wait for the next ones and go in one launch with them."""

    names: tuple[str, ...]
    ptrs: np.ndarray  # int64, one per name
    views: Callable[[], list[torch.Tensor]]
    device: torch.device  # where the addresses point
    keep: tuple = ()
    fill: Callable[[np.ndarray, tuple[int, int]], Callable[[], str | None]] | None = None
    filled: np.ndarray | None = None  # the slots `fill` writes
    stage_fill: Callable[[np.ndarray, tuple[int, int]], StagedFill] | None = None
    held: bool = False  # what the writes read outlives the send (a dict's tensors): may wait


class StagedFill(NamedTuple):
    """A fill made ready (`PreparedBucket.stage_fill`): `launch` queues its writes, reading
    what was staged when they run (so a CUDA graph may capture it), or is None until they have
    run once eagerly (compiled); `key` says which captured graph fits (the launches'
    arguments); `check` as `PreparedBucket.fill` returns it."""

    key: tuple
    launch: Callable[[], None] | None
    check: Callable[[], str | None]


def iter_items(it: Iterable) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A source's output as (name, tensor) items, each `PreparedBucket` made into its own
    (for readers of a source other than the sender: tests, tools)."""
    for item in it:
        if isinstance(item, PreparedBucket):
            yield from zip(item.names, item.views(), strict=True)
        else:
            yield item


@runtime_checkable
class WeightSource(Protocol):
    """Where the sender gets full, converted tensors from.

    `plan_specs()` lists every tensor (name, global shape, declared output dtype, source rank)
    from metadata alone, identically on every training rank. `iter_tensors(plan)` yields one
    `(name, tensor)` per plan spec in plan order on every training rank, running whatever
    collectives (gathers) it needs there; on a rank that is not a spec's source the tensor may
    be None. The sender drains the iterator even after an error, so those collectives stay in
    the same order on every rank. A yielded tensor must keep its values while the sender holds
    it, the next bucket's tensors taken meanwhile (an FP8 refit reads a bucket after taking the
    next): a source must not write the next tensors into the memory of earlier ones. In place
    of a bucket's items a source may yield one `PreparedBucket` (`iter_items` turns it back
    into items, for a wrapper or a reader other than the sender).
    """

    def plan_specs(self) -> list[TensorSpec]: ...

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]: ...


class DictWeightSource:
    """A weight source over a dict of full tensors (replicated or held by `source_rank`).

    `policy` declares the dtype the receiver gets (`common.dtype_policy`); by default every
    tensor keeps the dtype it has when the specs are listed. A tensor is cast by the policy
    when yielded.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        policy: DtypePolicy | None = None,
        source_rank: int = 0,
    ) -> None:
        self.tensors = tensors
        self.policy = policy or DtypePolicy.as_given()
        self.source_rank = source_rank
        self._casts = self.policy != DtypePolicy.as_given()  # else the tensors as they are

    def plan_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, tuple(t.shape), self.policy.dtype_for(name, t.dtype),
                       self.source_rank)
            for name, t in self.tensors.items()
        ]

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        """C-level `map`/`zip`: at tens of thousands of tensors a Python generator's cost per
        item is a visible share of an NVLink refit. Over a dict with no casts, a
        `MappingItems`: the sender then takes whole buckets from the dict."""
        names = plan.names
        if not self._casts and type(self.tensors) in (dict, OrderedDict):
            return MappingItems(self.tensors, names)
        tensors = map(self.tensors.get, names)
        if self._casts:
            tensors = map(self._declared, names, tensors)
        return zip(names, tensors, strict=True)

    def _declared(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Cast as the policy declares it (from the tensor's own dtype, so a tensor that
        drifted from its plan dtype still fails the sender's check)."""
        return tensor if tensor is None else tensor.to(self.policy.dtype_for(name, tensor.dtype))


class MappingItems(zip):
    """(name, `mapping.get(name)`) per name, from C-level iterators (a `zip` of tuple
    iterators and a `map`), as `DictWeightSource.iter_tensors` yields them to any reader; the
    sender's check may instead take a whole bucket's tensors straight from the dict (one
    native pass, `native.BucketScan.take_mapping`) and `advance` past its names, making no item
    per tensor."""

    def __new__(cls, mapping: dict, names: tuple[str, ...]) -> MappingItems:
        at, keys = iter(names), iter(names)
        self = super().__new__(cls, at, map(mapping.get, keys), strict=True)
        self.mapping, self._count, self._at, self._keys = mapping, len(names), at, keys
        return self

    @property
    def position(self) -> int:
        """How many names have been yielded or advanced past."""
        return self._count - self._at.__length_hint__()

    def advance(self, count: int) -> None:
        """Skip the next `count` names (a tuple iterator's position is settable)."""
        end = min(self.position + count, self._count)
        self._at.__setstate__(end)
        self._keys.__setstate__(end)
