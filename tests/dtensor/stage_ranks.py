"""Jobs for the pipeline-stage / HSDP / dp x ep tests: 4 training ranks + 1 receiver.

Rank 0 checks the union of what every rank yielded against DCP's full state dict of every
stage, loaded into one unsharded model and written by `save_pretrained`; the receiver checks
two refits against `save_pretrained` of the model built with no distribution at all.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from tests.dtensor.ranks import assert_same, receiver_side, saved
from tests.dtensor.shard import Case, build_unsharded
from tests.dtensor.split import TRAINERS, Layout, build_layout


def _dcp_check(parts: list, mine: dict, layout: Layout, rank: int) -> None:
    """Every stage's DCP full state dict + every rank's yielded tensors -> compared on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict = {}
    for part in parts:  # gathers inside each stage's own mesh only
        full.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
    yielded = {n: t for n, t in mine.items() if t is not None}
    pieces: list | None = [None] * TRAINERS if rank == 0 else None
    dist.gather_object((full, yielded), pieces, dst=0)
    if rank != 0:
        return
    state: dict = {}
    got: dict = {}
    for stage_state, stage_yield in pieces:
        state.update(stage_state)
        assert not set(got) & set(stage_yield), "a tensor was yielded by two ranks"
        got.update(stage_yield)
    fresh = build_unsharded(Case(layout.arch, tie=layout.tie, seed=99))
    fresh.load_state_dict(state)
    assert_same(got, saved(fresh, _policy(layout)), "ranks vs DCP+save_pretrained")


def _policy(layout: Layout):
    from dtensor_refit import DtypePolicy

    return DtypePolicy(layout.case.out_dtype)


def _own_gathers(source) -> int:
    """DTensor entries of this rank's parts whose tensors its own stage gathers to send
    (experts sent by their owners need none)."""
    from torch.distributed.tensor import DTensor

    from dtensor_refit.source import _lookup

    first = {s.name: s.source_rank for s in source.plan_specs()}
    return sum(1 for i, e in enumerate(source.entries)
               if isinstance(_lookup(source.parts[source._part_of[i]], e.key), DTensor)
               and first[e.names[0]] == source._keys[source._part_of[i]][0][0]
               and i not in source._owners)


def _train(rank: int, layout: Layout, ports: tuple[int, int], config) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from common.plan import RefitPlan
    from common.transfer.sender import RefitSender
    from common.wire.group import RefitGroup
    from dtensor_refit import DTensorWeightSource

    model = build_layout(layout)
    parts = model if isinstance(model, list) else [model]
    source = DTensorWeightSource(model, _policy(layout), expert_sources=layout.experts)
    specs = source.plan_specs()
    mine: dict = {}
    per_name: dict[str, int] = {}  # collectives run while producing each tensor
    with CommDebugMode() as comm:
        for n, t in source.iter_tensors(RefitPlan.build(specs)):
            per_name[n] = comm.get_total_counts() - sum(per_name.values())
            mine[n] = None if t is None else t.clone()
    info = {"gathers": comm.get_total_counts(),
            "expert_gathers": sum(c for n, c in per_name.items() if ".experts." in n),
            "expert_sources": {s.name: s.source_rank for s in specs if ".experts." in s.name},
            "own_gathers": _own_gathers(source) if layout.staged else None,
            "yielded": sorted(n for n, t in mine.items() if t is not None),
            "sourced": sorted(s.name for s in specs if s.source_rank == rank),
            "sources": sorted({s.source_rank for s in specs}),
            "placements": sorted({str(t.placements) for part in parts for t in part.parameters()
                                  if hasattr(t, "placements")}),
            "names": [s.name for s in specs],
            "specs": hashlib.sha256(json.dumps([s.to_json() for s in specs]).encode())
            .hexdigest()}
    _dcp_check(parts, mine, layout, rank)
    group = RefitGroup(host="127.0.0.1", port=ports[1], rank=rank, world_size=TRAINERS + 1,
                       num_trainers=TRAINERS, device="cpu", timeout_s=config.timeout_s)
    sender = RefitSender.setup(group, RefitPlan.build(specs, config))
    sender.refit(source, 1)
    with torch.no_grad():  # a "training step": every value doubles (exact)
        for part in parts:
            for t in list(part.parameters()) + list(part.buffers()):
                t.mul_(2)
    sender.refit(source, 2)
    return info


def stage_job(rank: int, world: int, ports: tuple[int, int], layout: Layout) -> dict | None:
    from common.config import RefitConfig

    if rank > TRAINERS:
        return None
    config = RefitConfig(bucket_bytes=64 << 10, num_buffers=2, timeout_s=60)
    if rank == TRAINERS:
        return receiver_side(rank, TRAINERS, ports[1], layout.case, config)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=TRAINERS)
    try:
        return _train(rank, layout, ports, config)
    finally:
        dist.destroy_process_group()


def setup_error_job(rank: int, world: int, ports: tuple[int, int], layout: Layout
                    ) -> str | None:
    """The LayoutError message each training rank gets at setup (None: no error)."""
    from dtensor_refit import DTensorWeightSource, LayoutError

    if rank >= TRAINERS:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=TRAINERS)
    try:
        DTensorWeightSource(build_layout(layout), _policy(layout))
        return None
    except LayoutError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
