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
    "delta": ("REFIT_DELTA", boolean),
    "undo_bytes": ("REFIT_UNDO_BYTES", int),
    "shadow": ("REFIT_SHADOW", str),
    "interleave": ("REFIT_INTERLEAVE", boolean),
    "graph_send": ("REFIT_GRAPH_SEND", boolean),
    "concurrent_sources": ("REFIT_CONCURRENT_SOURCES", boolean),
    "receive_buffers": ("REFIT_RECEIVE_BUFFERS", int),
}
SHADOW_PLACES = ("device", "host")
# Settings each trainer keeps for itself: not in the plan that rank 0 sends at setup.
LOCAL_SETTINGS = ("shadow", "graph_send")


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
        (`common.shard.plan`); off: every worker receives every byte.
    delta: each trainer keeps the bytes it last sent (its shadow) and each engine worker the
        bytes it last loaded (its base); a refit then sends, per frame, only the 2-byte words
        that changed (`common.delta.codec`), or the whole frame where that is not smaller, and goes
        whole to a need-set whose members do not all hold the trainers' base
        (`common.delta.frames`). Costs each trainer a copy of the frames it sources and each
        worker a copy of what it receives.
    undo_bytes: each engine worker's undo log: before a refit overwrites its base it keeps
        what it replaces (a delta frame: the delta; a whole frame: the old bytes) up to this
        many bytes, so a refit that fails anywhere is rolled back and the engine keeps serving
        the last complete version (`common.delta.store`); 0: no undo log (a failed refit
        leaves the engine refusing to serve until a refit lands). Workers keep a base when
        `delta` or `undo_bytes` asks for one.
    interleave: the plan takes the buckets of its source ranks in turn (each rank's own order
        kept) instead of in the order the specs are listed, so a rank gathers and packs its
        next bucket while another rank's is on the wire (pipeline stages, expert owners: each
        source holds a contiguous slice of the list); `common.plan.interleave`. Sources yield
        in plan order, so any order works; what it gains at scale: docs/at-scale.md.
    shadow: where a trainer keeps its shadow: "device" (fastest) or "host" (pinned host memory,
        for memory-tight trainers; a copy to the device per frame). Local to each trainer.
    graph_send: on CUDA (NCCL, the default), each whole frame this trainer sources goes as a
        CUDA graph replay: its pack, header, checksum and broadcast captured once per bucket,
        frames of a dict's tensors in runs of up to `num_buffers` + 1 a launch
        (`common.transfer.graph_frames`), so a bucket costs a fraction of one host call
        instead of several; frames that cannot (compact, delta, direct, an ABORT) and every
        frame of a group that cannot capture (gloo) go eagerly. False (`REFIT_GRAPH_SEND=0`):
        every frame eagerly, its pack on a stream of its own beside the broadcast (what a
        wire much slower than the pack may prefer: docs/architecture.md). Local to each
        trainer; the receivers need nothing.
    concurrent_sources: where the plan has two or more source ranks, each source's buckets
        form its own stream, sent over communicators that hold only that source and the
        workers that receive them, all sources at once (`common.transfer.schedule`). False
        (`REFIT_CONCURRENT_SOURCES=0`): one ordered stream, every trainer in every frame's
        group. Travels in the plan (both sides must run the same protocol), outside its digest.
    receive_buffers: with concurrent sources, the buffers each engine worker keeps (frames in
        flight into it at once, from any source): `num_buffers` per source up to this many
        (never fewer than `num_buffers`). Each is a bucket's size: it bounds a worker's
        memory however many sources there are. Travels in the plan, outside its digest.
    """

    bucket_bytes: int = 256 << 20
    num_buffers: int = 2
    timeout_s: float = 300.0
    alignment: int = 256
    direct_bytes: int = 64 << 20
    checksum: bool = False  # what it costs: bench/results/cpu_checksum_quick_models.json
    shard_to_shard: bool = True
    delta: bool = False
    undo_bytes: int = 0
    shadow: str = "device"
    interleave: bool = False
    graph_send: bool = True
    concurrent_sources: bool = True
    receive_buffers: int = 8

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> RefitConfigError:
            return RefitConfigError(f"RefitConfig.{field}={getattr(self, field)!r}: {why}")

        for field in ("bucket_bytes", "num_buffers", "alignment", "direct_bytes", "undo_bytes",
                      "receive_buffers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(field, "must be an int")
        if self.bucket_bytes < 1024:
            raise bad("bucket_bytes", "must be at least 1024 bytes")
        if self.direct_bytes < 1024:
            raise bad("direct_bytes", "must be at least 1024 bytes")
        if self.undo_bytes < 0:
            raise bad("undo_bytes", "must be >= 0 (0: no undo log)")
        if self.shadow not in SHADOW_PLACES:
            raise bad("shadow", f"must be one of {SHADOW_PLACES}")
        if self.num_buffers < 1:
            raise bad("num_buffers", "must be >= 1")
        if self.num_buffers > 16:
            raise bad("num_buffers", "more than 16 buffers only costs memory")
        if not 1 <= self.receive_buffers <= 64:
            raise bad("receive_buffers", "must be between 1 and 64")
        if self.alignment < 1 or self.alignment & (self.alignment - 1) or self.alignment > 4096:
            raise bad("alignment", "must be a power of two between 1 and 4096")
        for field in ("checksum", "shard_to_shard", "delta", "interleave", "graph_send",
                      "concurrent_sources"):
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
