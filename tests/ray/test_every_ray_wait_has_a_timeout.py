"""Every `ray.get` / `ray.wait` in the library and its recipes passes a timeout: a dead or
stuck actor must turn into an error naming it, never a hang of the driver."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ray_waits_without_timeout(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"
                and node.func.attr in ("get", "wait")
                and not any(k.arg == "timeout" for k in node.keywords)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_ray_get_and_wait_has_a_timeout() -> None:
    files = [f for d in ("common", "recipes") for f in sorted((ROOT / d).glob("*.py"))]
    assert any("ray.get(" in f.read_text() for f in files)  # the check sees the calls
    missing = [hit for f in files for hit in ray_waits_without_timeout(f)]
    assert missing == [], f"ray.get / ray.wait without a timeout: {missing}"
