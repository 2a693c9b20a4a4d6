"""Refit plan: ordered tensor specs cut into aligned buckets, made once at setup.

The plan is the contract between trainer and receivers: names, shapes, dtypes (the dtype the
receiver must get, i.e. the converter's declared output dtype), bucket layout, bucket size and
buffer count. Both sides check it by digest, so buffers can never be sized independently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from common.config import LOCAL_SETTINGS, RefitConfig

PLAN_FORMAT = 4  # 4: delta frames (headers name the next frame), undo log budget


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the receiver must get it; `source_rank` is the refit rank that sends it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name:
            raise ValueError("TensorSpec needs a name")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: negative dimension in {self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorSpec {self.name!r}: dtype {self.dtype!r} is not a torch.dtype")

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, source_rank: int = 0) -> TensorSpec:
        """Spec from a tensor's metadata (works on meta tensors: nothing is materialised)."""
        return cls(name, tuple(tensor.shape), tensor.dtype, source_rank)

    def describe(self) -> str:
        shape, dtype = list(self.shape), dtype_name(self.dtype)
        return f"{self.name!r} {shape} {dtype} (source rank {self.source_rank})"

    def to_json(self) -> list:
        return [self.name, list(self.shape), dtype_name(self.dtype), self.source_rank]

    @classmethod
    def from_json(cls, item: Sequence) -> TensorSpec:
        name, shape, dtype, source = item
        return cls(name, tuple(shape), dtype_from_name(dtype), int(source))


@dataclass(frozen=True)
class Bucket:
    """Consecutive specs [start, stop) of one source rank, packed at `offsets` (payload bytes).

    `direct`: one tensor sent straight from its own memory (no pack), header apart;
    `oversize`: a direct tensor larger than a bucket buffer, received into its own tensor.
    """

    index: int
    source_rank: int
    start: int
    stop: int
    offsets: tuple[int, ...]
    nbytes: int
    oversize: bool
    direct: bool

    @property
    def spec_indices(self) -> range:
        return range(self.start, self.stop)


def cut_buckets(specs: Sequence[TensorSpec], config: RefitConfig) -> list[Bucket]:
    """Cut specs in order into buckets of at most config.bucket_bytes, never mixing sources.

    A tensor of at least config.direct_bytes gets a bucket of its own (direct: no pack copy);
    one larger than a bucket is also received straight into its own tensor (oversize).
    """
    buckets: list[Bucket] = []
    start, offsets, end = 0, [], 0

    def close(stop: int) -> None:
        nonlocal start, offsets, end
        if stop > start:
            single = specs[start].nbytes if stop - start == 1 else 0
            buckets.append(Bucket(len(buckets), specs[start].source_rank, start, stop,
                                  tuple(offsets), end, single > config.bucket_bytes,
                                  single >= min(config.direct_bytes, config.bucket_bytes + 1)))
        start, offsets, end = stop, [], 0

    for i, spec in enumerate(specs):
        if i > start and spec.source_rank != specs[start].source_rank:
            close(i)
        if spec.nbytes >= min(config.direct_bytes, config.bucket_bytes + 1):
            close(i)
            offsets, end = [0], spec.nbytes
            close(i + 1)
            continue
        offset = align_up(end, config.alignment)
        if i > start and offset + spec.nbytes > config.bucket_bytes:
            close(i)
            offset = 0
        offsets.append(offset)
        end = offset + spec.nbytes
    close(len(specs))
    return buckets


def interleave(specs: Sequence[TensorSpec], config: RefitConfig) -> list[TensorSpec]:
    """`specs` reordered so that their buckets (as `cut_buckets` cuts them) come from the
    source ranks in turn, each rank's buckets in their own order, the ranks merged by the
    bytes each has sent before a bucket (ties: the lower rank first): the same buckets, cut
    again the same way from the new order."""
    queues: dict[int, list[Bucket]] = {}
    for bucket in cut_buckets(specs, config):
        queues.setdefault(bucket.source_rank, []).append(bucket)
    heap = [(0, rank, 0) for rank in queues]
    heapq.heapify(heap)
    out: list[TensorSpec] = []
    while heap:
        sent, rank, k = heapq.heappop(heap)
        bucket = queues[rank][k]
        out += specs[bucket.start : bucket.stop]
        if k + 1 < len(queues[rank]):
            heapq.heappush(heap, (sent + bucket.nbytes, rank, k + 1))
    return out


def balance_sources(specs: Sequence[TensorSpec],
                    candidates: Mapping[str, Sequence[int]]) -> list[TensorSpec]:
    """`specs` (same order) with each tensor that several ranks can send (`candidates[name]`:
    those ranks, the spec's own `source_rank` among them or not) given to the candidate with
    the fewest bytes so far: the tensors with one possible source counted first, then the
    others largest first (ties: the lower rank), so every source sends about the same bytes
    (`common.transfer.schedule` runs the sources at once). Deterministic: every rank that
    holds the same specs and candidates gets the same plan."""
    loads: dict[int, int] = {}
    for spec in specs:
        if len(candidates.get(spec.name, ())) < 2:
            loads[spec.source_rank] = loads.get(spec.source_rank, 0) + spec.nbytes
    flexible = sorted((s for s in specs if len(candidates.get(s.name, ())) >= 2),
                      key=lambda s: -s.nbytes)
    chosen: dict[str, int] = {}
    for spec in flexible:
        rank = min(sorted(candidates[spec.name]), key=lambda r: loads.get(r, 0))
        loads[rank] = loads.get(rank, 0) + spec.nbytes
        chosen[spec.name] = rank
    return [dataclasses.replace(s, source_rank=chosen[s.name]) if s.name in chosen else s
            for s in specs]


@dataclass(frozen=True)
class RefitPlan:
    """Everything both sides must agree on before the first byte moves."""

    specs: tuple[TensorSpec, ...]
    config: RefitConfig
    buckets: tuple[Bucket, ...] = field(init=False)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        specs = tuple(self.specs)
        object.__setattr__(self, "specs", specs)
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                raise ValueError(f"refit plan lists tensor {spec.name!r} twice")
            seen.add(spec.name)
        object.__setattr__(self, "buckets", tuple(cut_buckets(specs, self.config)))
        body = json.dumps(self._body(), separators=(",", ":"), sort_keys=True)
        object.__setattr__(self, "digest", hashlib.sha256(body.encode()).hexdigest())

    @classmethod
    def build(cls, specs: Iterable[TensorSpec], config: RefitConfig | None = None) -> RefitPlan:
        """The plan of `specs` in their order, or with `config.interleave` or
        `config.concurrent_sources` their buckets taken by source rank in turn (`interleave`:
        plan order is the order every rank issues frames in, so concurrent sources need it
        to send at once; `common.transfer.schedule`)."""
        config, specs = config or RefitConfig(), tuple(specs)
        turns = config.interleave or config.concurrent_sources
        return cls(tuple(interleave(specs, config)) if turns else specs, config)

    def with_local_settings(self, config: RefitConfig) -> RefitPlan:
        """This plan with `config`'s trainer-local settings (`LOCAL_SETTINGS`: they do not
        travel with the plan, so each trainer puts its own back on rank 0's)."""
        local = {name: getattr(config, name) for name in LOCAL_SETTINGS}
        if all(getattr(self.config, name) == value for name, value in local.items()):
            return self
        return RefitPlan(self.specs, dataclasses.replace(self.config, **local))

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Every spec's name, in plan order (made once: sources walk it every refit)."""
        return tuple(s.name for s in self.specs)

    @cached_property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @cached_property
    def buffer_bytes(self) -> int:
        """Size of one bucket buffer: the largest non-oversize bucket payload."""
        return max((b.nbytes for b in self.buckets if not b.oversize), default=0)

    @property
    def largest_oversize_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets if b.oversize), default=0)

    def bucket_specs(self, bucket: Bucket) -> tuple[TensorSpec, ...]:
        return self.specs[bucket.start : bucket.stop]

    def _body(self) -> dict:
        c = self.config
        return {
            "format": PLAN_FORMAT,
            "bucket_bytes": c.bucket_bytes,
            "num_buffers": c.num_buffers,
            "alignment": c.alignment,
            "direct_bytes": c.direct_bytes,
            "specs": [s.to_json() for s in self.specs],
        }

    def to_dict(self) -> dict:
        """Plain JSON-able form (plus the timeout, the checksum, shard-to-shard, delta, undo
        and concurrent-sources switches and the digest; a trainer's local settings stay with
        it) for sending once at setup: every rank takes rank 0's, and a switch leaves the
        digest (and so the engines' learned maps) as it is."""
        return {**self._body(), "timeout_s": self.config.timeout_s,
                "checksum": self.config.checksum, "shard_to_shard": self.config.shard_to_shard,
                "delta": self.config.delta, "undo_bytes": self.config.undo_bytes,
                "concurrent_sources": self.config.concurrent_sources,
                "receive_buffers": self.config.receive_buffers, "digest": self.digest}

    @classmethod
    def from_dict(cls, data: dict) -> RefitPlan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"refit plan format {data.get('format')!r}, expected {PLAN_FORMAT}")
        config = RefitConfig(
            bucket_bytes=data["bucket_bytes"],
            num_buffers=data["num_buffers"],
            timeout_s=data["timeout_s"],
            alignment=data["alignment"],
            direct_bytes=data["direct_bytes"],
            checksum=data.get("checksum", False),
            shard_to_shard=data["shard_to_shard"],
            delta=data["delta"],
            undo_bytes=data["undo_bytes"],
            concurrent_sources=data.get("concurrent_sources", False),
            receive_buffers=data.get("receive_buffers", data["num_buffers"]),
        )
        plan = cls(tuple(TensorSpec.from_json(s) for s in data["specs"]), config)
        if "digest" in data and data["digest"] != plan.digest:
            raise ValueError(f"refit plan digest {data['digest'][:12]} does not match its content "
                             f"({plan.digest[:12]}): corrupted in transit or another version")
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RefitPlan:
        return cls.from_dict(json.loads(text))

    def difference(self, other: RefitPlan) -> str | None:
        """The first difference between two plans in words, or None when the digests agree."""
        if self.digest == other.digest:
            return None
        for key in ("bucket_bytes", "num_buffers", "alignment", "direct_bytes"):
            a, b = getattr(self.config, key), getattr(other.config, key)
            if a != b:
                return f"{key} differs: {a} vs {b}"
        for i, (a, b) in enumerate(zip(self.specs, other.specs, strict=False)):
            if a != b:
                return f"tensor #{i} differs: {a.describe()} vs {b.describe()}"
        n, m = len(self.specs), len(other.specs)
        if n != m:
            longer = self.specs if n > m else other.specs
            side = "first" if n > m else "second"
            return (f"{n} vs {m} tensors; the {side} plan also has "
                    f"{longer[min(n, m)].describe()}")
        return "plans differ in format"
