"""Tensor names, shapes and dtypes of a safetensors checkpoint, read from its headers only."""

from __future__ import annotations

import json
import struct
from pathlib import Path

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
