"""Training names -> HF checkpoint names: wrapper prefixes, tied embeddings, fused MoE experts.

vLLM's `load_weights` takes checkpoint names, while a transformers-5 model trained with FSDP2
holds module names: wrapper components (torch.compile's `_orig_mod`, activation checkpointing's
`_checkpoint_wrapped_module`, FSDP1's `_fsdp_wrapped_module`), a tied `lm_head.weight` that the
checkpoint omits, and fused experts. The fused layout (checked against `save_pretrained` and
`transformers.conversion_mapping`'s "qwen2_moe" entry, used by Qwen2/3-MoE, DeepSeek-V2/V3,
GLM4-MoE, OLMoE, ...): `gate_up_proj [E, 2I, H]` is `cat([stack(gate_e), stack(up_e)], dim=1)`,
so expert e's `gate_proj.weight` is `[e, :I]` and `up_proj.weight` is `[e, I:]`, both [I, H], no
transpose; `down_proj [E, H, I]` is `stack(down_e)`, `down_proj.weight` of expert e is `[e]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

WRAPPER_PARTS: tuple[str, ...] = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def strip_wrappers(name: str) -> str:
    """`_orig_mod.model._checkpoint_wrapped_module.x` -> `model.x`."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


@dataclass(frozen=True)
class Entry:
    """One training tensor and the checkpoint tensors it becomes.

    `key` is the attribute path in the (wrapped) training model, looked up again at every
    refit because FSDP2 swaps sharded / unsharded parameters in and out of the modules.
    `kind` is "plain" (one checkpoint tensor, `names[0]`), "gate_up" or "down" (fused experts:
    2E resp. E checkpoint tensors, split per expert after the gather).
    """

    key: str
    kind: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def expert_entry(key: str, name: str, shape: tuple[int, ...]) -> Entry | None:
    """The per-expert entry of a fused expert tensor, or None when `name` is not one."""
    m = _FUSED.match(name)
    if m is None or len(shape) != 3:
        return None
    prefix, kind = m["prefix"], m["kind"]
    experts, rows, cols = shape
    if kind == "gate_up_proj":
        if rows % 2:
            raise ValueError(f"{name}: fused gate_up_proj {list(shape)} has an odd dim 1")
        half = (rows // 2, cols)
        names = tuple(f"{prefix}.{e}.{p}.weight" for e in range(experts)
                      for p in ("gate_proj", "up_proj"))
        return Entry(key, "gate_up", names, (half,) * len(names))
    names = tuple(f"{prefix}.{e}.down_proj.weight" for e in range(experts))
    return Entry(key, "down", names, ((rows, cols),) * experts)


def split_experts(kind: str, full: torch.Tensor) -> Iterator[torch.Tensor]:
    """Per-expert views of a gathered fused tensor, in the order of `Entry.names`."""
    if kind == "gate_up":
        inter = full.shape[1] // 2
        for e in range(full.shape[0]):
            yield full[e, :inter]
            yield full[e, inter:]
    elif kind == "down":
        yield from full.unbind(0)
    else:
        raise ValueError(f"unknown fused expert kind {kind!r}")


def tied_names(model: torch.nn.Module) -> set[str]:
    """Checkpoint names that save_pretrained drops as ties (e.g. `lm_head.weight`).

    transformers fills `all_tied_weights_keys` ({target: source}) only when the config ties
    (e.g. `tie_word_embeddings`); targets of nested PreTrainedModels get their module prefix.
    """
    out: set[str] = set()
    for prefix, module in model.named_modules():
        tied = getattr(module, "all_tied_weights_keys", None)
        if not tied:
            continue
        base = strip_wrappers(prefix)
        out.update(f"{base}.{t}" if base else t for t in tied)
    return out


def hf_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost transformers PreTrainedModel inside `model` (itself when it is one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # a plain torch model: no conversion mapping to check against
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
