"""Canonical Megatron names: no wrapper prefixes, global layer indices, global expert ids.

Megatron names are stage-local (`decoder.layers.0` on every pipeline stage and virtual chunk)
and expert names are EP-local (`local_experts.0` on every EP rank). Converters match one
global name space, so the source rewrites names here before any rule sees them.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_TE_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module / other `.module` wrappers."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def strip_module_prefixes(name: str) -> str:
    """`module.module.x` (DDP, Float16Module) -> `x`."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def skipped(name: str) -> bool:
    """Tensors that never reach the inference engine."""
    return name.endswith("._extra_state") or name.startswith("mtp.") or ".mtp." in name


def layer_offsets(model: torch.nn.Module) -> dict[int, int]:
    """Stage-local decoder layer index -> global 0-based index (from `layer_number`)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        return {}
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def globalize_layer(name: str, offsets: dict[int, int]) -> tuple[str, int]:
    """Rewrite `decoder.layers.{local}.` to the global index; also return that index (-1)."""
    m = _LAYER.match(name)
    if not m:
        return name, -1
    layer = offsets[int(m.group(1))]
    return f"decoder.layers.{layer}." + name[m.end():], layer


def expert_slot(name: str) -> tuple[str, int] | None:
    """For a local expert tensor: (name template with `{E}`, local slot), else None.

    Handles the local spec (`experts.local_experts.{i}.linear_fc1.weight`) and the TE grouped
    spec (`experts.linear_fc1.weight{i}`).
    """
    m = _LOCAL_EXPERT.search(name)
    if m:
        return name[: m.start()] + ".mlp.experts.{E}." + name[m.end():], int(m.group(1))
    m = _TE_GROUPED.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{{E}}.{m.group(1)}.{m.group(2)}", int(m.group(3))
    return None


def section(name: str) -> int:
    """Coarse position of a tensor in the model: embedding, layers, final norm, output."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return 1
    if name.startswith("decoder."):
        return 2
    return 3


_GROUPED = re.compile(r"\.mlp\.experts\.weight([12])$")


class LocalTensor(NamedTuple):
    """One Megatron tensor of this rank as the source lists it: its canonical name (an `{E}`
    template for an expert slot), global layer, local expert slot, and how TP splits it."""

    name: str
    layer: int
    slot: int | None
    tensor: torch.Tensor
    is_tp: bool
    dim: int  # partition dim
    stride: int  # partition stride


def grouped_slots(name: str, tensor: torch.Tensor, num_local: int) -> list[LocalTensor] | None:
    """Legacy GroupedMLP `experts.weight1/2` as per-slot views in local-spec layout.

    GroupedMLP's forward reads `weight1.view(n_local, H, -1)[i]` as expert i's `x @ W` matrix
    (the raw memory, not a column split) and `weight2.view(n_local, -1, H)[i]`; transposed,
    these are exactly the local spec's ETP shards: fc1 rows `[gate_r; up_r]` (dim 0, stride 2),
    fc2 `[H, I_r]` (dim 1). One entry per slot (layer -1: the caller globalises it).
    """
    m = _GROUPED.search(name)
    if m is None:
        return None
    prefix = name[: m.start()] + ".mlp.experts.{E}."
    t = tensor.detach()
    if m.group(1) == "1":
        views = t.view(num_local, t.shape[0], -1).transpose(1, 2)
        return [LocalTensor(prefix + "linear_fc1.weight", -1, i, views[i], True, 0, 2)
                for i in range(num_local)]
    views = t.view(num_local, -1, t.shape[1]).transpose(1, 2)
    return [LocalTensor(prefix + "linear_fc2.weight", -1, i, views[i], True, 1, 1)
            for i in range(num_local)]
