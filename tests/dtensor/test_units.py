"""Single-process checks: dtype policy, names, wrappers, layout errors, checkpoint headers."""

from __future__ import annotations

import gc
import tempfile
import weakref
from pathlib import Path

import pytest
import torch

from common.errors import ConversionError
from common.plan import RefitPlan, TensorSpec
from dtensor_refit import (
    DTensorWeightSource,
    LayoutError,
    checkpoint_specs,
    compare_with_checkpoint,
)
from dtensor_refit.names import strip_wrappers
from tests.dtensor.ranks import assert_same, saved
from tests.dtensor.shard import Case, build_unsharded


def test_strip_wrappers() -> None:
    assert strip_wrappers("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.w") == \
        "model.layers.0.mlp.w"
    assert strip_wrappers("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"


def test_wrapped_model_same_names_and_values() -> None:
    """torch.compile + activation-checkpoint wrappers change module names, not checkpoint ones."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    case = Case("deepseek_v3", model_dtype=torch.bfloat16)
    plain = DTensorWeightSource(build_unsharded(case)).plan_specs()
    model = build_unsharded(case)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)
    source = DTensorWeightSource(compiled)
    assert any("_checkpoint_wrapped_module" in e.key for e in source.entries)
    assert any(e.key.startswith("_orig_mod.") for e in source.entries)
    assert source.plan_specs() == plain
    got = dict(source.iter_tensors(RefitPlan.build(plain)))
    assert_same(got, saved(build_unsharded(case), source.policy), "wrapped")


def test_tied_embeddings_sent_once() -> None:
    names = [s.name for s in DTensorWeightSource(build_unsharded(Case("qwen3", tie=True)))
             .plan_specs()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    names = [s.name for s in DTensorWeightSource(build_unsharded(Case("qwen3"))).plan_specs()]
    assert "lm_head.weight" in names
    assert not any("rotary" in n for n in names)  # non-persistent buffers are not weights


def test_unknown_fused_layout_fails_at_setup() -> None:
    """Mixtral saves experts as block_sparse_moe.experts.{e}.w1/w2/w3: not guessed, refused."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           num_local_experts=2, head_dim=16)
    with pytest.raises(LayoutError, match="block_sparse_moe.experts.0.w1.weight"):
        DTensorWeightSource(AutoModelForCausalLM.from_config(config))


def test_yielded_tensors_are_not_kept() -> None:
    """Each cast / gathered tensor dies once the consumer drops it: memory stays bounded."""
    source = DTensorWeightSource(build_unsharded(Case("qwen3_moe")))
    alive: list[weakref.ref] = []
    for _name, tensor in source.iter_tensors(RefitPlan.build(source.plan_specs())):
        gc.collect()
        assert not any(r() is not None for r in alive), "an earlier tensor is still held"
        alive.append(weakref.ref(tensor))
        del tensor
    assert len(alive) == len(source.plan_specs())


def test_checkpoint_specs_from_headers() -> None:
    from safetensors import safe_open

    # model.to(bf16) without restoring the bias: save_pretrained writes it as bf16
    case = Case("deepseek_v3", model_dtype=torch.bfloat16, bias_fp32=False)
    model = build_unsharded(case)
    specs = DTensorWeightSource(model).plan_specs()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, max_shard_size="100KB")  # several files + an index
        ckpt = checkpoint_specs(d)
        want = {}
        for path in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    want[k] = (tuple(sl.get_shape()), sl.get_dtype())
    assert len(list(want)) > 1
    assert {k: v[0] for k, v in ckpt.items()} == {k: v[0] for k, v in want.items()}
    assert ckpt["model.embed_tokens.weight"][1] == torch.bfloat16
    assert compare_with_checkpoint(specs, ckpt) == []
    # the bias was written as bf16 yet is declared fp32: reported only when dtypes are asked
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert ckpt[bias][1] == torch.bfloat16
    assert [p for p in compare_with_checkpoint(specs, ckpt, check_dtype=True)] == \
        [f"tensor {bias!r}: plan dtype float32, the checkpoint keeps it as bfloat16"]
    wrong = [TensorSpec(s.name, (1,) if s.name == bias else s.shape, s.dtype) for s in specs]
    wrong.append(TensorSpec("model.extra.weight", (2,), torch.bfloat16))
    problems = compare_with_checkpoint(wrong[1:], ckpt)
    assert any(bias in p and "shape" in p for p in problems)
    assert any("model.extra.weight" in p for p in problems)
    assert any(specs[0].name in p and "not in the plan" in p for p in problems)


def test_any_plan_order_and_unknown_names() -> None:
    """A plan in another order still gets the right tensors (fused groups re-gathered)."""
    case = Case("qwen3_moe")
    source = DTensorWeightSource(build_unsharded(case))
    specs = source.plan_specs()
    got = dict(source.iter_tensors(RefitPlan.build(specs[::-1])))
    assert_same(got, saved(build_unsharded(case), source.policy), "reversed plan")
    bad = RefitPlan.build([*specs, TensorSpec("model.nope.weight", (1,), torch.bfloat16)])
    with pytest.raises(ConversionError, match="model.nope.weight"):
        list(source.iter_tensors(bad))


def test_expert_ids_follow_the_placements() -> None:
    """FSDP2 over EP (right-to-left, `_StridedShard`) vs plain left-to-right `Shard`s."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dtensor_refit.experts import _expert_ids

    def ids(placements) -> dict:
        return {c: _expert_ids(placements, (2, 2), 8, c) for c in ((0, 0), (0, 1), (1, 0), (1, 1))}

    assert ids((_StridedShard(0, split_factor=2), Shard(0))) == \
        {(0, 0): (0, 1), (0, 1): (4, 5), (1, 0): (2, 3), (1, 1): (6, 7)}
    assert ids((Shard(0), Shard(0))) == \
        {(0, 0): (0, 1), (0, 1): (2, 3), (1, 0): (4, 5), (1, 1): (6, 7)}
    assert ids((Shard(1), Shard(0))) == \
        {(0, 0): (0, 1, 2, 3), (0, 1): (4, 5, 6, 7), (1, 0): (0, 1, 2, 3), (1, 1): (4, 5, 6, 7)}
    uneven = [_expert_ids((Shard(0),), (4,), 6, (c,)) for c in range(4)]
    assert uneven == [(0, 1), (2, 3), (4, 5), ()]  # torch.chunk's sizes, as FSDP2 shards


def test_expert_sources_option_is_checked() -> None:
    with pytest.raises(ValueError, match="expert_sources must be 'owner' or 'gather'"):
        DTensorWeightSource(build_unsharded(Case("qwen3")), expert_sources="owners")
