"""Per-architecture conversion tables, by HF `model_type`."""

from __future__ import annotations

from common.errors import ConversionError
from mcore_refit.arch.deepseek_v3 import DEEPSEEK_V3
from mcore_refit.arch.llama import LLAMA
from mcore_refit.arch.qwen2 import QWEN2
from mcore_refit.arch.qwen3 import QWEN3
from mcore_refit.arch.qwen3_moe import QWEN3_MOE
from mcore_refit.convert import Converter

CONVERTERS: dict[str, Converter] = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
}


def converter_for(model_type: str) -> Converter:
    try:
        return CONVERTERS[model_type]
    except KeyError:
        raise ConversionError(f"no Megatron converter for model_type {model_type!r}; "
                              f"known: {sorted(CONVERTERS)}") from None
