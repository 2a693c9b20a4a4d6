"""Megatron-Core weight source with declarative Megatron -> HF converters (no vllm here)."""

from mcore_refit.arch import CONVERTERS, converter_for
from mcore_refit.convert import Converter, Dims, Rule
from mcore_refit.source import MegatronWeightSource

__all__ = ["CONVERTERS", "Converter", "Dims", "MegatronWeightSource", "Rule", "converter_for"]
