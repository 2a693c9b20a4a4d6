"""Pause mode "keep" in process: a request frozen mid-generation, refit, then continued.

The engine is a plain offline `LLM` with the refit backend, stepped by hand (`add_request` /
`step`) in a child process; the trainer is this test process. The request's first tokens come
from the starting weights; `sleep(level=0, mode="keep")` freezes it, the prefix cache is
cleared (its KV is dropped), a refit lands, and after `wake_up` it is re-prefilled and
finished under the new weights. Checks: no token is produced while the engine is paused (no
request is answered by a half-loaded model), vLLM's weight-version spans say old then new, and
the new-version suffix equals a fresh new-weights engine continuing from prompt + old prefix.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.clients.local_engine import process_context
from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from tests.dtensor.models import make_model
from tests.dtensor_vllm.helpers import JOIN_TIMEOUT_S, LLM_KWARGS, start_engine

pytestmark = pytest.mark.slow
PROMPT, TOTAL, BEFORE_PAUSE = [3, 1, 4, 1, 5], 24, 6


def stepped_engine(ckpt: str, port: int, queue) -> None:
    """Child: generate BEFORE_PAUSE tokens, pause (keep), refit v1, resume, finish."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["REFIT_DISABLE_CPU_AMX"] = "1"
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=True,
              weight_transfer_config={"backend": "refit"}, **LLM_KWARGS)
    llm.update_weight_version("0")
    llm.init_weight_transfer_engine({"init_info": {
        "host": "127.0.0.1", "port": port, "world_size": 2, "num_trainers": 1,
        "rank_offset": 1, "timeout_s": JOIN_TIMEOUT_S}})
    engine = llm.llm_engine
    engine.add_request("kept", {"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=TOTAL, temperature=0.0, ignore_eos=True))
    produced = 0
    while produced < BEFORE_PAUSE:
        produced = max([len(o.outputs[0].token_ids) for o in engine.step()] + [produced])
    llm.sleep(level=0, mode="keep")
    llm.reset_prefix_cache(reset_running_requests=True)  # clear_cache: its KV is dropped
    paused_steps = [o for _ in range(3) for o in engine.step() if o.outputs[0].token_ids]
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})
    llm.finish_weight_update(weight_version="1")
    llm.wake_up(tags=["scheduling"])
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    seq = final.outputs[0]
    spans = [(s.version, s.start, s.end) for s in seq.weight_versions or []]
    queue.put({"tokens": list(seq.token_ids), "spans": spans, "before_pause": produced,
               "paused_outputs": len(paused_steps)})


def test_keep_freezes_a_request_and_finishes_it_under_the_new_weights(tmp_path) -> None:
    old = make_model("qwen3", dtype=torch.bfloat16)
    old.save_pretrained(tmp_path / "v0")
    new_state = {n: (t * 1.5 if t.dim() > 1 else t).contiguous()
                 for n, t in old.state_dict().items()}
    new = make_model("qwen3", dtype=torch.bfloat16)
    new.load_state_dict(new_state)
    new.save_pretrained(tmp_path / "v1")
    port = free_port()
    ctx = process_context("forkserver")  # the engines' forkserver: vLLM imported there once
    queue = ctx.Queue()
    child = ctx.Process(target=stepped_engine, args=(str(tmp_path / "v0"), port, queue))
    child.start()
    try:
        group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=2, num_trainers=1,
                           timeout_s=JOIN_TIMEOUT_S, device="cpu")
        source = DictWeightSource(new_state)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), RefitConfig(
            bucket_bytes=64 << 10)))
        sender.refit(source, 1)  # waits in the broadcast until the engine has paused
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    k = got["before_pause"]
    assert k >= BEFORE_PAUSE and got["paused_outputs"] == 0, got
    assert len(got["tokens"]) == TOTAL
    assert got["spans"] == [("0", 0, k), ("1", k, TOTAL)], got
    with start_engine(str(tmp_path / "v1")) as fresh:
        (cont,) = fresh.generate([PROMPT + got["tokens"][:k]], TOTAL - k, ignore_eos=True)
        (whole,) = fresh.generate([PROMPT], TOTAL, ignore_eos=True)
    assert got["tokens"][k:] == cont.tokens
    assert got["tokens"] != whole.tokens, "the prefix should come from the old weights"
