"""Which dtype each tensor reaches the inference engine in: one policy for every weight source.

The policy, not the training tensor, decides the declared dtype: a trainer that ran
`model.to(torch.bfloat16)` has silently turned DeepSeek-V3's fp32 router bias
(`e_score_correction_bias`) into bf16, yet vLLM keeps that bias in fp32 and routes experts
with it, so it must still be declared (and sent) as fp32. Sources list specs through the
policy (so the plan is the same whatever the training dtypes are) and cast to the plan's dtype
on yield.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

#: Tensors that stay fp32 by default: routers whose small bias differences decide the experts.
DEFAULT_KEEP_FP32: tuple[str, ...] = (r"(^|\.)e_score_correction_bias$",)


@dataclass(frozen=True)
class DtypePolicy:
    """Cast floating tensors to `dtype`, except names matching `keep_fp32` (regex, re.search,
    on the HF name), which are declared fp32.

    `dtype=None` keeps each floating tensor's own dtype (still applying `keep_fp32`).
    Non-floating tensors (ints, bools) keep their own dtype: casting them would change values.
    `extra_fp32` adds patterns to the defaults; pass `keep_fp32=()` to drop the defaults.
    """

    dtype: torch.dtype | None = torch.bfloat16
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    extra_fp32: tuple[str, ...] = ()
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype)
                                       or not self.dtype.is_floating_point):
            raise ValueError(f"DtypePolicy.dtype must be a floating dtype or None, "
                             f"got {self.dtype!r}")
        patterns = tuple(self.keep_fp32) + tuple(self.extra_fp32)
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        object.__setattr__(self, "extra_fp32", tuple(self.extra_fp32))
        object.__setattr__(self, "_compiled", tuple(re.compile(p) for p in patterns))

    @classmethod
    def of(cls, dtype: torch.dtype | None, fp32: Iterable[str] = ()) -> DtypePolicy:
        """Defaults plus the user's fp32 name patterns."""
        return cls(dtype=dtype, extra_fp32=tuple(fp32))

    @classmethod
    def as_given(cls) -> DtypePolicy:
        """Every tensor in the dtype it has when the specs are listed (no casts, no fp32 rule)."""
        return cls(dtype=None, keep_fp32=())

    def keeps_fp32(self, name: str) -> bool:
        return any(p.search(name) for p in self._compiled)

    def dtype_for(self, name: str, current: torch.dtype) -> torch.dtype:
        """The declared dtype of HF tensor `name` whose training dtype is `current`."""
        if not current.is_floating_point:
            return current
        if self.keeps_fp32(name):
            return torch.float32
        return current if self.dtype is None else self.dtype
