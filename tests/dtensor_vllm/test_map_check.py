"""A learned load map that would load wrong bytes is caught before it is trusted.

The engine (an in-process `LLM` with the refit backend, in a child process) learns its map
from refit v1, which loads through `load_weights`; a fault injected into the map (one run of a
norm weight reads two bytes late) must make the map's check against that refit's loads fail:
the map is dropped, the engine ends on the loaders' result (every readable param equals the
trainer's tensors) and it reports staying on `load_weights`. The same refit with an intact map
is checked bit for bit and kept.
"""

from __future__ import annotations

import os

import pytest

from common.clients.local_engine import process_context
from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.vllm_checks import compare_params, vllm_layout
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint
from tests.dtensor_vllm.helpers import JOIN_TIMEOUT_S, LLM_KWARGS

pytestmark = pytest.mark.slow


def _corrupting(learn):
    """`learn`, then one run into a norm weight reads two bytes late (a defective map)."""
    from common.in_vllm.apply import COPY

    def learn_badly(*args, **kwargs):
        direct = learn(*args, **kwargs)
        for runs in direct.runs.values():
            copy = runs.copy
            for i in range(len(copy) - 1):
                if direct.kinds[direct.dests[copy.dest[i]].layer] == COPY:
                    copy.src[i] += 2
                    return direct
        raise AssertionError("no run into a copy layer to corrupt")

    return learn_badly


def engine_child(ckpt: str, port: int, fault, queue, read) -> None:
    """An engine that takes refit v1 (the learning refit), its map learning wrapped by
    `fault(learn)` unless None; puts its apply report and params on `queue`."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", REFIT_DISABLE_CPU_AMX="1")
    import common.in_vllm.map_steps as map_steps
    from common.in_vllm.llm_host import _apply_report, _read_params

    if fault is not None:
        map_steps.learn = fault(map_steps.learn)
    from vllm import LLM

    llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=True,
              weight_transfer_config={"backend": "refit"}, **LLM_KWARGS)
    llm.init_weight_transfer_engine({"init_info": {
        "host": "127.0.0.1", "port": port, "world_size": 2, "num_trainers": 1,
        "rank_offset": 1, "timeout_s": JOIN_TIMEOUT_S}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})
    llm.finish_weight_update(weight_version="1")
    queue.put({"report": llm.collective_rpc(_apply_report)[0],
               "params": llm.collective_rpc(_read_params, args=(None,))[0]})
    read.wait(60)  # the tensors travel by file descriptor: stay until they are taken
    os._exit(0)  # engine core in this process: nothing to stop; the interpreter's exit can wait


def learning_refit(tmp_path, fault=None) -> tuple[dict, dict]:
    """Refit v1 from this process into an `engine_child` (its map learning wrapped by
    `fault`): (the state sent, what the engine put on its queue)."""
    from safetensors.torch import load_file

    ckpt = initial_checkpoint(Case("qwen3", dp=2), tmp_path / "start")
    state = {n: t * 1.5 for n, t in load_file(f"{ckpt}/model.safetensors").items()}
    # forked from the engines' forkserver (vLLM imported there once), not a fresh interpreter
    port, ctx = free_port(), process_context("forkserver")
    queue, read = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=engine_child, args=(ckpt, port, fault, queue, read))
    child.start()
    try:
        group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=2, num_trainers=1,
                           timeout_s=JOIN_TIMEOUT_S, device="cpu")
        source = DictWeightSource(state)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(),
                                                          RefitConfig(bucket_bytes=16 << 10)))
        sender.refit(source, 1)
        got = queue.get(timeout=120)
        read.set()
        group.destroy()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return state, got


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "defective"])
def test_the_map_is_checked_against_the_loaders_and_dropped_when_it_differs(tmp_path, corrupt):
    state, got = learning_refit(tmp_path, _corrupting if corrupt else None)
    assert compare_params(got["params"], vllm_layout(state)) >= 4
    report = got["report"]
    if corrupt:
        assert report["path"] == "load_weights", report
        assert "differ" in report["map_rejected"] and "norm" in report["map_rejected"], report
    else:
        assert report["path"] == "direct" and report["verified"] >= 4, report
        # CPU kernels empty some params (AVX-512: every bf16 linear; AVX2: fewer): counted
        emptied = len(vllm_layout(state)) - len(got["params"])
        assert (report["unreadable"] > 0) == (emptied > 0), (report, emptied)
        assert report["processed"] > 0, "the processed layers' inputs were compared"
