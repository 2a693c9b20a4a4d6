"""Jobs run on every pool process: shard a model, gather it, check it, refit it end to end.

Training ranks 0..T-1 form the default group (FSDP2 / TP), rank T is the vLLM-side receiver;
all T + 1 join one refit group. Two references, both bit for bit after the dtype policy:
rank 0 checks the yielded tensors against DCP's full state dict loaded into an unsharded model
and written by `save_pretrained`; the receiver rebuilds the same model with no distribution
at all, writes it with `save_pretrained`, and checks what it received.
"""

from __future__ import annotations

import hashlib
import json
import tempfile

import torch
import torch.distributed as dist

from tests.dtensor.shard import Case, bias_names, build_unsharded, shard_model


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def saved(model: torch.nn.Module, policy, headers: dict | None = None) -> dict[str, torch.Tensor]:
    """What save_pretrained writes, read back with safetensors, then cast by the policy.

    `headers`, if given, receives the checkpoint's {name: (shape, dtype)} from its headers.
    """
    from safetensors.torch import load_file

    from dtensor_refit import checkpoint_specs

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        raw = load_file(f"{d}/model.safetensors")
        if headers is not None:
            headers.update(checkpoint_specs(d))
    return {n: t.to(policy.dtype_for(n, t.dtype)) for n, t in raw.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}: {name} {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        assert torch.equal(bits(g), bits(w)), f"{what}: {name} differs"


def _policy(case: Case):
    from dtensor_refit import DtypePolicy

    return DtypePolicy(case.out_dtype)


def _train_side(rank: int, case: Case, port: int) -> tuple:
    from torch.distributed.tensor.debug import CommDebugMode

    from common.plan import RefitPlan
    from dtensor_refit import DTensorWeightSource

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=case.trainers)
    model = build_unsharded(case)
    bias_fp32 = {n: model.get_buffer(n).float().clone() for n in bias_names(model)}
    shard_model(model, case)
    info: dict = {}
    if case.forward:
        with torch.no_grad():
            model(torch.arange(8).reshape(1, 8))
        w = model.get_parameter("model.norm.weight")
        info["root_unsharded_after_forward"] = type(w).__name__
    with CommDebugMode() as comm:
        source = DTensorWeightSource(model, _policy(case))
        specs = source.plan_specs()
    info["plan_comms"] = comm.get_total_counts()
    plan = RefitPlan.build(specs)
    with CommDebugMode() as comm:
        mine = {n: None if t is None else t.clone() for n, t in source.iter_tensors(plan)}
    info["iter_comms"] = comm.get_total_counts()
    info["digest"] = plan.digest
    sources = {s.name: s.source_rank for s in specs}  # experts: sent by their owners
    info["none_off_source"] = all(t is None for n, t in mine.items() if sources[n] != rank)
    if rank == 0:
        for name, value in bias_fp32.items():  # the router bias: declared and sent as fp32
            spec = next(s for s in specs if s.name == name)
            assert spec.dtype == torch.float32 and mine[name].dtype == torch.float32, name
            want = value if case.bias_fp32 or case.model_dtype == torch.float32 \
                else value.to(torch.bfloat16).float()
            assert torch.equal(mine[name], want), f"{name}: not the training value"
        info["bias"] = sorted(bias_fp32)
    return model, source, specs, mine, info


def _dcp_reference(model, case: Case, rank: int) -> dict | None:
    """DCP's full state dict (a collective) -> unsharded model -> save_pretrained (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank != 0:
        return None
    fresh = build_unsharded(Case(case.arch, tie=case.tie, model_dtype=case.model_dtype,
                                 bias_fp32=case.bias_fp32, seed=case.seed + 99))
    fresh.load_state_dict(full)
    return saved(fresh, _policy(case))


def _yields_on_rank0(mine: dict, rank: int, trainers: int) -> dict | None:
    """What every training rank yielded (experts come from their owners), united on rank 0."""
    pieces: list | None = [None] * trainers if rank == 0 else None
    dist.gather_object({n: t for n, t in mine.items() if t is not None}, pieces, dst=0)
    if pieces is None:
        return None
    got: dict = {}
    for piece in pieces:
        assert not set(got) & set(piece), "a tensor was yielded by two ranks"
        got.update(piece)
    return got


def refit_job(rank: int, world: int, ports: tuple[int, int], case: Case) -> dict | None:
    from common.config import RefitConfig
    from common.plan import RefitPlan
    from common.transfer.sender import RefitSender
    from common.wire.group import RefitGroup

    trainers = case.trainers
    if rank > trainers:
        return None
    config = RefitConfig(bucket_bytes=64 << 10, num_buffers=2, timeout_s=60)
    if rank < trainers:
        try:
            model, source, specs, mine, info = _train_side(rank, case, ports[0])
            ref = _dcp_reference(model, case, rank)
            got = _yields_on_rank0(mine, rank, trainers)
            if ref is not None:
                assert_same(got, ref, "ranks vs DCP+save_pretrained")
            group = RefitGroup(host="127.0.0.1", port=ports[1], rank=rank,
                               world_size=trainers + 1, num_trainers=trainers, device="cpu",
                               timeout_s=config.timeout_s)
            sender = RefitSender.setup(group, RefitPlan.build(specs, config))
            sender.refit(source, 1)
            with torch.no_grad():  # a "training step": every value doubles (exact)
                for t in list(model.parameters()) + list(model.buffers()):
                    t.mul_(2)
            sender.refit(source, 2)
            info["specs"] = hashlib.sha256(json.dumps([s.to_json() for s in specs])
                                           .encode()).hexdigest()
            info["names"] = [s.name for s in specs]
            return info
        finally:
            dist.destroy_process_group()
    return receiver_side(rank, trainers, ports[1], case, config)


def receiver_side(rank: int, trainers: int, port: int, case: Case, config) -> dict:
    """The vLLM-side rank: vets the plan against the checkpoint, checks two refits exactly."""
    from common.plan import RefitPlan
    from common.transfer.sender import RefitReceiver
    from common.wire.group import RefitGroup
    from dtensor_refit import compare_with_checkpoint
    from tests.multiproc import receive_all

    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=trainers + 1,
                       num_trainers=trainers, device="cpu", timeout_s=config.timeout_s)
    headers: dict = {}
    want = saved(build_unsharded(case), _policy(case), headers)

    def vet(plan: RefitPlan) -> str | None:  # the plan must fit the engine's checkpoint
        return "; ".join(compare_with_checkpoint(plan.specs, headers)) or None

    receiver = RefitReceiver.setup(group, check=vet)
    out = {}
    for version, factor in ((1, 1), (2, 2)):
        stats, got = receive_all(receiver)
        assert stats.version == version
        assert_same(got, {n: t * factor for n, t in want.items()}, f"receiver v{version}")
        out[version] = len(got)
    return {"received": out, "names": sorted(want)}
