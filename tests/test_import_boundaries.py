"""The import rules the layout promises, checked in fresh interpreters where the forbidden
packages cannot be imported at all (a meta-path finder refuses them):

- `common/` imports neither vllm nor megatron at import time (only its `vllm_*` modules,
  which run inside vLLM processes, import vllm);
- the DTensor path never imports megatron (nor vllm);
- the Megatron converters' rule tables import without megatron-core (the source imports it
  when first used) and without vllm;
- tests import the recipes' fixtures, never the reverse: nothing outside `tests/` imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMON = sorted(p.stem for p in (ROOT / "common").glob("*.py")
                if p.stem != "__init__" and not p.stem.startswith("vllm_"))


def _import_without(blocked: tuple[str, ...], modules: list[str]) -> subprocess.CompletedProcess:
    code = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("refused: " + name)
sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    __import__(module)
"""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("case", ["common", "dtensor", "mcore_tables"])
def test_modules_import_without_the_packages_they_must_not_need(case: str) -> None:
    modules, blocked = {
        "common": ([f"common.{m}" for m in COMMON], ("vllm", "megatron")),
        "dtensor": (["dtensor_refit", "dtensor_refit.source", "dtensor_refit.stages"],
                    ("vllm", "megatron")),
        "mcore_tables": (["mcore_refit", "mcore_refit.arch", "mcore_refit.convert"],
                         ("vllm", "megatron", "transformer_engine")),
    }[case]
    assert len(modules) >= 3
    done = _import_without(blocked, modules)
    assert done.returncode == 0, done.stderr[-2000:]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_nothing_outside_tests_imports_the_tests() -> None:
    files = [p for d in ("common", "dtensor_refit", "mcore_refit", "recipes", "bench")
             for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50 and any(p.name == "rank_runner.py" for p in files)
    offenders = sorted(str(p.relative_to(ROOT)) for p in files if "tests" in _imported_roots(p))
    assert not offenders, f"these import from tests/: {offenders}"

