"""The engine's refit state (`common.engine.state`): how a failure is classified, what is
refused, how workers' states combine, when an engine resumes by itself. The states are what
the `-k survives` tests read from real servers; here each rule on its own."""

from __future__ import annotations

import pytest

from common.engine.state import RefitState, engine_state, resumes_after
from common.errors import NOTHING_LOADED, ROLLED_BACK, RefitError

HELD = RefitState(version=4)


def _failed(message: str, touched: bool = True) -> RefitState:
    return HELD.started().after_failure(5, RefitError(message), touched, base=4)


def test_engine_state_failure_phases() -> None:
    assert _failed("peer died").phase == "mixed"
    assert _failed(f"peer died; {ROLLED_BACK} (v4)").phase == "rolled_back"
    assert _failed(f"refused; {NOTHING_LOADED}").phase == "complete"
    assert _failed("version not newer", touched=False).phase == "complete"
    mixed = _failed("peer died")
    assert (mixed.version, mixed.failed, mixed.base) == (4, 5, 4)
    assert "RefitError: peer died" in mixed.why


def test_engine_state_landing_and_finish_move_the_version() -> None:
    landed = HELD.started().after_landing(5, base=5)
    assert (landed.phase, landed.version, landed.landed) == ("landed", 4, 5)
    done = landed.after_finish()
    assert (done.phase, done.version, done.landed) == ("complete", 5, None)


def test_engine_state_refusals_name_both_versions() -> None:
    why = _failed("peer died").refusal("serve")
    assert "refit v5 failed" in why and "last complete: v4" in why and "peer died" in why
    assert _failed("peer died").refusal("resume").startswith("refusing to resume")
    landed = HELD.started().after_landing(5, base=None)
    assert landed.refusal("serve") is None  # paused: requests queue until the resume
    assert "landed but was not finished" in landed.refusal("resume")
    assert "in progress" in HELD.started().refusal("resume")
    for servable in (HELD, _failed(f"x; {ROLLED_BACK}")):
        assert servable.refusal("serve") is None and servable.refusal("resume") is None
    unknown = RefitState(phase="mixed", why="no reply")
    assert "unknown" in unknown.refusal("serve")


def test_engine_state_combines_workers() -> None:
    mixed = _failed("peer died")
    assert engine_state([HELD.as_dict(), mixed.as_dict()]) == mixed
    assert engine_state([HELD.as_dict(), HELD.as_dict()]) == HELD
    disagree = engine_state([HELD.as_dict(), RefitState(version=5).as_dict()])
    assert disagree.phase == "mixed" and "disagree" in disagree.why
    # a worker unseen (a data-parallel replica not asked) may hold other weights
    short = engine_state([HELD.as_dict(), HELD.as_dict()], expected=4)
    assert short.phase == "mixed" and "only 2 of its 4 workers" in short.why
    assert short.refusal("serve") is not None
    assert engine_state([HELD.as_dict()] * 4, expected=4) == HELD
    with pytest.raises(ValueError, match="no worker"):
        engine_state([])
    assert RefitState.from_dict({**HELD.as_dict(), "added_later": 1}) == HELD


def test_engine_state_resumes_after_its_own_rollback_only(monkeypatch) -> None:
    refitting, rolled = HELD.started(), _failed(f"x; {ROLLED_BACK}")
    assert resumes_after(refitting, rolled)
    assert not resumes_after(rolled, rolled)  # an earlier rollback: not this call's
    assert not resumes_after(refitting, _failed("peer died"))
    monkeypatch.setenv("REFIT_ROLLBACK_RESUME", "0")
    assert not resumes_after(refitting, rolled)
    monkeypatch.setenv("REFIT_ROLLBACK_RESUME", "yes")
    with pytest.raises(ValueError, match="REFIT_ROLLBACK_RESUME"):
        resumes_after(refitting, rolled)
