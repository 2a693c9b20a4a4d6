"""What an engine holds, as its workers know it: the engine's own refit state.

Every worker's refit backend (`common.in_vllm.backend`) keeps a `RefitState`; it changes only
inside the weight-transfer calls, so it outlives any trainer. The engine reads it from its
workers (`refit_state`, `common.in_vllm.worker_ext`) to refuse to serve mixed weights
(`common.in_vllm.serve_guard` for `vllm serve`, the hosts for `LLM` / `AsyncLLM`), and a
joining trainer's `EngineClient` adopts it. Plain data: both sides import it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from common.errors import NOTHING_LOADED, ROLLED_BACK

# complete: one whole version (`version`); refitting: a refit started (`receiving` while its
# bytes arrive); landed: refit `landed` is in on every worker, its finish (the version's
# commit) not done yet; mixed: refit `failed` loaded part of its bytes and was not rolled back;
# rolled_back: refit `failed` was undone, the engine holds `version` again.
PHASES = ("complete", "refitting", "landed", "mixed", "rolled_back")
SERVABLE = ("complete", "rolled_back")


@dataclass(frozen=True)
class RefitState:
    """One worker's (or a whole engine's) refit state; `version` None: the checkpoint the
    engine was started from. `failed` / `why`: the last refit that failed (also after a
    complete one failed before loading a byte: for the record). `base`: the version the
    worker's base holds (deltas go on it, a rollback restores it), None if none."""

    phase: str = "complete"
    version: int | None = None
    receiving: bool = False
    landed: int | None = None
    failed: int | None = None
    why: str = ""
    base: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RefitState:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def started(self) -> RefitState:
        return dataclasses.replace(self, phase="refitting", receiving=False, landed=None)

    def after_landing(self, version: int, base: int | None) -> RefitState:
        return dataclasses.replace(self, phase="landed", receiving=False, landed=version,
                                   base=base)

    def after_finish(self) -> RefitState:
        return dataclasses.replace(self, phase="complete", version=self.landed, landed=None)

    def after_failure(self, version: int, error: BaseException, touched: bool,
                      base: int | None) -> RefitState:
        """Refit `version` failed with `error`; `touched`: its bytes had begun to arrive.
        Its phase: complete again when nothing was loaded on any worker (every worker's
        message says so) or nothing had arrived, rolled_back when every worker of this
        engine restored its last version, else mixed."""
        text = f"{type(error).__name__}: {error}"
        if not touched or NOTHING_LOADED in text:
            phase = "complete"
        else:
            phase = "rolled_back" if ROLLED_BACK in text else "mixed"
        return dataclasses.replace(self, phase=phase, receiving=False, landed=None,
                                   failed=version, why=text, base=base)

    def label(self) -> str:
        return "its starting checkpoint" if self.version is None else f"v{self.version}"

    def refusal(self, action: str) -> str | None:
        """Why this engine must not `action` ("serve" or "resume") now, or None."""
        if self.phase == "mixed" and self.failed is None:
            return f"refusing to {action}: its refit state is unknown ({self.why})"
        if self.phase == "mixed":
            return (f"refusing to {action}: refit v{self.failed} failed after loading part of "
                    f"its weights and was not rolled back, so the engine holds a mix of "
                    f"versions (last complete: {self.label()}); a refit must land first. "
                    f"Cause: {self.why}")
        if action == "resume" and self.phase == "landed":
            return (f"refusing to resume: refit v{self.landed} landed but was not finished "
                    f"(finish_weight_update commits its version; the engine still reports "
                    f"{self.label()})")
        if action == "resume" and self.phase == "refitting":
            return "refusing to resume: a refit is in progress (it has not landed)"
        return None


def engine_state(workers: list[dict[str, Any]], expected: int | None = None) -> RefitState:
    """The engine's state from its workers' (they agree by construction: every verdict goes
    to every worker); workers that disagree on their weights make it mixed, and so does a
    reply count other than `expected` (workers unseen may hold other weights)."""
    states = [RefitState.from_dict(w) for w in workers]
    if not states:
        raise ValueError("no worker reported a refit state (is the refit backend configured?)")
    if expected is not None and len(states) != expected:
        return RefitState(phase="mixed", why=f"only {len(states)} of its {expected} workers "
                          f"reported their refit state")
    first = states[0]
    for phase in ("mixed", "refitting", "landed"):
        if any(s.phase == phase for s in states):
            return next(s for s in states if s.phase == phase)
    if any((s.phase, s.version) != (first.phase, first.version) for s in states):
        seen = sorted({f"{s.phase} {s.label()}" for s in states})
        return dataclasses.replace(first, phase="mixed", failed=first.failed,
                                   why=f"its workers disagree on what they hold: {seen}")
    return first


def resumes_after(before: RefitState, after: RefitState) -> bool:
    """Whether an engine resumes by itself after an update call that took it from `before` to
    `after`: the refit it started failed and every worker rolled it back, and
    REFIT_ROLLBACK_RESUME allows it."""
    return before.phase == "refitting" and after.phase == "rolled_back" and \
        resume_after_rollback()


def resume_after_rollback() -> bool:
    """REFIT_ROLLBACK_RESUME: whether an engine whose failed refit every worker rolled back
    resumes serving by itself ("1", the default) or stays paused for its trainer ("0")."""
    value = os.environ.get("REFIT_ROLLBACK_RESUME", "1")
    if value not in ("0", "1"):
        raise ValueError(f"REFIT_ROLLBACK_RESUME={value!r}: use '1' (resume) or '0' (stay "
                         f"paused)")
    return value == "1"
