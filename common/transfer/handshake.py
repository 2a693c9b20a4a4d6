"""The refit group's two exchanges besides the buckets: the plan handshake at setup (every
rank ends with rank 0's plan, or every rank raises) and the end-of-refit status records
(each rank's error and timings, so every rank learns whether a refit landed everywhere)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from common.errors import NOTHING_LOADED, PlanMismatchError, RefitAborted, RefitError
from common.plan import RefitPlan
from common.stats import RefitStats
from common.wire.transport import Transport

log = logging.getLogger(__name__)

STATUS_BYTES = 480  # one rank's status record in the all-gather

PlanCheck = Callable[[RefitPlan], str | None]


def encode_status(error: str, times: dict[str, float], verdict: bool = False) -> bytes:
    """A rank's end-of-refit record: its error ("" if none), its own timings and (rank 0)
    whether a verdict follows the commit, as JSON that fits the status slot (the error text
    is cut to fit, then the last timings dropped; never the loaded-bytes hash)."""
    record = {"times": {k: round(v, 6) if isinstance(v, float) else v
                        for k, v in times.items()}, "error": error,
              "verdict": verdict}
    while len(raw := json.dumps(record).encode()) > STATUS_BYTES:
        if record["error"]:
            record["error"] = record["error"][: -(len(raw) - STATUS_BYTES) - 3]
        elif seconds := [k for k in record["times"] if k.endswith("_s")]:
            del record["times"][seconds[-1]]
        else:
            raise ValueError(f"a status record of {len(raw)} bytes cannot fit the "
                             f"{STATUS_BYTES}-byte slot: {record}")
    return raw


def decode_status(raw: bytes) -> dict:
    try:
        record = json.loads(raw.decode())
    except ValueError:  # a record cut by the slot, or a peer of another protocol version
        return {"times": {}, "error": raw.decode(errors="replace") or "unreadable status",
                "verdict": False}
    return {"times": record.get("times", {}), "error": record.get("error", ""),
            "verdict": bool(record.get("verdict"))}


def agree_on_plan(
    group: Transport, plan: RefitPlan | None, check: PlanCheck | None = None
) -> RefitPlan:
    """Setup handshake: every rank ends with rank 0's plan, or every rank raises.

    A rank passing its own plan (every trainer, and a receiver that expects one) fails the
    setup everywhere if it differs, and the error names the ranks and the first difference.
    `check` lets a receiver refuse the plan (e.g. a tensor its model does not have): its
    answer reaches every rank the same way.
    """
    if group.rank == 0 and plan is None:
        raise ValueError("refit rank 0 (the first trainer) must provide the plan")
    data = group.broadcast_bytes(plan.to_json().encode() if group.rank == 0 else None, 0, "plan")
    theirs, problem = _read_plan(data)  # a peer of another plan format says so below
    if theirs is not None:
        problem = _plan_problem(group, plan, theirs, check)
    statuses = group.all_gather_bytes(problem.encode(), STATUS_BYTES, "plan check")
    failed = {r: s.decode(errors="replace") for r, s in enumerate(statuses) if s}
    if failed:
        lines = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise PlanMismatchError(f"{group.label}: refit plan mismatch at setup: {lines}")
    group.timeout_s = theirs.config.timeout_s  # the join timeout covered the rendezvous
    group.take_bytes_moved()  # the setup's own: not a refit's
    return theirs if plan is None else theirs.with_local_settings(plan.config)


def _plan_problem(group: Transport, plan: RefitPlan | None, theirs: RefitPlan,
                  check: PlanCheck | None) -> str:
    """Why this rank cannot take rank 0's plan `theirs`, or ""."""
    if plan is not None and (diff := plan.difference(theirs)):
        return f"plan {plan.digest[:12]} differs from rank 0's {theirs.digest[:12]}: {diff}"
    if bad := [b for b in theirs.buckets if b.source_rank >= group.num_trainers]:
        return f"bucket {bad[0].index} has source rank {bad[0].source_rank}, not a trainer"
    if check is None:
        return ""
    try:
        return check(theirs) or ""
    except Exception as e:  # noqa: BLE001 - a broken check must still reach every rank
        return f"plan check raised {type(e).__name__}: {e}"


def _read_plan(data: bytes) -> tuple[RefitPlan | None, str]:
    """Rank 0's plan, or None and why this rank cannot read it (another refit version)."""
    try:
        return RefitPlan.from_json(data.decode()), ""
    except (ValueError, KeyError) as e:
        return None, f"cannot take rank 0's plan: {e}"


def exchange_status(group: Transport, stats: RefitStats, error: BaseException | None,
                    t0: float) -> RefitStats:
    """Every rank's end-of-refit status (its error and timings) to every rank: raise on
    every rank if any failed (noting when no receiver loaded a byte); else `stats` with each
    receiver's timings. When rank 0 commits the refit to the engines after this exchange
    (`Transport.verdict_by_caller`), the other trainers then wait for its verdict: every
    trainer's refit returns only if the engines committed it."""
    if group.device.type == "cuda":
        # This rank's own work on its stream (packs, header copies, the loader's copies);
        # the collectives were waited. Not the whole device: the training job's other
        # streams, or an aborted communicator's, are not the refit's to wait for.
        torch.cuda.current_stream(group.device).synchronize()
    stats.seconds = time.perf_counter() - t0  # this rank's work, sent to the others
    stats.wire_bytes = group.take_bytes_moved()
    mine = "" if error is None else f"{type(error).__name__}: {error}"
    times = {"seconds": stats.seconds, "wait_s": stats.wait_s, "load_s": stats.load_s,
             "post_s": stats.post_s, "buckets_loaded": stats.buckets_loaded,
             "wire_bytes": stats.wire_bytes, "need_set": stats.need_set,
             "delta_frames": stats.delta_frames}
    if stats.stage_s:  # host staging only
        times.update(stage_s=stats.stage_s, device_stage_s=stats.device_stage_s)
    if stats.device_apply_s:  # a GPU apply
        times.update(device_apply_s=stats.device_apply_s, device_post_s=stats.device_post_s)
    if stats.loaded_hash and error is None:  # a failed refit's record keeps room for its error
        times["loaded_hash"] = stats.loaded_hash
    group.refits += 1
    statuses = group.all_gather_bytes(
        encode_status(mine, times, group.rank == 0 and group.verdict_by_caller), STATUS_BYTES,
        f"refit v{stats.version} status")
    stats.seconds = time.perf_counter() - t0
    group.take_bytes_moved()  # the exchange's own: not the next refit's
    records = {r: decode_status(s) for r, s in enumerate(statuses)}
    failed = {r: rec["error"] for r, rec in records.items() if rec["error"]}
    stats.receivers = {r: rec["times"] for r, rec in records.items()
                       if r >= group.num_trainers and not rec["error"]}
    untouched = all(rec["times"].get("buckets_loaded", 1) == 0
                    for r, rec in records.items() if r >= group.num_trainers)
    note = f"; {NOTHING_LOADED}" if untouched else ""
    if error is not None:
        if isinstance(error, RefitError):
            raise type(error)(f"{error}{note}") from error
        raise RefitError(f"{group.label}: refit v{stats.version} failed: {mine}{note}") from error
    if failed:
        lines = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise RefitAborted(f"{group.label}: refit v{stats.version} did not land "
                           f"(failed on {sorted(failed)}): {lines}{note}")
    if group.is_trainer and group.rank != 0 and records[0]["verdict"]:
        group.await_verdict(f"refit v{stats.version}")
    log.info("%s %s", group.label, stats.summary())
    return stats
