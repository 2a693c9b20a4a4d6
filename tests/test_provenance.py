"""Every results file a benchmark writes says what produced it: the commit (dirty or not, or
REFIT_COMMIT where it is set: the device machine's tree is a copy) and the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import provenance  # noqa: E402


def test_a_saved_result_carries_the_commit_and_the_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("REFIT_COMMIT", raising=False)
    out = tmp_path / "results" / "x.json"
    provenance.save({"figure": 1.5}, out)
    saved = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    stamp = saved["provenance"]
    assert saved["figure"] == 1.5 and stamp["commit"].split("-")[0] == head, stamp
    assert stamp["cpu_model"] and stamp["cpu_cores"] >= 1 and stamp["torch"], stamp
    assert stamp["measured_utc"].endswith("+00:00"), stamp


def test_refit_commit_names_the_commit_with_or_without_git(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REFIT_COMMIT", "abc123")
    assert provenance.commit() == "abc123"  # a copy whose .git is not the measured tree's
    monkeypatch.setattr(provenance, "ROOT", tmp_path)  # no repository here
    assert provenance.commit() == "abc123"
    monkeypatch.delenv("REFIT_COMMIT")
    assert provenance.commit() == "unknown"
