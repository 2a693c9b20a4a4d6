"""Megatron-Core weight source with declarative Megatron -> HF converters (no vllm here).

The converters' rule tables import without megatron-core (to read or test them anywhere);
`MegatronWeightSource` imports it when first used. `DtypePolicy` is `common.dtype_policy`'s,
the one policy every weight source takes.
"""

from typing import Any

from common.dtype_policy import DtypePolicy
from mcore_refit.arch import CONVERTERS, converter_for
from mcore_refit.convert import Converter, Dims, Rule


def __getattr__(name: str) -> Any:
    if name == "MegatronWeightSource":
        from mcore_refit.source import MegatronWeightSource

        return MegatronWeightSource
    raise AttributeError(f"module 'mcore_refit' has no attribute {name!r}")


__all__ = ["CONVERTERS", "Converter", "Dims", "DtypePolicy", "MegatronWeightSource", "Rule",
           "converter_for"]
