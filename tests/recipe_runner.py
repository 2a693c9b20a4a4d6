"""Run a recipe script as its users do (under torchrun when `nproc` is given) and read the
JSON its `--result` flag wrote; a failure shows the script's last output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(script: str, *flags: str, result: Path, nproc: int | None = None,
               timeout_s: float = 420, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """`script` with `flags --result result` (and `env` added to this process's); returns
    (the result JSON, stdout + stderr)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(nproc)] if nproc else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_ADDRESS": "",
           **(env or {})}
    proc = subprocess.run([*launcher, script, *flags, "--result", str(result)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{out[-6000:]}"
    return json.loads(result.read_text()), out
