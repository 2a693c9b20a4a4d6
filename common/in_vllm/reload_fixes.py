"""What vLLM's in-place reload leaves to its caller (both apply paths): which params a refit
must fill, and the post-load work it skips or leaves stale. Only vLLM processes import this."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info


class ReloadFixes:
    """Found once per model (at join): the loadable param names, the CPU fused-MoE layers
    and the layers whose weight is loaded under another layer's name (a tied lm_head)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.loadable = _loadable(model)
        self.moe_layers = _moe_layers(model)
        self.tied = _tied_layers(model)
        # every name of every param: a module registered twice (vLLM 0.26's CUDA fused MoE
        # as `experts` and `experts.routed_experts`) loads under one of its names
        self._param_of = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
        self._model = model
        self._complete: frozenset[str] = frozenset()  # names a refit filled every param with

    def missing(self, loaded: set[str]) -> list[str]:
        """The loadable params no name of which was `loaded` (a name a loader reports may
        also reach its param through a module attribute that is not a registration). The
        names of the last refit that filled every param are kept: a learned map reports the
        same ones each refit, and comparing sets costs a fraction of resolving each name."""
        if loaded == self._complete:
            return []
        filled = {self._param_of.get(n) or _attribute_id(self._model, n) for n in loaded}
        missing = sorted(n for n in self.loadable if self._param_of[n] not in filled)
        if not missing:
            self._complete = frozenset(loaded)
        return missing

    def describe_missing(self, loaded: set[str]) -> str | None:
        """Why the check fails, naming a missing param and what was loaded beside it."""
        if not (missing := self.missing(loaded)):
            return None
        layer = missing[0].rsplit(".", 2)[0]
        near = sorted(n for n in loaded if n.startswith(layer))[:4]
        return (f"no value arrived for {len(missing)} param(s), e.g. {missing[0]!r} (loaded "
                f"under {layer!r}: {near})")

    def after_load(self, loaded: set[str]) -> None:
        """For this refit's loads only: redo the CPU fused-MoE prepack the reload skips (it
        re-lays out whatever it is given, so never on weights a failed refit left packed), and
        the processing of tied layers (their CPU kernel holds a copy of the tied weight)."""
        for prefix, module in self.moe_layers:
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel",
                                      None), "fused_experts", None)
            if experts is not None and {f"{prefix}.w13_weight", f"{prefix}.w2_weight"} & loaded:
                experts.process_weights_after_loading(module)
        for layer, aliases in self.tied:
            if aliases & loaded:
                layer.quant_method.process_weights_after_loading(layer)


def _attribute_id(model: torch.nn.Module, name: str) -> int | None:
    """The param a reported name reaches: an attribute path, or the one param of that leaf
    name in a direct child of the named layer (vLLM 0.26's CUDA fused MoE reports
    `experts.w13_weight` for `experts.routed_experts.w13_weight`)."""
    obj: object = model
    for part in name.split("."):
        obj = getattr(obj, part, None)
    if isinstance(obj, torch.Tensor):
        return id(obj)
    prefix, _, leaf = name.rpartition(".")
    try:
        layer = model.get_submodule(prefix)
    except AttributeError:
        return None
    found = [p for n, p in layer.named_parameters() if n.count(".") == 1 and
             n.endswith("." + leaf)]
    return id(found[0]) if len(found) == 1 else None


def _loadable(model: torch.nn.Module) -> set[str]:
    """Params a load must fill: the checkpoint-format params vLLM recorded at startup for
    reloading (params derived after loading, e.g. MLA's W_UK_T, are not among them)."""
    names = set()
    for prefix, layer in model.named_modules():
        recorded, _ = get_layerwise_info(layer).restore_metadata
        names.update(f"{prefix}.{n}" if prefix else n for n in recorded)
    return names & {n for n, _ in model.named_parameters()}


def _moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers holding fused-MoE experts on the CPU (found once: a refit only needs them)."""
    return [(prefix, module) for prefix, module in model.named_modules()
            if getattr(module, "w13_weight", None) is not None
            and module.w13_weight.device.type == "cpu"]


def _tied_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, set[str]]]:
    """Layers with post-load processing whose param is loaded under another layer's name
    (e.g. an lm_head tied to the embedding): the reload loads the other name only, so this
    layer's processing (on CPU a prepacked copy of the weight) would go stale. One module
    registered under two names (vLLM 0.26's MoE router `gate`, also `experts.gate`) shares
    nothing with another layer: not tied."""
    owners: dict[int, dict[int, set[str]]] = {}  # param -> module holding it -> its names
    for prefix, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), {}).setdefault(id(module), set()).add(
                f"{prefix}.{pname}" if prefix else pname)
    tied = []
    for _, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            continue
        for _, param in module.named_parameters(recurse=False):
            others = set().union(*(names for holder, names in owners[id(param)].items()
                                   if holder != id(module)))
            if others:
                tied.append((module, others))
    return tied
