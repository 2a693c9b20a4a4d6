"""The fault soak's short variant (`bench/fault_soak.py`): refits over a real gloo group with
random faults (drift, a flipped byte, a loader error, a receiver or trainer killed). No hang,
no silently wrong weight, every fault detected on every surviving rank, a death felt within
seconds although the timeout is 60 s, and the group rebuilt after each death."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from fault_soak import DEATHS, FAULTS, soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_short_fault_soak_has_no_hang_and_no_wrong_weight() -> None:
    report = soak(refits=24, seed=3, timeout_s=60.0)
    counts = report["counts"]
    print(report)
    faults = sum(counts.get(f"fault:{f}", 0) for f in FAULTS if f != "none")
    assert counts["refits"] == 24 and counts.get("hangs", 0) == 0, report
    assert counts.get("wrong_weights", 0) == 0, report
    assert counts.get("detected", 0) == faults > 0, report
    assert counts.get("landed", 0) == counts["refits"] - faults, report
    assert any(counts.get(f"fault:{d}", 0) for d in DEATHS), "the seed injects no death"
    assert counts.get("restarts", 0) >= 1
    for death in DEATHS:
        assert report["slowest_detect_s"].get(death, 0.0) < 5.0, report
