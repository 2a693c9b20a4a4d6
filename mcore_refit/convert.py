"""Declarative Megatron -> Hugging Face name/layout conversion.

An architecture is a table of `Rule`s: a canonical Megatron name pattern (wrapper prefixes
stripped, stage-local layer indices made global, local expert slots made global expert ids),
the HF checkpoint names it becomes, and how the full (already gathered) tensor is cut. Keeping
the layout knowledge in a handful of named cuts (`whole`, `qkv`, `gate_up`, `trim_vocab`) means
a new architecture is a short table; the plan's shapes are the same cut run on meta tensors,
so shapes and tensors can never disagree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from common.errors import ConversionError

Cut = Literal["whole", "qkv", "gate_up", "trim_vocab"]  # trim_vocab: drop padding rows


@dataclass(frozen=True)
class Dims:
    """Model sizes the cuts need (read from the Megatron TransformerConfig)."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the true (HF) vocabulary; Megatron rows past it are padding


@dataclass(frozen=True)
class Rule:
    """`pattern` (with `{L}` layer / `{E}` expert fields) becomes `targets` via `cut`.

    An empty `targets` skips the tensor. Dtypes are not the rule's business: the source's
    `DtypePolicy` declares them by HF name (so the router bias stays fp32 there, once).
    """

    pattern: str
    targets: tuple[str, ...]
    cut: Cut = "whole"

    def regex(self) -> re.Pattern[str]:
        body = re.escape(self.pattern).replace(r"\{L\}", r"(?P<L>\d+)")
        return re.compile(body.replace(r"\{E\}", r"(?P<E>\d+)") + "$")


def _qkv_sizes(d: Dims) -> list[int]:
    return [d.num_heads * d.head_dim, d.num_query_groups * d.head_dim,
            d.num_query_groups * d.head_dim]


def cut_shapes(cut: Cut, shape: tuple[int, ...], d: Dims) -> list[tuple[int, ...]]:
    """Shapes the cut produces from a full Megatron tensor of `shape`: the cut itself, run on
    a meta tensor (no data)."""
    return [tuple(t.shape) for t in cut_tensor(cut, torch.empty(shape, device="meta"), d)]


def cut_tensor(cut: Cut, full: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """Cut the full (gathered, stride-resolved) Megatron tensor into the HF tensors."""
    if cut == "whole":
        return [full]
    if cut == "trim_vocab":
        return [full[: d.vocab_size]]
    if cut == "gate_up":
        # Full fc1 is [gate; up] once the stride-2 TP shards are resolved by the gather.
        if full.shape[0] % 2:
            raise ValueError(f"gated fc1 with odd rows {tuple(full.shape)}")
        return list(full.chunk(2, dim=0))
    if cut == "qkv":
        if sum(_qkv_sizes(d)) != full.shape[0]:
            raise ValueError(f"fused qkv rows {full.shape[0]} do not match {d}")
        # Per query group: [q heads of the group, k, v]; de-interleave by group.
        groups, per = d.num_query_groups, d.num_heads // d.num_query_groups
        rest = full.shape[1:]
        x = full.reshape(groups, (per + 2) * d.head_dim, *rest)
        q, k, v = x.split([per * d.head_dim, d.head_dim, d.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise ValueError(f"unknown cut {cut!r}")


@dataclass(frozen=True)
class Target:
    """One HF tensor produced from a Megatron tensor."""

    name: str
    shape: tuple[int, ...]


class Converter:
    """An architecture's rule table; matches canonical Megatron names to HF names."""

    def __init__(self, name: str, rules: Sequence[Rule]) -> None:
        self.name = name
        self.rules = tuple(rules)
        self._compiled = [(r.regex(), r) for r in self.rules]

    def extend(self, name: str, rules: Sequence[Rule]) -> Converter:
        """A new converter: `rules` first (they win), then this table's rules."""
        return Converter(name, [*rules, *self.rules])

    def match(self, mcore_name: str) -> tuple[Rule, dict[str, str]] | None:
        for regex, rule in self._compiled:
            m = regex.match(mcore_name)
            if m:
                return rule, m.groupdict()
        return None

    def _rule(self, mcore_name: str) -> tuple[Rule, dict[str, str]]:
        found = self.match(mcore_name)
        if found is None:
            raise ConversionError(f"{self.name}: no conversion rule for Megatron tensor "
                                  f"{mcore_name!r}")
        return found

    def targets(self, mcore_name: str, full_shape: tuple[int, ...], d: Dims) -> list[Target]:
        rule, fields = self._rule(mcore_name)
        if not rule.targets:
            return []
        shapes = cut_shapes(rule.cut, full_shape, d)
        if len(shapes) != len(rule.targets):
            raise ValueError(f"{mcore_name}: cut {rule.cut} gives {len(shapes)} tensors, "
                             f"rule names {len(rule.targets)}")
        return [Target(t.format(**fields), s)
                for t, s in zip(rule.targets, shapes, strict=True)]

    def convert(self, mcore_name: str, full: torch.Tensor, d: Dims) -> list[torch.Tensor]:
        rule, _ = self._rule(mcore_name)
        return cut_tensor(rule.cut, full, d) if rule.targets else []
