"""Build, randomise and shard a tiny model the way a trainer would (FSDP2, TP, or both)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.dtensor.models import make_model, random_value


@dataclass(frozen=True)
class Case:
    """One training layout. `model_dtype` bf16 = `model.to(bf16)` (casts the router bias too);
    `bias_fp32` then puts the fp32 bias back, as from_pretrained's keep-in-fp32 does."""

    arch: str
    dp: int = 2
    tp: int = 1
    tie: bool = False
    model_dtype: torch.dtype = torch.float32
    out_dtype: torch.dtype = torch.bfloat16
    bias_fp32: bool = True
    forward: bool = False
    mp_bf16: bool = False  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16) over fp32 masters
    seed: int = 0

    @property
    def trainers(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        return (f"{self.arch}-dp{self.dp}tp{self.tp}{'-tied' if self.tie else ''}-"
                f"{dt[self.model_dtype]}to{dt[self.out_dtype]}"
                f"{'' if self.bias_fp32 else '-biasbf16'}{'-fwd' if self.forward else ''}"
                f"{'-mpbf16' if self.mp_bf16 else ''}")


def bias_names(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]


def build_unsharded(case: Case) -> torch.nn.Module:
    """The same model on every process: every parameter and persistent buffer set by name."""
    model = make_model(case.arch, case.tie)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary" not in name:
                t.copy_(random_value(name, tuple(t.shape), case.seed))
    if case.model_dtype != torch.float32:
        model.to(case.model_dtype)
        if case.bias_fp32:
            for name in bias_names(model):
                mod, _, attr = name.rpartition(".")
                value = random_value(name, tuple(model.get_buffer(name).shape), case.seed)
                setattr(model.get_submodule(mod), attr, value)
    return model


def _tp_plan(model: torch.nn.Module, tied: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    per_layer = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                 "self_attn.q_b_proj": col, "self_attn.kv_b_proj": col,
                 "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
                 "mlp.down_proj": row, "mlp.shared_experts.gate_proj": col,
                 "mlp.shared_experts.up_proj": col, "mlp.shared_experts.down_proj": row}
    names = {n for n, _ in model.named_modules()}
    plan: dict = {}
    for i in range(len(model.model.layers)):
        for suffix, style in per_layer.items():
            if f"model.layers.{i}.{suffix}" in names:
                plan[f"model.layers.{i}.{suffix}"] = style()
    if not tied:
        plan["model.embed_tokens"] = row(input_layouts=Replicate())
        plan["lm_head"] = col(output_layouts=Replicate())  # full logits for the loss
    return plan


def shard_model(model: torch.nn.Module, case: Case) -> None:
    """TP (parallelize_module; fused experts Shard(1)/Shard(2)) then FSDP2 on the dp dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if case.tp > 1:
        mesh = init_device_mesh("cpu", (case.dp, case.tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = (mesh["dp"] if case.dp > 1 else None), mesh["tp"]
        parallelize_module(model, tp_mesh, _tp_plan(model, case.tie))
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):  # expert TP: gate_up colwise, down rowwise
                for attr, dim in (("gate_up_proj", 1), ("down_proj", 2)):
                    full = getattr(module, attr)
                    shard = distribute_tensor(full.detach(), tp_mesh, [Shard(dim)])
                    setattr(module, attr, torch.nn.Parameter(shard))
    else:
        dp_mesh = init_device_mesh("cpu", (case.dp,), mesh_dim_names=("dp",))
    if dp_mesh is not None:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if case.mp_bf16 else None)
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
