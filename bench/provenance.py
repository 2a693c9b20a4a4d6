"""Where a benchmark result was measured: the commit and the machine, stamped into every results
file a benchmark writes (`save`), so each figure in `bench/results/` says what produced it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """REFIT_COMMIT where set (the device machine gets a copy of the tree whose .git, if any,
    is not this checkout's); else the checkout's HEAD (with "-dirty" when tracked files differ
    from it), or "unknown" without git."""
    if named := os.environ.get("REFIT_COMMIT"):
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=30,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance() -> dict[str, Any]:
    """The commit, when, and the machine: CPU, cores, GPUs, torch."""
    cuda = torch.cuda.is_available()
    return {"commit": commit(), "measured_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__}


def save(report: dict[str, Any], out: str | os.PathLike | None) -> None:
    """Stamp `report` with its provenance and, if `out`, write it there (indented JSON)."""
    report["provenance"] = provenance()
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")


def finish(report: dict[str, Any], summary: dict[str, Any], out: str | os.PathLike | None) -> None:
    """A benchmark's end: `summary` into `report`, saved (`save`), and printed as the last
    line, one JSON object."""
    report["summary"] = summary
    save(report, out)
    print(json.dumps(summary))


def bench_args(doc: str, gpu: str, profile: bool = False) -> argparse.Namespace:
    """The options of a benchmark with a CPU and a GPU part: --quick, --gpu (`gpu` says what
    it runs), --out; `profile`: --profile N too (see `profiling.profile_call`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs (CPU under 5 minutes)")
    ap.add_argument("--gpu", action="store_true", help=gpu)
    if profile:
        ap.add_argument("--profile", type=int, default=0,
                        help="then profile one more refit: its N costliest calls to stderr")
    ap.add_argument("--out", help="write the JSON report here")
    return ap.parse_args()
