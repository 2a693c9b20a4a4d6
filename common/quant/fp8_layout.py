"""An FP8 source's view of one plan bucket, made once per plan: which positions the inner
source feeds, which are FP8 targets and where their scales go, and the numpy index arrays a
bucket sent by address (`PreparedBucket`) is filled from, so nothing is done per weight and
refit that the plan already fixed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter

import numpy as np


@dataclass(frozen=True)
class Fp8Layout:
    """One plan bucket as `Fp8Source` fills it (made once per plan): the plan's names, the
    positions the inner source feeds, its FP8 targets with their scales' names, and the
    positions of scales."""

    names: tuple[str, ...]
    inner: tuple[int, ...]
    targets: tuple[tuple[int, str], ...]  # (position, its scale's name)
    scales: tuple[tuple[int, str], ...]  # (position, name)
    groups: tuple[tuple[int, ...], ...]  # indices into `targets` of one inner shape and dtype

    @cached_property
    def addressing(self) -> Fp8Addressing:
        """Where its addresses come from when it goes by address (`PreparedBucket`)."""
        return _addressing(self)


@dataclass(frozen=True)
class Fp8Addressing:
    """Where a bucket's addresses come from (numpy, made once per layout): the inner tensors'
    positions; the targets' positions and their places in the inner order; the scales of this
    bucket's targets (position, target); scales of earlier buckets' targets (position, name);
    this bucket's targets whose scales come later (target, name)."""

    inner_pos: np.ndarray
    target_pos: np.ndarray
    target_inner: np.ndarray
    scale_pos: np.ndarray
    scale_target: np.ndarray
    carried_in: tuple[tuple[int, str], ...]
    carried_out: tuple[tuple[int, str], ...]
    targets_of: Callable[[list], list]  # a bucket's inner items -> its targets' (C-level)
    groups: list[list[int]]  # the layout's groups (targets of one shape), as lists
    order: np.ndarray  # the targets in launch order (group after group)
    order_inner: np.ndarray  # their places in the inner order
    order_pos: np.ndarray  # their positions in the bucket, in launch order
    filled: np.ndarray  # the positions a fill writes: targets, then this bucket's scales


def _addressing(layout: Fp8Layout) -> Fp8Addressing:
    inner_at = {k: i for i, k in enumerate(layout.inner)}
    target_of = {scale: t for t, (_, scale) in enumerate(layout.targets)}
    here = [(k, target_of[n]) for k, n in layout.scales if n in target_of]
    sent_here = {n for _, n in layout.scales}
    target_inner = np.array([inner_at[k] for k, _ in layout.targets], np.int64)
    order = np.array([t for g in layout.groups for t in g], np.int64)
    target_pos = np.array([k for k, _ in layout.targets], np.int64)
    scale_pos = np.array([k for k, _ in here], np.int64)
    return Fp8Addressing(
        np.array(layout.inner, np.int64), target_pos, target_inner,
        scale_pos, np.array([t for _, t in here], np.int64),
        tuple((k, n) for k, n in layout.scales if n not in target_of),
        tuple((t, n) for t, (_, n) in enumerate(layout.targets) if n not in sent_here),
        _picker([inner_at[k] for k, _ in layout.targets], len(layout.inner)),
        [list(g) for g in layout.groups], order, target_inner[order], target_pos[order],
        np.concatenate([target_pos, scale_pos]))


def _picker(positions: list[int], count: int) -> Callable[[list], list]:
    """`items` (`count` of them) -> [items[i] for i in positions], by one C-level
    `itemgetter`; `items` itself where that is all of them in order (no copy)."""
    if positions == list(range(count)):
        return lambda items: items
    if len(positions) < 2:  # itemgetter of one position gives the item, not a tuple
        return lambda items: [items[i] for i in positions]
    get = itemgetter(*positions)
    return lambda items: list(get(items))
