"""Name -> (shape, dtype) of a HF checkpoint folder, from the safetensors headers alone.

Lets a plan be checked against the checkpoint a vLLM engine was started from (the names and
shapes `load_weights` will accept) without reading a single tensor: each `.safetensors` file
starts with an 8-byte little-endian header length and a JSON header of
`{name: {"dtype", "shape", "data_offsets"}}`. Nothing here is training-specific; it belongs in
common/ once the receiver side wants it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from common.plan import TensorSpec

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: str | Path) -> dict[str, dict]:
    """The JSON header of one safetensors file (tensor entries only, no `__metadata__`)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_specs(folder: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} over every `*.safetensors` file of a checkpoint folder."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in out:
                raise ValueError(f"{name!r} is stored twice in {folder}")
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path.name}: {name!r} has unknown dtype {info['dtype']!r}")
            out[name] = (tuple(int(s) for s in info["shape"]), dtype)
    return out


def compare_with_checkpoint(
    specs: Iterable[TensorSpec],
    checkpoint: dict[str, tuple[tuple[int, ...], torch.dtype]],
    check_dtype: bool = False,
) -> list[str]:
    """Every way `specs` disagrees with `checkpoint` (names both ways, shapes; dtypes if asked).

    Dtypes are not compared by default: a checkpoint saved from a bf16 model stores the router
    bias in bf16 while the refit declares it fp32 (vLLM keeps it fp32), and the inference dtype
    may legitimately differ from the stored one. An empty list means the plan fits.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        seen.add(spec.name)
        if spec.name not in checkpoint:
            problems.append(f"{spec.name!r} is not in the checkpoint")
            continue
        shape, dtype = checkpoint[spec.name]
        if shape != spec.shape:
            problems.append(f"{spec.name!r}: shape {list(spec.shape)}, checkpoint {list(shape)}")
        elif check_dtype and dtype != spec.dtype:
            problems.append(f"{spec.name!r}: dtype {spec.dtype}, checkpoint {dtype}")
    problems += [f"checkpoint tensor {n!r} is not in the plan" for n in checkpoint
                 if n not in seen]
    return problems
