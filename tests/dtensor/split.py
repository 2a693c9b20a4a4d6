"""Layouts beyond plain FSDP2 / TP, built the way trainers build them, on 4 gloo ranks.

- "pp_hf": transformers' own `apply_pipeline_parallelism` (2 stages; other stages' layers become
  identities, a tied embedding stays on the last stage too), each stage FSDP2 on its dp mesh.
- "pp_dict": torchtitan's split: each stage keeps its layers in a ModuleDict under their global
  ids and sets the modules of other stages to None; FSDP2 on the stage's dp mesh.
- "hsdp": FSDP2 on a (replicate, shard) mesh: `(Replicate(), Shard(0))`.
- "dpep": torchtitan's dp x ep: experts `Shard(0)` on "ep" then FSDP2 on "dp_mod_ep"
  (`(_StridedShard(0, sf=2), Shard(0))`), the rest FSDP2 over all 4 ranks.
- "dpep_s1": the same with FSDP2 sharding the experts on dim 1 (torchtitan's choice when there
  are fewer local experts than dp ranks): `(Shard(1), Shard(0))`.
- "ep": EP alone: experts `Shard(0)` on a 4-rank "ep" mesh, the rest FSDP2 on the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.dtensor.shard import Case, build_unsharded

TRAINERS = 4


@dataclass(frozen=True)
class Layout:
    """`drop_layer` removes that layer from every stage; `skew` changes the last stage's copy
    of the tied embedding (both only to provoke the setup errors)."""

    kind: str
    arch: str = "qwen3"
    tie: bool = False
    drop_layer: int | None = None
    skew: bool = False
    experts: str = "owner"  # DTensorWeightSource's expert_sources

    @property
    def case(self) -> Case:
        return Case(self.arch, dp=2, tie=self.tie)

    @property
    def staged(self) -> bool:
        return self.kind.startswith("pp_")

    def __str__(self) -> str:
        return f"{self.kind}-{self.arch}{'-tied' if self.tie else ''}-{self.experts}"


def _fsdp(model: torch.nn.Module, layers, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _pp_hf(model: torch.nn.Module, layout: Layout):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.pipeline_parallel import (
        PipelineIdentityLayer,
        apply_pipeline_parallelism,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    apply_pipeline_parallelism(model, mesh["pp"])
    layers = model.model.layers
    if layout.drop_layer is not None:
        layers[layout.drop_layer] = PipelineIdentityLayer()
    if layout.skew and mesh["pp"].get_local_rank() == 1:
        with torch.no_grad():
            model.model.embed_tokens.weight[0, 0] += 1
    _fsdp(model, [m for m in layers if not isinstance(m, PipelineIdentityLayer)], mesh["dp"])
    return [model]


def _pp_dict(model: torch.nn.Module, layout: Layout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, inner = mesh["pp"].get_local_rank(), model.model
    layers = list(inner.layers)
    per = len(layers) // 2
    keep = [i for i in range(stage * per, (stage + 1) * per) if i != layout.drop_layer]
    inner.layers = torch.nn.ModuleDict({str(i): layers[i] for i in keep})
    if stage != 0:
        inner.embed_tokens = None
    if stage != 1:
        inner.norm, model.lm_head = None, None
    _fsdp(model, list(inner.layers.values()), mesh["dp"])
    return [model]


def _hsdp(model: torch.nn.Module):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _fsdp(model, model.model.layers, mesh)
    return model


def _experts(model: torch.nn.Module, ep_mesh) -> list[torch.nn.Module]:
    """Each MoE layer's fused experts `Shard(0)` on `ep_mesh`; returns the expert modules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            for attr in ("gate_up_proj", "down_proj"):
                shard = distribute_tensor(getattr(experts, attr).detach(), ep_mesh, [Shard(0)])
                setattr(experts, attr, torch.nn.Parameter(shard))
            out.append(experts)
    return out


def _dpep(model: torch.nn.Module, dim: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    flat = mesh["dp_mod_ep", "ep"]._flatten("dp_shard")
    for experts in _experts(model, mesh["ep"]):
        place = (lambda p: Shard(dim)) if dim else None  # None: FSDP2's default Shard(0)
        fully_shard(experts, mesh=mesh["dp_mod_ep"], shard_placement_fn=place)
    _fsdp(model, model.model.layers, flat)
    return model


def _ep(model: torch.nn.Module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("ep",))
    ignored = {p for m in _experts(model, mesh) for p in m.parameters()}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def build_layout(layout: Layout):
    """The training model of this rank: a list of stage parts ("pp_*") or the whole model."""
    model = build_unsharded(layout.case)
    if layout.kind == "pp_hf":
        return _pp_hf(model, layout)
    if layout.kind == "pp_dict":
        return _pp_dict(model, layout)
    if layout.kind == "hsdp":
        return _hsdp(model)
    if layout.kind == "dpep":
        return _dpep(model)
    if layout.kind == "dpep_s1":
        return _dpep(model, dim=1)
    if layout.kind == "ep":
        return _ep(model)
    raise ValueError(f"unknown layout {layout.kind!r}")
