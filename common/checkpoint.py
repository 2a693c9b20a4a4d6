"""Tensor names, shapes and dtypes of a safetensors checkpoint, read from its headers only,
and the one check of a refit plan against such a checkpoint (engines and trainers use it)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from common.plan import TensorSpec, dtype_name

_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def read_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, torch dtype name)} of one .safetensors file, without reading its data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        name: (tuple(meta["shape"]), _DTYPES.get(meta["dtype"], meta["dtype"].lower()))
        for name, meta in header.items()
        if name != "__metadata__"
    }


def checkpoint_tensors(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype name)} over every .safetensors file of a checkpoint folder."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        out.update(read_header(path))
    return out


def engine_dtypes(params: Mapping[str, torch.dtype], checkpoint: Mapping[str, tuple[Any, str]],
                  model_dtype: torch.dtype, quantized: bool) -> Callable[[str], torch.dtype]:
    """The dtype an engine takes each checkpoint tensor in: a param's of the same name (an
    fp32 router bias); from a quantized checkpoint (block FP8) its own dtype, which the
    quantized layers' loaders take as stored (e4m3 weights, fp32 scales under names vLLM
    fuses, such as `q_proj`); else the model dtype."""

    def kept(name: str) -> torch.dtype:
        if name in params:
            return params[name]
        if quantized and name in checkpoint:
            return getattr(torch, checkpoint[name][1])
        return model_dtype

    return kept


def plan_problems(specs: Iterable[TensorSpec], checkpoint: Mapping[str, tuple[Sequence[int], Any]],
                  kept_dtype: Callable[[str], torch.dtype | None] | None = None,
                  holder: str = "the receiver", limit: int = 20) -> list[str]:
    """Every way a plan disagrees with a checkpoint ({name: (shape, ...)}), at most `limit`
    then a count: plan tensors the checkpoint lacks, shapes, floating dtypes where
    `kept_dtype(name)` names the dtype `holder` keeps, and checkpoint tensors the plan lacks
    (their weights would go stale). Empty: the plan fits."""
    specs, problems = list(specs), []
    for spec in specs:
        if spec.name not in checkpoint:
            problems.append(f"tensor {spec.name!r} is not in the checkpoint")
            continue
        shape = tuple(int(n) for n in checkpoint[spec.name][0])
        want = kept_dtype(spec.name) if kept_dtype is not None else None
        if shape != spec.shape:
            problems.append(f"tensor {spec.name!r}: plan shape {list(spec.shape)}, checkpoint "
                            f"shape {list(shape)}")
        elif want is not None and spec.dtype.is_floating_point and spec.dtype != want:
            problems.append(f"tensor {spec.name!r}: plan dtype {dtype_name(spec.dtype)}, "
                            f"{holder} keeps it as {dtype_name(want)}"
                            + _requantized(want, checkpoint[spec.name][1]))
    planned = {spec.name for spec in specs}
    problems += [f"checkpoint tensor {n!r} is not in the plan (its weight would go stale)"
                 for n in checkpoint if n not in planned]
    if len(problems) > limit:
        problems = [*problems[:limit], f"... and {len(problems) - limit} more"]
    return problems


def _requantized(kept: torch.dtype, stored: Any) -> str:
    """Why an engine holds in FP8 a tensor its checkpoint stores unquantized, or ''."""
    if kept.is_floating_point and kept.itemsize == 1 and not str(stored).startswith("float8"):
        return (f", though the checkpoint stores it as {stored}: vLLM quantizes every linear "
                "layer the quantization_config does not list in modules_to_not_convert (or "
                "ignored_layers); FP8 checkpoints list their MoE routers there")
    return ""
