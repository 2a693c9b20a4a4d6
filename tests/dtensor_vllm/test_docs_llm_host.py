"""The docs' in-process engine block (docs/serving.md, `<!-- run: llm-host -->`), run as written in
a child process (a prelude names what the block leaves to its reader: the checkpoint, the refit
group's address, one trainer, one worker, step 1), while this process is its one trainer and
refits the checkpoint's weights x1.5: the refit lands (every worker's refit_state: complete v1)
and every param a read can see holds what was sent, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from tests.docs_blocks import ROOT, block

pytestmark = pytest.mark.slow
PRELUDE = '''
import sys
from vllm import LLM
ckpt_dir, host, port, out = sys.argv[1], "127.0.0.1", int(sys.argv[2]), sys.argv[3]
T, n_workers, step = 1, 1, 1
'''
EPILOGUE = '''
import torch

def read_params(worker):
    params = worker.model_runner.get_model().named_parameters()
    return {n: p.detach().clone() for n, p in params if p.numel()}

torch.save({"states": llm.collective_rpc("refit_state"),
            "params": llm.collective_rpc(read_params)[0]}, out)
'''


def test_the_docs_llm_block_takes_a_refit(tmp_path) -> None:
    from tests.serve.conftest import save_qwen3

    save_qwen3(None, tmp_path / "start")
    sent = {k: v * 1.5 if v.dim() > 1 else v + 1 for k, v in
            load_file(str(tmp_path / "start" / "model.safetensors")).items()}
    port, out = free_port("127.0.0.1"), tmp_path / "engine.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "REFIT_DISABLE_CPU_AMX": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    code = PRELUDE + block("run: llm-host") + EPILOGUE
    with open(tmp_path / "engine.log", "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "start"),
                                  str(port), str(out)], cwd=tmp_path, env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        group = _join_watching(child, port, tmp_path / "engine.log")
        source = DictWeightSource(sent)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), RefitConfig()))
        print(sender.refit(source, version=1).summary())
        assert child.wait(120) == 0, (tmp_path / "engine.log").read_text()[-3000:]
        group.destroy()
    finally:
        child.kill()
    engine = torch.load(out)
    assert [(s["phase"], s["version"]) for s in engine["states"]] == [("complete", 1)]
    compared = [n for n in engine["params"] if n in sent]
    assert len(compared) >= 3, sorted(engine["params"])
    for name in compared:
        assert torch.equal(engine["params"][name], sent[name]), name


def _join_watching(child: subprocess.Popen, port: int, log) -> RefitGroup:
    """Rank 0 of the refit group, failing at once (with the engine's log) if the engine's
    process exits before it joins."""
    joined: list = []

    def join() -> None:
        try:
            joined.append(RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=2,
                                     num_trainers=1, timeout_s=240))
        except Exception as e:  # noqa: BLE001 - raised below
            joined.append(e)

    threading.Thread(target=join, daemon=True).start()
    while not joined:
        assert child.poll() is None, f"the engine exited: {log.read_text()[-3000:]}"
        time.sleep(0.5)
    if isinstance(joined[0], Exception):
        raise joined[0]
    return joined[0]
