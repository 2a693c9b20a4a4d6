"""`ReloadFixes.describe_missing`: the post-load check that every loadable param got a value."""

from __future__ import annotations

import torch

from common.in_vllm.reload_fixes import ReloadFixes


def test_missing_params_are_named_and_a_complete_refits_names_are_kept() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    fixes = ReloadFixes(model)
    full = {"0.weight", "0.bias", "1.weight", "1.bias"}
    fixes.loadable = set(full)  # what vLLM recorded for reloading (a plain module: nothing)
    assert fixes.describe_missing({"0.weight", "0.bias", "1.weight"}) == (
        "no value arrived for 1 param(s), e.g. '1.bias' (loaded under '1': ['1.weight'])")
    assert fixes.describe_missing(set(full)) is None
    assert fixes.missing(set(full)) == []  # the same names again: the kept complete set
    assert fixes.missing({"0.weight", "0.bias"}) == ["1.bias", "1.weight"]  # still checked
    assert fixes.missing(full | {"extra"}) == []  # a name beyond them changes nothing
