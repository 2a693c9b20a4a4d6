"""A newcomer's path (`pytest -k newcomer`), against a real `vllm serve` server.

The README's quick starts, extracted from the Markdown (not copied) and run as written under
torchrun: FSDP2 (2 gloo ranks) and Megatron TP2 x PP2 (4 ranks); after the last step the
server's greedy tokens and logprobs equal a fresh engine's started on the trained weights
(which the test's own epilogue, appended to the block, writes; `fresh_outputs`). And what a
newcomer gets wrong (`newcomer_faults.py`): only rank 0 calls `refit.connect`, an engine that
is not there, a training loop that raises after a refit: each ends the job within seconds of
`connect`'s timeout, saying why; the server keeps serving the last refit that landed.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.clients.http_engine import HttpEngine
from common.clients.serve import ServeConfig, VllmServer
from common.wire.group import free_port
from tests.docs_blocks import block as docs_block
from tests.recipe_runner import ROOT, run_recipe
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S, fresh_outputs, serve_config
from tests.serve.test_survives import pairs

pytestmark = pytest.mark.slow
FAULTS = Path(__file__).with_name("newcomer_faults.py")
MEGATRON_LEN = 64
TEARDOWN = "dist.destroy_process_group()\n"  # how each quick start ends
EPILOGUE = '''
# -- the test's own epilogue: the trained weights as a checkpoint, for a fresh engine --
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
if dist.get_rank() == 0:
    trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    trained.load_state_dict(full)
    trained.save_pretrained(sys.argv[3])
    open(sys.argv[-1], "w").write('{"saved": true}')
'''


MEGATRON_WEIGHTS = '''
# -- the test's own epilogue: this model's weights as a checkpoint (rank 0) --
from recipes.megatron_refit import gather_full, write_checkpoint

full = gather_full(source, refit.RefitPlan.build(source.plan_specs(), refit.RefitConfig()))
if dist.get_rank() == 0:
    write_checkpoint(full, DENSE, sys.argv[2])
    open(sys.argv[-1], "w").write('{"saved": true}')
'''


@pytest.fixture(scope="module")
def server(checkpoints) -> Iterator[VllmServer]:
    with VllmServer(serve_config(checkpoints.start, "newcomer")) as server:
        yield server


def test_newcomer_fsdp2_quick_start_runs_as_written(server, checkpoints, tmp_path) -> None:
    block = docs_block("newcomer: fsdp2")
    refit_lines = [line for line in block.splitlines() if "refit" in line]
    assert len(refit_lines) <= 10, refit_lines
    trained = tmp_path / "trained"
    _run_block(_with_epilogue(block, EPILOGUE), tmp_path, "quickstart", server.url,
               str(checkpoints.start), str(trained), nproc=2)
    got = _served(server.url)
    want = pairs(fresh_outputs(serve_config(trained, "newcomer-fresh")))
    assert got == want, "the quick start's server differs from a fresh one on its weights"
    log = Path(server.config.log_path).read_text()  # the backend's own lines, in vLLM's log
    assert "refit v1 landed in" in log and "refit v2 landed in" in log, log[-3000:]


def _with_epilogue(block: str, epilogue: str) -> str:
    """The quick start as written, the test's epilogue run just before its last line (the
    process groups' teardown, which the epilogue's gathers still need)."""
    assert block.rstrip().endswith(TEARDOWN.strip()), "the quick start no longer ends so"
    head = block.rstrip()[: -len(TEARDOWN.strip())]
    return head + epilogue + block.rstrip()[len(head):] + "\n"


def _run_block(code: str, tmp_path: Path, name: str, *argv: str, nproc: int) -> None:
    """`code` as a script under torchrun (this checkout's refit importable, as if installed)."""
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    run_recipe(str(script), *argv, result=tmp_path / f"{name}.json", nproc=nproc,
               timeout_s=300, env={"PYTHONPATH": str(ROOT)})


def _served(url: str) -> list:
    client = HttpEngine(url, timeout_s=TIMEOUT_S)
    assert client.weight_version() == "2" and not client.is_paused()
    return pairs(client.generate(PROMPTS, SHORT))


def test_newcomer_megatron_quick_start_runs_as_written(tmp_path) -> None:
    """A server on random weights of the block's model (every one is refit), the whole block,
    then a fresh engine on what it trained."""
    from transformers import AutoModelForCausalLM

    from recipes.mcore_configs import hf_config
    from recipes.mcore_models import DENSE

    block = docs_block("newcomer: megatron")
    assert len([line for line in block.splitlines() if "refit" in line]) <= 10
    start, trained = tmp_path / "start", tmp_path / "trained"
    AutoModelForCausalLM.from_config(hf_config(DENSE)).to(torch.bfloat16).save_pretrained(start)
    with VllmServer(_short(start, "newcomer-megatron")) as server:
        _run_block(_with_epilogue(block, MEGATRON_WEIGHTS), tmp_path, "quickstart", server.url,
                   str(trained), nproc=4)
        got = _served(server.url)
    want = pairs(fresh_outputs(_short(trained, "newcomer-megatron-fresh")))
    assert got == want, "the quick start's server differs from a fresh one on its weights"


def _short(checkpoint: Path, name: str) -> ServeConfig:
    """The Megatron model's positions are few: a short max model length."""
    return dataclasses.replace(serve_config(checkpoint, name), max_model_len=MEGATRON_LEN)


def _faults(mode: str, url: str, checkpoint: Path, version: int = 1) -> tuple[int, str, float]:
    """newcomer_faults.py under torchrun: (exit code, output, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(FAULTS), mode, url, str(checkpoint), str(version)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.parametrize("mode, says", [
    ("wrong_rank", "training ranks [1] did not call refit.connect within 3s"),
    ("dead_engine", "training rank 0 could not set up the engines"),
])
def test_newcomer_setup_mistakes_fail_fast_and_say_why(checkpoints, mode, says) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there (dead_engine)
    rc, out, seconds = _faults(mode, url, checkpoints.start)
    assert rc != 0 and says in out, out[-3000:]
    assert seconds < 60, f"{mode}: the job took {seconds:.0f}s to end"
    print(f"[newcomer] {mode}: ended in {seconds:.1f} s: {says}")


def test_newcomer_trainer_that_raises_exits_and_leaves_the_server_serving(
        server, checkpoints) -> None:
    client = server.client(timeout_s=TIMEOUT_S)
    held = client.weight_version()  # "default" when no test before this one refit it
    version = int(held) + 1 if held.isdigit() else 1
    rc, out, seconds = _faults("raise_mid_training", server.url, checkpoints.start, version)
    assert rc != 0 and "the training step failed" in out, out[-3000:]
    assert seconds < 60, f"the job took {seconds:.0f}s to end"
    assert client.engine_state().phase == "complete" and not client.is_paused()
    assert client.weight_version() == str(version)  # the refit before the failure landed
    assert client.generate(PROMPTS, SHORT), "the server stopped serving"
    print(f"[newcomer] raise mid-training: ended in {seconds:.1f} s, the server serves "
          f"v{client.weight_version()}")
