"""Broadcaster demo between local processes (`torchrun --nproc-per-node 3 <this file>`).

Ranks 0-1 play a training job (their own default gloo group, as torchrun makes it) holding an
MoE-shaped set of bf16 tensors plus an fp32 router bias; rank 2 plays a vLLM worker. A dedicated
refit group is built beside the default group; each "training step" perturbs the weights and
refits them; the receiver checks every tensor bit for bit and timings are printed.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup

TRAINERS, STEPS, EXPERTS, LAYERS = 2, 3, 64, 8


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {"model.embed_tokens.weight": torch.randn(4096, 256, generator=g).bfloat16()}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp"
        out[f"{p}.gate.weight"] = torch.randn(EXPERTS, 256, generator=g).bfloat16()
        out[f"{p}.gate.e_score_correction_bias"] = torch.randn(EXPERTS, generator=g) * 1e-3
        for e in range(EXPERTS):
            for proj, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)),
                                ("down_proj", (256, 128))):
                out[f"{p}.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g).bfloat16()
    return out


def receive_and_verify(receiver: RefitReceiver, want: dict[str, torch.Tensor]):
    """Receive one refit, comparing every tensor (bits and dtype) with the expected one."""
    checked, bad = [], []

    def check(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            checked.append(name)
            if tensor.dtype != want[name].dtype or not torch.equal(tensor, want[name]):
                bad.append(name)

    stats = receiver.receive(check)
    assert sorted(checked) == sorted(want), "names differ from the expected set"
    return stats, len(checked), bad


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the "training job's" own group, untouched by the refit
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = dist.new_group(list(range(TRAINERS)))  # e.g. the data-parallel group
    config = RefitConfig.from_env(bucket_bytes=32 << 20, num_buffers=2, timeout_s=60)
    t0 = time.perf_counter()
    group = RefitGroup(host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]) + 1,
                       rank=rank, world_size=world, num_trainers=TRAINERS,
                       timeout_s=config.timeout_s, device="cpu")
    if group.is_trainer:
        source = DictWeightSource(weights(0))
        plan = RefitPlan.build(source.plan_specs(), config)
        endpoint = RefitSender.setup(group, plan)
        if rank == 0:
            print(f"[demo] plan {plan.digest[:12]}: {len(plan.specs)} tensors, "
                  f"{plan.total_bytes / 1e6:.0f} MB, {len(plan.buckets)} buckets of "
                  f"<= {config.bucket_bytes >> 20} MiB, {config.num_buffers} buffers; "
                  f"setup {time.perf_counter() - t0:.2f}s", flush=True)
    else:
        endpoint = RefitReceiver.setup(group)
    for step in range(1, STEPS + 1):
        if group.is_trainer:
            source.tensors = weights(step)  # stands in for an optimizer step
            dist.barrier(group=trainers)  # the job's own groups still work beside the refit group
            stats = endpoint.refit(source, version=step)
            if rank == 0:
                print(f"[demo] trainer  {stats.summary()}", flush=True)
        else:
            stats, checked, bad = receive_and_verify(endpoint, weights(step))
            print(f"[demo] receiver {stats.summary()}; {checked} tensors checked bit for bit "
                  f"(dtype included), {len(bad)} wrong", flush=True)
            assert not bad, bad[:3]
    group.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
