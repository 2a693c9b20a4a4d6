"""FP8 in the plan: which weights an engine holds in block FP8, and a weight source that sends
them so.

An engine serving a block-FP8 checkpoint reads, once, which of its checkpoint's tensors are
e4m3 (`Fp8Targets.from_checkpoint`: config.json's `quantization_config` and the safetensors
headers, `common.checkpoint`: no weights read) and tells the trainers at setup. Every training
rank then turns its plan's specs into the checkpoint's (`fp8_specs`: each target as its fp8
weight followed by its `<name>_scale_inv`), and `Fp8Source` quantizes those tensors after they
are gathered and converted. A disagreement is a `FormatMismatchError` naming the tensor, the
same on every rank since every rank computes it from the same targets. No vllm import here.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import checkpoint_tensors
from common.errors import FormatMismatchError
from common.kernels import native
from common.plan import RefitPlan, TensorSpec
from common.quant.fp8_batch import Fp8Batch, start_batch
from common.quant.fp8_blocks import BlockFp8Format
from common.quant.fp8_fill import (
    FillState,
    bucket_addresses,
    bucket_tensors,
    fill_bucket,
    fillable,
)
from common.quant.fp8_layout import Fp8Layout
from common.source import MappingItems, PreparedBucket, RefusedTensor, WeightSource

SCALE_SUFFIX = "_scale_inv"
_PLAIN = {"bfloat16", "float16", "float32"}  # sent as they are (the dtype policy decides which)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


@dataclass(frozen=True)
class Fp8Targets:
    """The weights an engine holds in block FP8 (each with its `<name>_scale_inv`) and the
    format; what the engine tells the trainers at setup."""

    fmt: BlockFp8Format
    names: frozenset[str]

    def to_json(self) -> dict:
        return {"block": list(self.fmt.block), "ue8m0": self.fmt.ue8m0,
                "names": sorted(self.names)}

    @classmethod
    def from_json(cls, data: dict) -> Fp8Targets:
        fmt = BlockFp8Format(block=tuple(data["block"]), ue8m0=bool(data["ue8m0"]))
        return cls(fmt, frozenset(data["names"]))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Fp8Targets | None:
        """The FP8 weights of the HF checkpoint in `path`; None when it is not quantized.
        Raises `FormatMismatchError` for a tensor held in a format refit cannot produce
        (another fp8 or integer dtype, per-tensor scales) or a scale of the wrong shape."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        try:
            fmt = BlockFp8Format.from_quantization_config(config.get("quantization_config"))
        except ValueError as e:
            raise FormatMismatchError(f"engine checkpoint {path}: {e}") from e
        headers = {n: (dtype, list(shape))
                   for n, (shape, dtype) in checkpoint_tensors(path).items()}
        fp8 = {n for n, (dtype, _) in headers.items() if dtype == "float8_e4m3fn"}
        if fmt is None:
            if fp8:
                raise FormatMismatchError(f"engine checkpoint {path}: {_some(fp8)} are fp8 "
                                          "but config.json has no quantization_config")
            return None
        for name, (dtype, shape) in sorted(headers.items()):
            _check_tensor(path, name, dtype, shape, headers, fp8, fmt)
        return cls(fmt, frozenset(fp8))


def _check_tensor(path: Path, name: str, dtype: str, shape: list[int], headers: dict,
                  fp8: set[str], fmt: BlockFp8Format) -> None:
    """One checkpoint tensor refit can produce: plain, an fp8 weight with its scale, or the
    scale of one."""
    where = f"engine checkpoint {path}: {name!r}"
    if name in fp8:
        if len(shape) != 2:
            raise FormatMismatchError(f"{where} is fp8 with shape {shape}: block FP8 is 2-D")
        scale = headers.get(scale_name(name))
        want = list(fmt.scale_shape(tuple(shape)))
        if scale is None or scale[0] != "float32" or scale[1] != want:
            held = "missing" if scale is None else f"{scale[0]} {scale[1]}"
            raise FormatMismatchError(f"{where} is fp8 {shape} but {scale_name(name)!r} is "
                                      f"{held}; {fmt.describe()} needs it float32 {want}")
    elif name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in fp8:
        return
    elif dtype not in _PLAIN or name.endswith(("_scale", "input_scale")):
        raise FormatMismatchError(f"{where} is held as {dtype} {shape}: refit sends bf16, "
                                  f"fp16, fp32 or {fmt.describe()} only")


def _some(names) -> str:
    names = sorted(names)
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3
                                              else "")


def fp8_specs(specs: list[TensorSpec], targets: Fp8Targets) -> list[TensorSpec]:
    """The plan's specs as the engine's checkpoint holds them: each target as its fp8 weight
    followed by its float32 scale_inv, every other spec as it is."""
    have = {s.name: s for s in specs}
    if missing := targets.names - have.keys():
        raise FormatMismatchError(
            f"the engine holds {_some(missing)} in FP8 ({targets.fmt.describe()}) but the "
            f"trainers' plan has no such tensor ({len(missing)} of {len(targets.names)})")
    if clash := {scale_name(n) for n in targets.names} & have.keys():
        raise FormatMismatchError(f"the trainers' plan already has {_some(clash)}: scales of "
                                  "FP8 weights are computed by refit, not sent by the source")
    out = []
    for s in specs:
        if s.name not in targets.names:
            out.append(s)
            continue
        if len(s.shape) != 2 or not s.dtype.is_floating_point or s.dtype.itemsize < 2:
            raise FormatMismatchError(f"{s.describe()}: the engine holds it in FP8, which "
                                      "refit quantizes from 2-D bf16, fp16 or fp32 only")
        out += [TensorSpec(s.name, s.shape, targets.fmt.dtype, s.source_rank),
                TensorSpec(scale_name(s.name), targets.fmt.scale_shape(s.shape),
                           torch.float32, s.source_rank)]
    return out


class Fp8Source:
    """`inner` with the engine's FP8 targets quantized after gathering and converting; its
    plan specs are `fp8_specs` of the inner ones. A weight that cannot be quantized (NaN or
    inf) is yielded as a `RefusedTensor`: the refit fails, naming it, and nothing stalls."""

    def __init__(self, inner: WeightSource, targets: Fp8Targets) -> None:
        self.inner, self.targets = inner, targets
        self._inner_specs = {s.name: s for s in inner.plan_specs()}
        self._scale_names = frozenset(scale_name(n) for n in targets.names)
        self._inner_plans: dict[str, RefitPlan] = {}
        self._layouts: dict[str, list[Fp8Layout]] = {}
        self._scans: dict[tuple, native.BucketScan] = {}  # (id(layout), device): its targets
        self._fills: dict[tuple, FillState] = {}  # (plan digest, device): kept between refits
        self.by_address = 0  # buckets the last iteration handed over as `PreparedBucket`s

    def plan_specs(self) -> list[TensorSpec]:
        return fp8_specs(list(self._inner_specs.values()), self.targets)

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Per plan spec in plan order: the inner source's tensor, a target quantized, or a
        target's scale (from its weight, which comes first: each source's order holds in any
        plan, interleaved too). A bucket whose inner tensors the native scan found on a GPU
        the kernel serves goes as one `PreparedBucket` the sender fills (`fp8_fill`: the
        targets quantized straight into the frame). Otherwise its targets are quantized
        together (`start_batch`: one launch per shape on CUDA), the next bucket's launched
        before this one's are checked and yielded, so the device quantizes while the host
        sends: two buckets' inner tensors are alive together. The per-spec work is laid out
        once per plan (`Fp8Layout`), none of it per tensor and refit."""
        inner = self.inner.iter_tensors(self._inner_plan(plan))
        scales: dict[str, torch.Tensor | RefusedTensor | None] = {}
        self.by_address = 0
        ahead = None  # the bucket launched last: (layout, its inner items, batch, addresses)
        taken = 0  # inner items so far
        state = None  # what the fills keep between refits (`FillState`), from the first fill
        layouts = self._bucket_layouts(plan)
        for index, layout in enumerate(layouts):
            got, names, tensors, addresses, held = self._take(inner, layout, taken)
            if len(tensors) < len(layout.inner):
                raise ValueError(f"the weight source ended before {layout.names[0]!r}'s bucket "
                                 f"was complete ({len(tensors)} of {len(layout.inner)} tensors)")
            taken += len(tensors)
            targets = layout.addressing.targets_of(tensors) if addresses is not None else []
            if fillable(targets, layout.groups, self.targets.fmt):
                if ahead is not None:  # its scales may be this bucket's
                    yield from self._settled(*ahead, scales)
                    ahead = None
                state = state or self._fill_state(plan, tensors[0].device)
                if (prepared := fill_bucket(layout, tensors, targets, addresses, scales, state,
                                            index, self.targets.fmt, held)) is not None:
                    self.by_address += 1
                    yield prepared
                    continue
            got = got or list(zip(names, tensors, strict=True))  # (name, tensor)s
            launched = (layout, got, *self._start(got, layout, addresses))
            if ahead is not None:
                yield from self._settled(*ahead, scales)
            ahead = launched
            del got, launched
        if ahead is not None:
            yield from self._settled(*ahead, scales)

    def _take(self, inner: Iterator, layout: Fp8Layout,
              taken: int) -> tuple[list | None, tuple, list, np.ndarray | None, bool]:
        """The bucket's inner items (the (name, tensor) items where the inner source made
        them, else None), their names and tensors and, when one native pass found every one
        with its planned name, shape and dtype, contiguous on the targets' device, their
        addresses (in `layout.inner` order; None where not so, or without the native module).
        From a dict source (`MappingItems`) the pass takes them straight from its dict: then
        they are held (the dict's own tensors, alive after the send), and no item is made."""
        if isinstance(inner, MappingItems) and inner.position == taken and layout.targets:
            x = inner.mapping.get(layout.names[layout.targets[0][0]])
            if isinstance(x, torch.Tensor) and (scan := self._scan(layout, x.device)):
                tensors, ptrs = scan.take_mapping(inner.mapping)
                if tensors is not None:
                    inner.advance(len(layout.inner))
                    return None, scan.names, tensors, \
                        None if ptrs is None else ptrs.copy(), True
        got = list(itertools.islice(inner, len(layout.inner)))
        names, tensors = tuple(n for n, _ in got), [t for _, t in got]
        if len(got) < len(layout.inner) or not layout.targets:
            return got, names, tensors, None, False
        x = layout.addressing.targets_of(tensors)[0]
        if not isinstance(x, torch.Tensor) or (scan := self._scan(layout, x.device)) is None:
            return got, names, tensors, None, False
        ptrs = scan.take(got)[1]
        return got, names, tensors, None if ptrs is None else ptrs.copy(), False

    def _start(self, got: list, layout: Fp8Layout,
               addresses: np.ndarray | None) -> tuple[Fp8Batch, np.ndarray | None]:
        """The quantization of the bucket's targets (held on this rank), launched; and the
        addresses of all the bucket's inner items (`got`), when `_take` found them."""
        named = layout.addressing.targets_of(got)
        at = None if addresses is None else addresses[layout.addressing.target_inner]
        return start_batch(named, self.targets.fmt, layout.groups, at), addresses

    def _settled(self, layout: Fp8Layout, got: list, batch: Fp8Batch,
                 inner: np.ndarray | None,
                 scales: dict) -> Iterator[tuple[str, torch.Tensor | None] | PreparedBucket]:
        """The bucket: one `PreparedBucket` (by address) when the native pass found all its
        inner items and every target quantized (held here, scales finite); else its (name,
        tensor) items, its targets replaced by their e4m3 tensors (a target not held here:
        None, one that cannot be quantized: a `RefusedTensor`) and their scales kept in
        `scales` until their places come."""
        if inner is not None and (found := batch.addresses()) is not None:
            if (prepared := _prepared(layout, got, batch, inner, found, scales)) is not None:
                self.by_address += 1
                yield prepared
                return
        names, tensors = list(layout.names), [None] * len(layout.names)
        for k, (name, tensor) in zip(layout.inner, got, strict=True):
            names[k], tensors[k] = name, tensor
        for (k, scale), result in zip(layout.targets, batch.results(), strict=True):
            if result is None or isinstance(result, tuple):
                tensors[k], scales[scale] = result or (None, None)
            else:
                tensors[k] = scales[scale] = RefusedTensor(f"not quantized to FP8: {result}")
        for k, name in layout.scales:
            tensors[k] = scales.pop(name, None)
        yield from zip(names, tensors, strict=True)

    def _fill_state(self, plan: RefitPlan, device: torch.device) -> FillState:
        """The plan's `FillState` on `device` (made once), its flags zeroed for this refit."""
        if (state := self._fills.get((plan.digest, device))) is None:
            state = self._fills[plan.digest, device] = FillState(len(plan.buckets), device)
        state.flags.reset()
        return state

    def _scan(self, layout: Fp8Layout, device: torch.device) -> native.BucketScan | None:
        """The native pass over the bucket's inner items on `device` (made once per layout and
        device); None without the native module."""
        if (scan := self._scans.get((id(layout), device))) is None:
            if (module := native.load()) is None:
                return None
            specs = [self._inner_specs[layout.names[k]] for k in layout.inner]
            scan = self._scans[id(layout), device] = native.BucketScan(module, specs, device)
        return scan

    def _bucket_layouts(self, plan: RefitPlan) -> list[Fp8Layout]:
        """Each bucket's `Fp8Layout` (made once per plan)."""
        if (known := self._layouts.get(plan.digest)) is not None:
            return known
        layouts = []
        for bucket in plan.buckets:
            names = tuple(s.name for s in plan.bucket_specs(bucket))
            is_scale = [n in self._scale_names for n in names]
            targets = tuple((k, scale_name(n)) for k, n in enumerate(names)
                            if n in self.targets.names)
            groups: dict[tuple, list[int]] = {}
            for t, (k, _) in enumerate(targets):
                spec = self._inner_specs[names[k]]
                groups.setdefault((spec.shape, spec.dtype), []).append(t)
            layouts.append(Fp8Layout(
                names, tuple(k for k, sc in enumerate(is_scale) if not sc), targets,
                tuple((k, n) for k, n in enumerate(names) if is_scale[k]),
                tuple(map(tuple, groups.values()))))
        self._layouts[plan.digest] = layouts
        return layouts

    def _inner_plan(self, plan: RefitPlan) -> RefitPlan:
        """The plan the inner source iterates: `plan`'s order without the scales, each target
        in its trainer dtype (made once per plan). Refuses a plan where a scale comes before
        its weight or is missing."""
        if (known := self._inner_plans.get(plan.digest)) is not None:
            return known
        at = {s.name: i for i, s in enumerate(plan.specs)}
        for name in self.targets.names:
            if not at.get(name, len(at)) < at.get(scale_name(name), -1):
                raise FormatMismatchError(
                    f"the plan does not send FP8 weight {name!r} before its {SCALE_SUFFIX} "
                    f"(build it from Fp8Source.plan_specs())")
        scales = {scale_name(n) for n in self.targets.names}
        specs = [self._inner_specs[s.name] if s.name in self.targets.names else s
                 for s in plan.specs if s.name not in scales]
        self._inner_plans[plan.digest] = RefitPlan(tuple(specs), plan.config)  # as ordered
        return self._inner_plans[plan.digest]


def _prepared(layout: Fp8Layout, got: list, batch: Fp8Batch, inner: np.ndarray,
              found: tuple[np.ndarray, np.ndarray], scales: dict) -> PreparedBucket | None:
    """The bucket by address: inner items (`got`) where they are, targets' e4m3 values and
    scales where the quantizer wrote them, scales of earlier buckets' targets from `scales`
    (None when one of those is not a tensor: the caller's items then say why)."""
    a, (q_at, s_at) = layout.addressing, found
    carried = [scales.get(n) for _, n in a.carried_in]
    if not all(isinstance(c, torch.Tensor) for c in carried):
        return None
    for _, n in a.carried_in:
        del scales[n]
    for t, n in a.carried_out:
        scales[n] = batch.scale(t)
    ptrs = bucket_addresses(layout, inner, carried)
    ptrs[a.target_pos] = q_at
    ptrs[a.scale_pos] = s_at[a.scale_target]

    def views() -> list[torch.Tensor]:
        return bucket_tensors(layout, [t for _, t in got], batch.results(), carried)

    return PreparedBucket(layout.names, ptrs, views, got[a.target_inner[0]][1].device,
                          (batch.buffers(), got, carried))
