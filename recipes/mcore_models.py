"""The recipes' tiny Megatron GPT models (configs in `recipes.mcore_configs`, SERVABLE sizes):
train them over the pipeline, score them, fill them with distinguishable random weights.

Dense: Qwen3-like (q/k norms, GQA, gated SiLU MLP). MoE: Qwen3-MoE (every layer MoE, top-2 of 4
experts, softmax router).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from recipes.mcore_configs import SERVABLE, Layout, build_chunks

# the recipes' models are SERVABLE-sized; the training loop's shapes
VOCAB, HIDDEN, MAX_POS = SERVABLE.vocab, SERVABLE.hidden, SERVABLE.max_pos
SEQ, MICRO, MICROBATCHES, LR = 32, 2, 2, 3e-3

DENSE = Layout("qwen3", tp=2, pp=2)
MOE = Layout("qwen3_moe", tp=1, pp=2, ep=2)  # MoE+TP training needs sequence parallel (TE only)


def build_model(layout: Layout) -> list[torch.nn.Module]:
    """This rank's model chunk for training (vocab-parallel logits), fp32 on CPU."""
    return build_chunks(layout, parallel_output=True)


def wrap_for_training(chunks: list[torch.nn.Module]) -> tuple[list[torch.nn.Module], object]:
    """Megatron DDP around each chunk (grad buffers; DP / expert-DP all-reduce in
    finalize_model_grads, which also sums q/k-norm grads over TP) and torch AdamW."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c) for c in chunks]
    params = [p for c in model for p in c.parameters()]
    return model, torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _pipeline_forward(model: list[torch.nn.Module], tokens: torch.Tensor, labels=None):
    """Forward of this stage for [b, s] tokens; hidden states arrive from the previous stage
    by recv and leave by send. Returns (this stage's input, its output)."""
    from megatron.core import parallel_state as ps

    from mcore_refit.names import unwrap

    b, s = tokens.shape
    x = None
    if not ps.is_pipeline_first_stage():
        x = torch.empty(s, b, HIDDEN)
        dist.recv(x, ps.get_pipeline_model_parallel_prev_rank())
        unwrap(model[0]).set_input_tensor(x.requires_grad_(torch.is_grad_enabled()))
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    out = model[0](tokens, torch.arange(s)[None], mask, labels=labels)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach(), ps.get_pipeline_model_parallel_next_rank())
    return x, out


def train_step(model: list[torch.nn.Module], opt: torch.optim.Optimizer, step: int,
               batches: torch.Tensor | None = None) -> float:
    """One optimizer step: all forwards then all backwards over the pipeline (hidden states and
    their grads hop stages by send/recv; Megatron's own schedule allocates on "cuda"), then
    Megatron's finalize_model_grads. `batches` [MICROBATCHES, MICRO, SEQ + 1] token ids (this
    data-parallel rank's; default: random, seeded by step and rank). Returns the mean loss on
    the last stage (else nan)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if batches is None:
        g = torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank())
        batches = torch.randint(0, VOCAB, (MICROBATCHES, MICRO, SEQ + 1), generator=g)
    model[0].train()
    model[0].zero_grad_buffer()
    passes = [_pipeline_forward(model, t[:, :-1], t[:, 1:] if last else None) for t in batches]
    losses = []
    for x, out in passes:
        if last:
            loss = out.mean() / MICROBATCHES
            loss.backward()
            losses.append(loss.item())
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if not first:
            dist.send(x.grad, ps.get_pipeline_model_parallel_prev_rank())
    finalize_model_grads(model)
    for p in model[0].parameters():
        p.grad = p.main_grad
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(losses) if last else float("nan")


def dp_share(samples: list[list[int]]) -> torch.Tensor:
    """This data-parallel rank's share of `samples` (every rank's list is the same) as
    [MICROBATCHES, MICRO, SEQ + 1] micro-batches for `train_step`."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return torch.tensor(samples[rank::dp]).view(MICROBATCHES, MICRO, SEQ + 1)


def megatron_logprobs(model: list[torch.nn.Module], seqs: list[list[int]],
                      starts: list[int]) -> list[list[float]] | None:
    """Megatron's own eval forward (weights rounded to bf16 for it, as the engine holds them):
    logprob of seq[i] given seq[:i] for i >= start, per sequence. Result on the last stage."""
    from megatron.core import parallel_state as ps

    params = [p for c in model for p in c.parameters()]
    saved = [p.detach().clone() for p in params]
    out: list[list[float]] = []
    model[0].eval()
    with torch.no_grad():
        for p in params:
            p.copy_(p.bfloat16().float())
        for seq, start in zip(seqs, starts, strict=True):
            _, logits = _pipeline_forward(model, torch.tensor([seq]))
            if ps.is_pipeline_last_stage():
                group = ps.get_tensor_model_parallel_group()  # logits are vocab-parallel
                parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, logits.contiguous(), group=group)
                lp = torch.cat(parts, -1)[0, :, :VOCAB].float().log_softmax(-1)
                out.append([lp[i - 1, seq[i]].item() for i in range(start, len(seq))])
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)
    return out if ps.is_pipeline_last_stage() else None


def randomise(chunks: list[torch.nn.Module], seed: int) -> None:
    """Fill every weight (norms, biases, expert bias too) from its global name and shard.

    Replicated tensors get the same values on every rank, shards differ per TP/ETP rank, so
    Megatron's own forward is consistent and every value is distinguishable.
    """
    from megatron.core import parallel_state as ps

    from mcore_refit import names

    tp, etp = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    ep = ps.get_expert_model_parallel_rank()
    for chunk in chunks:
        offsets = names.layer_offsets(names.unwrap(chunk))
        items = list(chunk.named_parameters()) + [
            (n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
        for raw, t in items:
            name, _ = names.globalize_layer(names.strip_module_prefixes(raw), offsets)
            slot = names.expert_slot(name)
            shard = 0
            if getattr(t, "tensor_model_parallel", False):
                shard = etp if slot else tp
            key = f"{seed}:{name}:{shard}:{ep if slot else 0}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            with torch.no_grad():
                if t.dim() == 1 and ("norm" in name or "layernorm" in name):
                    t.copy_(1.0 + 0.2 * noise)
                elif t.dim() == 1:
                    t.copy_(0.2 * noise)
                else:
                    t.copy_(noise * (0.5 if "embedding" in name else 0.12))
    sync_tied_output(chunks)


def sync_tied_output(chunks: list[torch.nn.Module]) -> None:
    """Tied + PP>1: the last stage's `output_layer` copy must equal the embedding (Megatron
    zeroes it and all-reduces over the embedding group at init, as done here)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    for chunk in chunks:
        if not getattr(chunk, "share_embeddings_and_output_weights", False):
            continue
        weight = chunk.shared_embedding_or_output_weight()
        if weight is None:
            continue
        with torch.no_grad():
            if not chunk.pre_process:
                weight.zero_()
            dist.all_reduce(weight.data, group=ps.get_embedding_group())
