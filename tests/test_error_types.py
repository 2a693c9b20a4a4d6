"""Every error class the library defines is a `RefitError`, so one `except RefitError` catches
every refit failure. Checked in a fresh interpreter (importing every module pulls in vLLM and
megatron-core, which this test process should not carry)."""

from __future__ import annotations

import json
import subprocess
import sys

_WALK = """
import importlib, inspect, json, pkgutil
from common.errors import RefitError
found = {}
for package in ("common", "dtensor_refit", "mcore_refit"):
    names = [package] + [i.name for i in pkgutil.walk_packages(
        importlib.import_module(package).__path__, package + ".")]
    for module in map(importlib.import_module, names):
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, BaseException):
                found[f"{module.__name__}.{name}"] = issubclass(cls, RefitError)
print(json.dumps(found))
"""


def test_every_library_error_class_is_a_refit_error() -> None:
    run = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(found) >= 10, sorted(found)  # the walk reached the modules that define them
    outside = sorted(name for name, under in found.items() if not under)
    assert not outside, f"error classes not under RefitError: {outside}"
