"""The refit group's two exchanges besides the buckets: the plan handshake at setup (every
rank ends with rank 0's plan, or every rank raises) and the end-of-refit status records
(each rank's error and timings, so every rank learns whether a refit landed everywhere)."""

from __future__ import annotations

import json
from collections.abc import Callable

from common.errors import PlanMismatchError
from common.plan import RefitPlan
from common.transport import Transport

STATUS_BYTES = 480  # one rank's status record in the all-gather

PlanCheck = Callable[[RefitPlan], str | None]


def encode_status(error: str, times: dict[str, float]) -> bytes:
    """A rank's end-of-refit record: its error ("" if none) and its own timings, as JSON that
    fits the status slot (the error text is cut to fit)."""
    record = {"times": {k: round(v, 6) for k, v in times.items()}, "error": error}
    while len(raw := json.dumps(record).encode()) > STATUS_BYTES:
        record["error"] = record["error"][: -(len(raw) - STATUS_BYTES) - 3]
    return raw


def decode_status(raw: bytes) -> dict:
    try:
        record = json.loads(raw.decode())
    except ValueError:  # a record cut by the slot, or a peer of another protocol version
        return {"times": {}, "error": raw.decode(errors="replace") or "unreadable status"}
    return {"times": record.get("times", {}), "error": record.get("error", "")}


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
    theirs = RefitPlan.from_json(data.decode())
    problem = ""
    if plan is not None and (diff := plan.difference(theirs)):
        problem = f"plan {plan.digest[:12]} differs from rank 0's {theirs.digest[:12]}: {diff}"
    if not problem and (bad := [b for b in theirs.buckets if b.source_rank >= group.num_trainers]):
        problem = f"bucket {bad[0].index} has source rank {bad[0].source_rank}, not a trainer"
    if not problem and check is not None:
        try:
            problem = check(theirs) or ""
        except Exception as e:  # noqa: BLE001 - a broken check must still reach every rank
            problem = f"plan check raised {type(e).__name__}: {e}"
    statuses = group.all_gather_bytes(problem.encode(), STATUS_BYTES, "plan check")
    failed = {r: s.decode(errors="replace") for r, s in enumerate(statuses) if s}
    if failed:
        lines = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise PlanMismatchError(f"{group.who}: refit plan mismatch at setup: {lines}")
    group.timeout_s = theirs.config.timeout_s  # the join timeout covered the rendezvous
    return theirs
