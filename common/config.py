"""Typed refit configuration; the trainer picks it once and it travels inside the plan."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from common.errors import RefitError


def boolean(raw: str) -> bool:
    """1 / 0, true / false, yes / no, on / off."""
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return word in ("1", "true", "yes", "on")
    raise ValueError(raw)


_ENV = {
    "bucket_bytes": ("REFIT_BUCKET_BYTES", int),
    "num_buffers": ("REFIT_NUM_BUFFERS", int),
    "timeout_s": ("REFIT_TIMEOUT_S", float),
    "alignment": ("REFIT_ALIGNMENT", int),
    "direct_bytes": ("REFIT_DIRECT_BYTES", int),
    "checksum": ("REFIT_CHECKSUM", boolean),
    "shard_to_shard": ("REFIT_SHARD_TO_SHARD", boolean),
}


class RefitConfigError(RefitError, ValueError):
    """A refit setting that cannot work (names the setting and the value)."""


@dataclass(frozen=True)
class RefitConfig:
    """How a refit is cut and run.

    bucket_bytes: payload bytes per bucket (one collective each); a tensor larger than this gets
        a bucket of its own.
    num_buffers: buffers per rank; >= 2 overlaps packing bucket k+1 with broadcasting bucket k.
    timeout_s: every collective of the refit group (and its setup) gives up after this long.
    alignment: byte alignment of each tensor inside a bucket (power of two); 256 keeps every
        unpacked view aligned for any dtype and for vectorised GPU copies.
    direct_bytes: a tensor at least this large gets a bucket of its own and is sent straight
        from its own memory (no pack copy) into the receiver's buffer (zero-copy view); such a
        bucket costs a second, tiny collective for its header (more host time than a packed
        bucket's one), so on GPUs it pays only for large tensors; CPU/gloo, where packing costs
        CPU time, gains from a lower value.
    checksum: the sender stamps each bucket's payload checksum into its header and every
        receiver checks the bytes it received before loading them (`common.wire.checksum`; CPU
        groups; what it costs is measured by `bench/broadcast_bench.py`).
    shard_to_shard: once an engine worker has learned its load map it reports the byte ranges
        it reads, and from the next refit on each bucket reaches it as a compact frame of
        those bytes alone, over a subgroup of the workers with equal needs
        (`common.shard_plan`); off: every worker receives every byte.
    """

    bucket_bytes: int = 256 << 20
    num_buffers: int = 2
    timeout_s: float = 300.0
    alignment: int = 256
    direct_bytes: int = 64 << 20
    checksum: bool = False  # what it costs: bench/results/cpu_checksum_quick_models.json
    shard_to_shard: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> RefitConfigError:
            return RefitConfigError(f"RefitConfig.{field}={getattr(self, field)!r}: {why}")

        for field in ("bucket_bytes", "num_buffers", "alignment", "direct_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(field, "must be an int")
        if self.bucket_bytes < 1024:
            raise bad("bucket_bytes", "must be at least 1024 bytes")
        if self.direct_bytes < 1024:
            raise bad("direct_bytes", "must be at least 1024 bytes")
        if self.num_buffers < 1:
            raise bad("num_buffers", "must be >= 1")
        if self.num_buffers > 16:
            raise bad("num_buffers", "more than 16 buffers only costs memory")
        if self.alignment < 1 or self.alignment & (self.alignment - 1) or self.alignment > 4096:
            raise bad("alignment", "must be a power of two between 1 and 4096")
        for field in ("checksum", "shard_to_shard"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "must be a bool")
        if not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise bad("timeout_s", "must be a positive number of seconds")

    @classmethod
    def from_env(cls, **overrides: object) -> RefitConfig:
        """Defaults, then REFIT_* environment variables, then explicit keyword overrides."""
        values: dict[str, object] = {}
        for field, (var, kind) in _ENV.items():
            raw = os.environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[field] = kind(raw)
            except ValueError:
                raise RefitConfigError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise RefitConfigError(f"unknown RefitConfig fields: {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
