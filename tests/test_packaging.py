"""The wheel carries every room of `common/` (and the native source) and the vLLM plugin: built
with `pip wheel`, installed into a scratch directory and imported from there with the checkout
and its editable install off the path (an editable install hides a package the wheel lacks)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ["refit", "common", "common.wire", "common.kernels", "common.in_vllm", "common.clients",
         "common.launch"]
# One module of each room that imports without vllm (the in_vllm room's need it: their files
# are checked instead), and the plugin.
MODULES = ["refit.session", "common.transfer.sender", "common.wire.group", "common.kernels.native",
           "common.clients.http_engine", "common.launch.ray_cluster", "dtensor_refit",
           "mcore_refit", "refit_vllm_plugin"]

_CHECK = """
import importlib, importlib.metadata, sys
from pathlib import Path
target = Path(sys.argv[1]).resolve()
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
sys.path[:] = [str(target)] + [p for p in sys.path if p and Path(p).resolve() != Path(sys.argv[2])]
for name in sys.argv[3].split(","):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(target), (name, module.__file__)
from common.kernels import native
assert Path(native._SOURCE_FILE).is_file(), native._SOURCE_FILE
assert (target / "common" / "in_vllm" / "backend.py").is_file()
import refit
assert refit.connect.__module__ == "refit.session" and refit.RefitConfig.__name__ == "RefitConfig"
(plugin,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
             if e.name == "refit"]
assert plugin.value == "refit_vllm_plugin:register", plugin
print("ok")
"""


def _source_tree(into: Path) -> Path:
    """The checkout's files git knows or would add (no build/ left by an earlier build)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def test_the_wheel_installs_every_room_and_the_plugin(tmp_path) -> None:
    pip = [sys.executable, "-m", "pip"]
    source = _source_tree(tmp_path / "src")
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("refit-*.whl")
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300, cwd=tmp_path)
    done = subprocess.run([sys.executable, "-c", _CHECK, str(target), str(ROOT),
                           ",".join(ROOMS + MODULES)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
