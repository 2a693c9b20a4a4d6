"""The learned load map's life in a worker: pick it or learn it, check it, drop it.

A mixin of `RefitTransferEngine` (its `model`, `receiver`, `fixes`, `direct` and
`apply_report`), kept apart from the refit's own steps in `backend.py`.
"""

from __future__ import annotations

import logging
import os
import time

from common.errors import NeedsRefusedError
from common.in_vllm.apply import DirectLoad
from common.in_vllm.load_map import CopyRecorder
from common.in_vllm.map_check import Kept, check_map, reload_kept
from common.in_vllm.map_learn import learn
from common.kernels import native

log = logging.getLogger(__name__)


class LoadMapSteps:
    """The steps of the load map (REFIT_APPLY=direct) a worker takes around its refits."""

    def _pick_path(self) -> tuple[DirectLoad | None, CopyRecorder | None]:
        """The learned map to apply this refit with, or a recorder to learn it from this
        refit's `load_weights` (neither: REFIT_APPLY=load_weights, or no native memcpy)."""
        if self.apply_report["path"] != "direct":
            return None, None
        if self.direct is not None:
            why = self.direct.stale()
            if why is None:
                return self.direct, None
            log.warning("%s: relearning the load map: %s", self.receiver.group.label, why)
            self.direct = None
        if native.load() is None:
            log.warning("%s: no native memcpy here: every refit uses load_weights",
                        self.receiver.group.label)
            self.apply_report["path"] = "load_weights"
            return None, None
        return None, CopyRecorder({m: p for p, m in self.model.named_modules()})

    def _learn(self, recorder: CopyRecorder, kept: Kept | None) -> None:
        """Build the map from the refit `recorder` watched and check it against that refit's
        loads (`kept` bytes; None: REFIT_VERIFY_MAP=0); a failure keeps `load_weights`."""
        t0, label = time.perf_counter(), self.receiver.group.label
        try:
            kept_bytes = kept.processing.kept_bytes(self.model) if kept else frozenset()
            self.direct = learn(self.model, self.receiver.plan, recorder, kept_bytes)
        except Exception:  # noqa: BLE001 - the refit itself landed
            log.exception("%s: learning the load map failed; staying on load_weights", label)
            return
        r = self.direct.report
        self.apply_report.update(r, learn_s=time.perf_counter() - t0)
        log.info("%s: load map learned: %d tensors (%.1f MB) copied directly, %d (%.1f MB) "
                 "through load_weights%s", label, r["direct_tensors"], r["direct_bytes"] / 1e6,
                 r["fallback_tensors"], r["fallback_bytes"] / 1e6,
                 f", because: {r['fallback_reasons']}" if r["fallback_tensors"] else "")
        if kept is not None:
            self._check_map(kept)
        self._report_needs()

    def _check_map(self, kept: Kept) -> None:
        """The map re-applies the learning refit's bytes; any difference drops it (and the
        bytes are loaded again through the loaders: the engine ends on their result)."""
        t0, label = time.perf_counter(), self.receiver.group.label

        try:
            check = check_map(self.direct, self.model, kept, self.fixes.after_load)
            why = f"{len(check.differ)} param(s) differ, e.g. {check.differ[0]!r}" \
                if check.differ else None
        except Exception as e:  # noqa: BLE001 - reported as the reason the map is dropped
            why = f"re-applying failed: {type(e).__name__}: {e}"
        if why is None:
            self.apply_report.update(verified=check.compared, unreadable=check.unreadable,
                                     processed=check.processed,
                                     check_s=time.perf_counter() - t0)
            log.info("%s: load map checked: %d params bit for bit as the loaders left them "
                     "(%d filled params unreadable), %d layers' processing given the loaders' "
                     "bytes", label, check.compared, check.unreadable, check.processed)
            return
        log.error("%s: the load map does not reproduce load_weights (%s); every refit stays "
                  "on load_weights", label, why)
        self.direct = None
        self.apply_report = {"path": "load_weights", "map_rejected": why}
        reload_kept(self.model, self.receiver.plan, kept, self.model_config,
                    self.fixes.after_load)

    def _drop_refused_map(self, error: NeedsRefusedError) -> None:
        """The trainers refused this worker's needs: drop its map, so the next refit takes
        whole buckets and relearns it."""
        if self.receiver.group.rank in error.ranks:
            log.error("%s: the trainers refused this worker's needs; dropping its load map "
                      "(the next refit relearns it)", self.receiver.group.label)
            self.direct, self.apply_report = None, {"path": apply_mode()}

    def _report_needs(self) -> None:
        """What this worker reads of each bucket, for the refits to come: its learned map's
        needs, or None (every byte) without one or with REFIT_SHARD_TO_SHARD=0 here."""
        on = self.direct is not None and shard_to_shard()
        self.receiver.needs = self.direct.need if on else None
        self.apply_report["needs_reported"] = on


def apply_mode() -> str:
    """REFIT_APPLY: "direct" (default: learn the load map on the first refit, then copy) or
    "load_weights" (every refit through vLLM's loaders)."""
    mode = os.environ.get("REFIT_APPLY", "direct")
    if mode not in ("direct", "load_weights"):
        raise ValueError(f"REFIT_APPLY={mode!r}: use 'direct' or 'load_weights'")
    return mode


def shard_to_shard() -> bool:
    """REFIT_SHARD_TO_SHARD (default 1): report this worker's needs once its map is learned
    (where the trainers' plan allows it, `RefitConfig.shard_to_shard`); 0: take every byte."""
    return os.environ.get("REFIT_SHARD_TO_SHARD", "1") != "0"


def verify_map() -> bool:
    """REFIT_VERIFY_MAP (default 1): check a learned map against its refit's loads."""
    return os.environ.get("REFIT_VERIFY_MAP", "1") != "0"
