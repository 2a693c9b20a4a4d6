"""Shard-to-shard with a vocabulary the engine pads: 515 rows at TP=2, which vLLM pads to 576
(288 per TP rank), its loader zero-filling the last rank's 61 padding rows. The learned map
takes the real rows and writes the padding's zeros itself (`load_map.ConstFill`), so no
worker falls back to `load_weights` for the embedding (or an untied lm_head) and each receives
about half of the plan, tied and untied; the last rank's embedding (and lm_head) then holds the
sent rows and zeros, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, join_one_trainer

pytestmark = pytest.mark.slow
VOCAB = 515
TP2 = {**LLM_KWARGS, "tensor_parallel_size": 2}


def _checkpoint(tie: bool, path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from tests.dtensor.models import make_config

    config = make_config("qwen3", tie)
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(path))
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_shard_padded_vocab_each_tp_rank_takes_its_rows(tie, tmp_path) -> None:
    state = _checkpoint(tie, tmp_path / "start")
    total = sum(t.nbytes for t in state.values())
    heads = ["model.embed_tokens.weight"] + ([] if tie else ["lm_head.weight"])
    with LocalEngine(EngineConfig(model=str(tmp_path / "start"), llm_kwargs=TP2)) as engine:
        trainer = join_one_trainer([engine], state)
        try:
            for version in (1, 2):  # 1 learns each worker's map, 2 applies it
                for name, t in state.items():
                    state[name] = (t.float() * 1.25).to(t.dtype) if t.dim() > 1 else t
                received = trainer.refit(version).receivers
        finally:
            trainer.group.destroy()
        reports, last = engine.apply_reports(), engine.read(heads, worker=1)
    for r in reports:
        assert r["path"] == "direct" and r["fallback_tensors"] == 0, r
    shares = [received[rank]["wire_bytes"] / total for rank in (1, 2)]
    print(f"[shard] vocab {VOCAB}, {'tied' if tie else 'untied'}: each TP rank received "
          f"{shares} of the plan")
    # about half each: TP rank 0 holds 288 of the 515 rows, rank 1 the other 227 (whole
    # tensors on load_weights would make it 0.68 tied, 0.76 untied)
    assert max(shares) <= 0.6 and sum(shares) <= 1.1, shares
    for name in heads:
        got, sent = last[name], state[name]
        start = got.shape[0]  # the last rank's first row: every rank holds the same count
        assert torch.equal(got[: VOCAB - start], sent[start:]), name
        assert not got[VOCAB - start:].any(), f"{name}: its padding rows are not zeros"
