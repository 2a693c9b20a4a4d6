"""Jobs run on every pool rank: build a layout, randomise it, run Megatron's forward, refit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from recipes.mcore_configs import build_chunks, setup_parallel
from recipes.mcore_models import randomise
from tests.mcore.models import HIDDEN, PADDED_VOCAB, SEQ, VOCAB, Layout


def megatron_logits(layout: Layout, chunks: list[torch.nn.Module],
                    ids: torch.Tensor) -> torch.Tensor:
    """Eval-mode forward through every stage/chunk; hidden states hop stages by broadcast."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    firsts = [0] * layout.pp
    dist.all_gather_object(firsts, min(dist.get_process_group_ranks(
        ps.get_tensor_and_data_parallel_group(with_context_parallel=True))),
        group=ps.get_pipeline_model_parallel_group())
    pos = torch.arange(SEQ)[None]
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    hidden = None
    steps = [(v, s) for v in range(layout.vpp or 1) for s in range(layout.pp)]
    for i, (v, s) in enumerate(steps):
        last = i == len(steps) - 1
        shape = (1, SEQ, PADDED_VOCAB) if last else (SEQ, 1, HIDDEN)
        out = torch.empty(shape)
        if s == stage:
            model = chunks[v]
            model.eval()
            if i > 0:
                model.set_input_tensor(hidden)
            with torch.no_grad():
                out = model(ids, pos, mask).float().contiguous()
        dist.broadcast(out, src=firsts[s])
        hidden = out
    return hidden


def refit_job(rank: int, world: int, layout: Layout, seed: int,
              dtype: torch.dtype = torch.float32, sources: str = "spread") -> dict[str, Any]:
    """Everything the parent checks: specs, this rank's yielded tensors, Megatron logits, and
    where the rank sits (`where`: stage, EP rank, expert-data-parallel rank)."""
    from megatron.core import parallel_state as ps

    from common.plan import RefitPlan
    from common.source import WeightSource
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for
    from tests.mcore.models import wrap_chunks

    setup_parallel(layout)
    chunks = build_chunks(layout)
    randomise(chunks, seed)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    logits = megatron_logits(layout, chunks, ids)
    if layout.wrap:
        chunks = wrap_chunks(layout, chunks)
    source = MegatronWeightSource(chunks, converter_for(layout.model_type),
                                  vocab_size=VOCAB, policy=DtypePolicy(dtype), sources=sources)
    assert isinstance(source, WeightSource)
    specs = source.plan_specs()
    plan = RefitPlan.build(specs)
    mine: dict[str, torch.Tensor] = {}
    for spec, (name, tensor) in zip(plan.specs, source.iter_tensors(plan), strict=True):
        assert name == spec.name, (name, spec.name)
        if spec.source_rank != rank:
            assert tensor is None, f"rank {rank} yielded {name} owned by {spec.source_rank}"
            continue
        assert tensor is not None, f"source rank {rank} yielded None for {name}"
        assert tuple(tensor.shape) == spec.shape, (name, tensor.shape, spec.shape)
        assert tensor.dtype == spec.dtype, (name, tensor.dtype, spec.dtype)
        mine[name] = tensor.detach().clone()
    where = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
             ps.get_expert_data_parallel_rank())
    return {"specs": [s.to_json() for s in specs], "tensors": mine,
            "logits": logits if rank == 0 else None, "ids": ids, "where": where}


def to_grouped_layout(chunks: list[torch.nn.Module]) -> None:
    """Re-lay each SequentialMLP's local experts as legacy GroupedMLP `weight1`/`weight2`
    (which cannot be built here without the grouped_gemm package): memory block i of
    weight1 viewed [n, H, X] is expert i's fc1 shard transposed, same for weight2 [n, X2, H]."""
    for chunk in chunks:
        for module in list(chunk.modules()):
            local = getattr(module, "local_experts", None)
            if local is None:
                continue
            w1 = torch.stack([e.linear_fc1.weight.detach().t() for e in local])  # [n, H, X]
            w2 = torch.stack([e.linear_fc2.weight.detach().t() for e in local])  # [n, X2, H]
            n, hidden = w1.shape[0], w1.shape[1]
            module.local_experts = torch.nn.ModuleList()
            module.weight1 = torch.nn.Parameter(w1.contiguous().view(hidden, -1))
            module.weight2 = torch.nn.Parameter(w2.contiguous().view(n * w2.shape[1], hidden))


def grouped_job(rank: int, world: int, layout: Layout, seed: int) -> tuple[dict, dict]:
    """HF tensors of this rank from the local-spec experts and from their grouped layout."""
    from common.plan import RefitPlan
    from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for

    setup_parallel(layout)
    chunks = build_chunks(layout)
    randomise(chunks, seed)
    out = []
    for step in range(2):
        if step:
            to_grouped_layout(chunks)
        source = MegatronWeightSource(chunks, converter_for(layout.arch), vocab_size=VOCAB,
                                      policy=DtypePolicy(torch.float32))
        plan = RefitPlan.build(sorted(source.plan_specs(), key=lambda s: s.name))
        out.append({n: t.clone() for n, t in source.iter_tensors(plan) if t is not None})
    return out[0], out[1]
