"""The import rules the layout promises.

By AST, every import of every module (function-level ones included), per room of `common/`:
the rooms form layers (`errors`, `engine` < `kernels` < `wire` < the core < `shard` < `delta`
< `transfer` < `in_vllm` | `clients` < `launch`): a room imports only rooms below it,
`in_vllm` and `clients` never each other; nothing outside `in_vllm` imports vllm (`refit`,
the public package, included); nothing in `common/` or the DTensor path imports megatron.
Hosts that run inside vLLM are launched by name (a string), which no import sees. The core
keeps at most TOP_FILES_MAX files at the top of `common/`.

In fresh interpreters where the forbidden packages cannot be imported at all (a meta-path
finder refuses them): every module outside `in_vllm` imports without vllm and megatron; the
DTensor path without megatron; the Megatron rule tables without megatron-core and vllm. Tests
import the recipes' fixtures, never the reverse.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("kernels", "wire", "engine", "shard", "delta", "transfer", "quant", "in_vllm",
         "clients", "launch")
_BELOW_TRANSFER = {"kernels", "wire", "core", "shard", "delta", "transfer", "engine", "quant"}
# room -> the rooms it may import (besides `errors`, the leaf every room may import)
ALLOWED = {"errors": set(), "kernels": set(), "wire": {"kernels"}, "engine": set(),
           "core": {"kernels", "wire"}, "shard": {"kernels", "wire", "core"},
           "delta": {"kernels", "wire", "core", "shard"},
           "transfer": {"kernels", "wire", "core", "shard", "delta"}, "quant": {"core", "kernels"},
           "in_vllm": _BELOW_TRANSFER, "clients": _BELOW_TRANSFER,
           "launch": _BELOW_TRANSFER | {"clients"}}
TOP_FILES_MAX = 12  # .py files at the top of common/ (the core); the rest live in rooms


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str | None:
    """The room of a `common` module ("core" for the top level), None outside `common`."""
    parts = module.split(".")
    if parts[0] != "common":
        return None
    if len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    return "errors" if parts[1:2] == ["errors"] else "core"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports anywhere in its body (`from a import b`: `a.b`, which for a
    name that is not a module only adds a name under a module already counted)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _modules(*dirs: str) -> dict[str, Path]:
    return {module_name(p): p for d in dirs for p in (ROOT / d).rglob("*.py")}


def boundary_problems(files: dict[str, Path]) -> list[str]:
    """Each import that breaks a rule, as "module imports X (why)"."""
    problems = []
    for module, path in sorted(files.items()):
        room = room_of(module)
        for target in sorted(imported_modules(path)):
            top = target.split(".")[0]
            if top == "vllm" and room != "in_vllm":
                problems.append(f"{module} imports {target} (only common.in_vllm imports vllm)")
            if top == "megatron" and (room is not None or module.startswith("dtensor_refit")):
                problems.append(f"{module} imports {target} (megatron stays in mcore_refit)")
            to = room_of(target) if top == "common" else None
            if room and to and to != room and to != "errors" and to not in ALLOWED[room]:
                problems.append(f"{module} imports {target} (room {room} may not import {to})")
    return problems


def test_every_room_imports_only_the_rooms_below_it() -> None:
    files = _modules("common", "dtensor_refit", "refit")
    rooms = {room_of(m) for m in files}
    assert rooms >= {*ROOMS, "core", "errors"}, rooms
    assert not boundary_problems(files), "\n".join(boundary_problems(files))


def test_the_core_stays_small_and_every_file_lives_in_a_room() -> None:
    top = sorted(p.name for p in (ROOT / "common").glob("*.py"))
    assert len(top) <= TOP_FILES_MAX, top
    rooms = sorted(p.name for p in (ROOT / "common").iterdir()
                   if p.is_dir() and (p / "__init__.py").is_file())
    assert set(rooms) == set(ROOMS), rooms


@pytest.mark.parametrize("plant, room", [
    ("def planted():\n    import vllm\n", "clients"),
    ("def planted():\n    from common.in_vllm import backend\n", "core"),
    ("from common.clients.http_engine import HttpEngine\n", "in_vllm"),
    ("import megatron.core\n", "core"),
])
def test_a_planted_import_across_a_boundary_is_found(tmp_path, plant: str, room: str) -> None:
    """The rules see function-level imports and every direction: a module planted in `room`
    with one forbidden import is reported."""
    planted = tmp_path / "planted.py"
    planted.write_text(plant)
    module = f"common.{'' if room == 'core' else room + '.'}planted"
    assert room_of(module) == room
    problems = boundary_problems({module: planted})
    assert problems and all(p.startswith(f"{module} imports") for p in problems), problems


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


@pytest.mark.parametrize("case", ["common", "dtensor", "mcore_tables", "refit"])
def test_modules_import_without_the_packages_they_must_not_need(case: str) -> None:
    outside_vllm = sorted(m for m in _modules("common") if room_of(m) not in ("in_vllm",)
                          and room_of(m) != "launch")  # launch needs ray: imported below
    modules, blocked = {
        "common": (outside_vllm + ["common.launch.ray_cluster"], ("vllm", "megatron")),
        "dtensor": (["dtensor_refit", "dtensor_refit.source", "dtensor_refit.stages"],
                    ("vllm", "megatron")),
        "mcore_tables": (["mcore_refit", "mcore_refit.arch", "mcore_refit.convert"],
                         ("vllm", "megatron", "transformer_engine")),
        "refit": (["refit", "refit.session", "common.clients.http_engine"],
                  ("vllm", "megatron", "ray")),  # `import refit` is the trainers' entry
    }[case]
    assert len(modules) >= 3
    done = _import_without(blocked, modules)
    assert done.returncode == 0, done.stderr[-2000:]


def test_nothing_outside_tests_imports_the_tests() -> None:
    files = [p for d in ("common", "dtensor_refit", "mcore_refit", "recipes", "bench")
             for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50 and any(p.name == "rank_runner.py" for p in files)
    offenders = sorted(str(p.relative_to(ROOT)) for p in files
                       if any(m.split(".")[0] == "tests" for m in imported_modules(p)))
    assert not offenders, f"these import from tests/: {offenders}"
