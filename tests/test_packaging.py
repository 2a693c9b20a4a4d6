"""The wheel carries every room of `common/` (and the native source) and the vLLM plugin: built
with `pip wheel`, installed into a scratch directory and imported from there with the checkout
and its editable install off the path (an editable install hides a package the wheel lacks).
And a newcomer's install: a fresh venv over an environment that has vLLM (this one's
site-packages, without the checkout's editable install), `pip install` of the wheel, then the
README's `vllm serve` command as written, from a folder outside the checkout: the server finds
the `refit` backend, the worker extension and the guard in the wheel and answers refit_state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from common.clients.serve import ServeConfig, VllmServer
from common.wire.group import free_port
from tests.docs_blocks import block

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip"]
ROOMS = ["refit", "common", "common.wire", "common.kernels", "common.engine", "common.shard",
         "common.delta", "common.transfer", "common.in_vllm", "common.clients", "common.launch"]
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from the checkout's files (timed: a newcomer's build)."""
    tmp = tmp_path_factory.mktemp("wheel")
    t0 = time.perf_counter()
    subprocess.run([*PIP, "wheel", str(_source_tree(tmp / "src")), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp / "dist")], check=True,
                   timeout=300, cwd=tmp)
    print(f"[install] pip wheel: {time.perf_counter() - t0:.1f} s")
    (built,) = (tmp / "dist").glob("refit-*.whl")
    return built


def _install(wheel: Path, target: Path) -> None:
    t0 = time.perf_counter()
    subprocess.run([*PIP, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300, cwd=target.parent)
    print(f"[install] pip install of the wheel: {time.perf_counter() - t0:.1f} s")


def test_the_wheel_installs_every_room_and_the_plugin(wheel, tmp_path) -> None:
    target = tmp_path / "site"
    _install(wheel, target)
    done = subprocess.run([sys.executable, "-c", _CHECK, str(target), str(ROOT),
                           ",".join(ROOMS + MODULES)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_runs_the_readme_serve_command(wheel, tmp_path) -> None:
    from tests.serve.conftest import save_qwen3

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the user's environment with vLLM: its .pth files (the checkout's editable install) unread
    (site / "users_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _install(wheel, site)
    where = subprocess.run([venv / "bin" / "python", "-c", "import common, refit; "
                            "print(common.__file__, refit.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, env=_fresh_env(venv), timeout=120)
    assert where.returncode == 0 and all(Path(f).is_relative_to(site)
                                         for f in where.stdout.split()), where
    save_qwen3(None, tmp_path / "checkpoint")
    with _readme_server(venv, tmp_path) as server:
        print(f"[install] the README's vllm serve ready in "
              f"{time.monotonic() - server.started_at:.1f} s")
        state = server.client().engine_state()
    assert state.phase == "complete" and state.version is None, state


def _fresh_env(venv: Path, **extra: str) -> dict[str, str]:
    """This process's environment with the venv first on PATH and no checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", **extra}


def _readme_server(venv: Path, tmp_path: Path) -> VllmServer:
    """The README's serve command as written (this machine's free port, small limits), run by
    bash from `tmp_path` with the venv's python."""
    config = ServeConfig(model=str(tmp_path / "checkpoint"), port=free_port("127.0.0.1"),
                         start_timeout_s=240, log_path=str(tmp_path / "serve.log"))
    command = block("run: serve-command").rstrip() + (
        f" --host {config.host} --port {config.port} --skip-tokenizer-init --enforce-eager "
        f"--max-model-len 128 --max-num-seqs 4")
    env = _fresh_env(venv, CHECKPOINT=config.model, OMP_NUM_THREADS="1",
                     REFIT_DISABLE_CPU_AMX="1")
    return VllmServer(config, command=["bash", "-c", command], env=env, cwd=tmp_path)
