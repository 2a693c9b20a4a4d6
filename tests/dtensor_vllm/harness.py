"""End-to-end refit rounds: FSDP2 / TP trainer ranks (spawned) -> vLLM engines (own processes).

The trainers build a tiny transformers model from a config, randomise every tensor, shard it
(tests/dtensor/shard.py), take two real optimizer steps on random tokens and refit after each
step. After every step rank 0 also writes an independent reference checkpoint: DCP's full
state dict loaded into an unsharded model and written by transformers' `save_pretrained`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist

from common.clients.engine_client import EngineError
from common.clients.fleet import EngineFleet
from common.wire.group import free_port
from recipes.rank_runner import run_ranks
from tests.dtensor.shard import Case, bias_names, build_unsharded, shard_model

BUCKET_BYTES = 16 << 10  # smaller than one layer: layers straddle buckets


def write_engine_checkpoint(model: torch.nn.Module, path: str | Path) -> None:
    """`model` as vLLM's checkpoint, by save_pretrained: bf16, router bias kept fp32."""
    bias = {n: model.get_buffer(n).float().clone() for n in bias_names(model)}
    model.to(torch.bfloat16)
    for name, value in bias.items():
        mod, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod), attr, value)
    model.save_pretrained(str(path))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    from tests.dtensor.models import VOCAB

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=g)
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


class _Drifted:
    """A weight source whose rank-0 tensor `name` (default: the plan's first) comes out fp32
    where the plan says bf16."""

    def __init__(self, inner, name: str | None = None) -> None:
        self.inner, self.name = inner, name

    def plan_specs(self):
        return self.inner.plan_specs()

    def iter_tensors(self, plan):
        drifted = self.name or plan.specs[0].name
        for name, tensor in self.inner.iter_tensors(plan):
            yield name, (tensor.float() if name == drifted and tensor is not None else tensor)


def trainer_job(rank: int, world: int, port: int, case: Case, steps: list[int], mode: str,
                out_dir: str, dist_port: int) -> list:
    """One training rank; returns [(status, detail)] per refit (or the setup failure)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from common.config import RefitConfig
    from common.plan import RefitPlan, TensorSpec
    from common.transfer.sender import RefitSender
    from common.wire.group import RefitGroup
    from dtensor_refit import DTensorWeightSource, DtypePolicy
    from tests.dtensor.models import make_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=case.trainers)
    try:
        model = build_unsharded(case)
        shard_model(model, case)
        source = DTensorWeightSource(model, DtypePolicy(torch.bfloat16))
        specs = source.plan_specs()
        if mode == "wrong_shape":
            specs[3] = TensorSpec(specs[3].name, (7, 7), specs[3].dtype)
        if mode == "bias_bf16":  # the router bias declared bf16 where vLLM keeps it fp32
            specs = [TensorSpec(s.name, s.shape, torch.bfloat16, s.source_rank)
                     if s.name.endswith("e_score_correction_bias") else s for s in specs]
        timeout_s = 15 if mode == "kill_engine" else 120
        group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                           num_trainers=case.trainers, timeout_s=timeout_s, device="cpu")
        try:
            buffers = 1 if mode == "one_buffer" else 2  # 1: each bucket reuses the last's
            delta = dict(delta=True, undo_bytes=64 << 20) if mode == "delta" else {}
            # one stream: bucket 0's ABORT comes before any other frame (with concurrent
            # sources another source's frames may be loaded first: docs/refits.md)
            one = {"concurrent_sources": False} if mode == "drift_first" else {}
            sender = RefitSender.setup(group, RefitPlan.build(specs, RefitConfig(
                bucket_bytes=BUCKET_BYTES, timeout_s=timeout_s, num_buffers=buffers, **delta,
                **one)))
        except Exception as e:  # noqa: BLE001 - compared by the test
            return [(type(e).__name__, str(e))]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in steps:
            _train_step(model, opt, step)
            drift = mode in ("drift", "drift_first") and step == steps[0]
            name = "model.norm.weight" if mode == "drift" else None  # else: in bucket 0
            try:
                stats = sender.refit(_Drifted(source, name) if drift else source, step)
                out.append(("ok", step) if mode != "delta" else
                           ("ok", step, sum(t["delta_frames"] for t in stats.receivers.values())))
            except Exception as e:  # noqa: BLE001 - compared by the test
                out.append((type(e).__name__, str(e)))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if rank == 0:
                reference = make_model(case.arch, case.tie)
                reference.load_state_dict(full)
                write_engine_checkpoint(reference, Path(out_dir) / f"v{step}")
        return out
    finally:
        dist.destroy_process_group()


def refit_round(engines, case: Case, mode: str, steps: list[int], out_dir: str | Path):
    """Engines join as ranks T..; trainers train and refit; the test process drives the engines
    as one fleet through pause -> refit -> finish -> resume. Returns (trainers, answers)."""
    port = free_port()
    fleet = EngineFleet(engines)
    world = fleet.world_size(case.trainers)
    joins = fleet.join_async("127.0.0.1", port, case.trainers, timeout_s=120.0).futures
    answers: list[list] = [[] for _ in engines]

    def drive() -> None:  # one fleet: every engine paused, refit and resumed together
        for join, answer in zip(joins, answers, strict=True):
            try:
                join.result(300)
                answer.append(("join", None))
            except EngineError as e:
                answer.append(("join-error", str(e)))
        if any(a[0][0] == "join-error" for a in answers):
            return
        if mode == "kill_engine":  # the engines die before the refit reaches them
            for engine in engines:
                engine.kill()
            return
        for step in steps:
            try:
                fleet.refit(lambda: None, step)  # the trainers send from their processes
                outcome = ("refit", step)
            except EngineError as e:
                outcome = ("refit-error", str(e))
            for answer in answers:
                answer.append(outcome)

    driver = threading.Thread(target=drive)
    driver.start()
    dist_port = free_port()
    while dist_port == port:  # free_port may hand out the same unbound port twice
        dist_port = free_port()
    results = run_ranks(trainer_job, case.trainers, case, steps, mode, str(out_dir), dist_port,
                        timeout=600, port=port, group_world=world)
    driver.join(timeout=300)
    return {r: v for r, (s, v) in results.items() if s == "ok"} | {
        r: ("crashed", v) for r, (s, v) in results.items() if s != "ok"}, answers


def initial_checkpoint(case: Case, path: str | Path) -> str:
    """The engines' starting checkpoint: the trainers' randomised model before any step."""
    write_engine_checkpoint(build_unsharded(case), path)
    return str(path)
