"""The checkpoint layout of a training model, read from metadata only (no gather, no copy).

`model_entries` walks the modules once at setup: global shapes come from DTensor metadata (a
DTensor's `.shape` is global; an FSDP2 root left unsharded after a no_grad forward holds the
full-shape tensor, so both give the same answer), non-persistent buffers (rotary `inv_freq`)
are skipped as save_pretrained skips them, tied weights are kept once, fused experts become
per-expert checkpoint names. For transformers models the result is then checked against
transformers' own reverse conversion (`revert_weight_conversion`, what save_pretrained runs)
on meta tensors, which also adopts any plain renames that mapping does.
"""

from __future__ import annotations

import logging

import torch

from common.errors import RefitError
from dtensor_refit.names import Entry, expert_entry, hf_model, strip_wrappers, tied_names

log = logging.getLogger(__name__)


class LayoutError(RefitError, ValueError):
    """The model's tensors do not map onto the checkpoint names transformers would save."""


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) of every parameter and persistent buffer, each object once."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, int] = {}
    tied = tied_names(model)
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        items = [(n, t) for n, t in module._parameters.items() if t is not None]
        items += [(n, t) for n, t in module._buffers.items()
                  if t is not None and n not in module._non_persistent_buffers_set]
        for attr, tensor in items:
            key = dot + attr
            if id(tensor) in seen:  # the same tensor under two names: keep the untied one
                i = seen[id(tensor)]
                if strip_wrappers(out[i][0]) in tied and strip_wrappers(key) not in tied:
                    out[i] = (key, tensor)
                continue
            seen[id(tensor)] = len(out)
            out.append((key, tensor))
    # A tie the config declares is dropped even if training untied the objects (vLLM ties).
    return [(k, t) for k, t in out if strip_wrappers(k) not in tied]


def model_entries(model: torch.nn.Module, check: bool = True) -> list[Entry]:
    entries: list[Entry] = []
    meta: dict[str, torch.Tensor] = {}
    for key, tensor in _tensors(model):
        name, shape = strip_wrappers(key), tuple(tensor.shape)
        entries.append(expert_entry(key, name, shape) or Entry(key, "plain", (name,), (shape,)))
        meta[name] = torch.empty(shape, dtype=tensor.dtype, device="meta")
    if check:
        entries = _match_transformers(model, entries, meta)
    names = [n for e in entries for n in e.names]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise LayoutError(f"checkpoint name {dup!r} comes from two training tensors")
    return entries


def _match_transformers(model: torch.nn.Module, entries: list[Entry],
                        meta: dict[str, torch.Tensor]) -> list[Entry]:
    """Check the names and shapes against `revert_weight_conversion` on meta tensors.

    A plain tensor that transformers only renames keeps its identity through the reversal, so
    its checkpoint name is read off by identity; every fused split must reproduce exactly the
    per-expert names and shapes transformers makes. Anything else is a layout this package
    does not know (e.g. transposed or w1/w3 experts): fail at setup, never send wrong weights.
    """
    hf = hf_model(model)
    if hf is None:
        return entries
    prefix = next(strip_wrappers(p) for p, m in model.named_modules() if m is hf)
    if prefix:
        log.warning("transformers model nested at %r: checkpoint names not cross-checked", prefix)
        return entries
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(hf, dict(meta))
    by_id = {id(t): n for n, t in reverted.items()}
    want = {n: tuple(t.shape) for n, t in reverted.items()}
    out: list[Entry] = []
    ours: dict[str, tuple[int, ...]] = {}
    for entry in entries:
        if entry.kind == "plain" and (renamed := by_id.get(id(meta[entry.names[0]]))):
            entry = Entry(entry.key, "plain", (renamed,), entry.shapes)
        out.append(entry)
        ours.update(zip(entry.names, entry.shapes, strict=True))
    if ours != want:
        missing = sorted(set(want) - set(ours))[:5]
        extra = sorted(set(ours) - set(want))[:5]
        shapes = sorted(n for n in set(ours) & set(want) if ours[n] != want[n])[:5]
        raise LayoutError(
            f"checkpoint layout differs from transformers' save_pretrained mapping for "
            f"{type(hf).__name__}: missing {missing}, unexpected {extra}, shape differs {shapes}")
    return out
