"""Parent-side checks: converted names/shapes == transformers checkpoint, logits == Megatron."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from recipes.mcore_configs import hf_config
from tests.mcore.models import VOCAB, Layout


def merge(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The HF state dict assembled from every rank's owned tensors; specs equal everywhere."""
    specs = results[0]["specs"]
    for r, res in enumerate(results):
        assert res["specs"] == specs, f"rank {r} lists different specs than rank 0"
    sd: dict[str, torch.Tensor] = {}
    for res in results:
        for name, t in res["tensors"].items():
            assert name not in sd, f"{name} yielded by two ranks"
            sd[name] = t
    assert list(sd) != [] and set(sd) == {s[0] for s in specs}
    return sd


def expected_shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    """Checkpoint-format names and shapes of the transformers model (what vLLM loads)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    config = hf_config(layout)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = revert_weight_conversion(model, dict(model.state_dict()))
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: tuple(v.shape) for k, v in sd.items()}


def hf_logits(layout: Layout, sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Load `sd` as a checkpoint with transformers (its real load path) and run it."""
    import transformers
    from safetensors.torch import save_file

    config = hf_config(layout)
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        save_file({k: v.float().contiguous() for k, v in sd.items()}, f"{d}/model.safetensors")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, output_loading_info=True, attn_implementation="eager")
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"transformers loading reported {bad}"
    model.eval()
    with torch.no_grad():
        return model(ids).logits.float()


def check(layout: Layout, results: list[dict[str, Any]],
          mutate: Callable[[dict[str, torch.Tensor]], None] | None = None) -> float:
    """Assert names/shapes match transformers; return max |HF logits - Megatron logits|."""
    sd = merge(results)
    got = {k: tuple(v.shape) for k, v in sd.items()}
    want = expected_shapes(layout)
    diffs = [(k, got[k], want[k]) for k in got.keys() & want.keys() if got[k] != want[k]]
    assert got == want, (f"missing {sorted(set(want) - set(got))[:6]}, "
                         f"extra {sorted(set(got) - set(want))[:6]}, shape diffs {diffs[:6]}")
    if mutate is not None:
        mutate(sd)
    mega = results[0]["logits"][..., :VOCAB]
    hf = hf_logits(layout, sd, results[0]["ids"])
    return float((hf - mega).abs().max())
