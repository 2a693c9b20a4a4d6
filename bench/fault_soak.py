"""Fault soak: many refits over a real gloo refit group, faults injected at random points.

    python bench/fault_soak.py [--refits 200 | --quick] [--seed 0] [--timeout 60] [--delta]
                               [--out soak.json]

Ranks are long-lived processes (2 trainers, 2 receivers); before each refit the driver
picks a fault: none, a dtype drift, a byte flipped in a receive buffer, a loader error,
a receiver killed, or a trainer killed. The drift, flip and loader faults must fail the
refit on every rank and leave the group usable. A death must make every survivor raise
fast (the abort that travels), after which the driver starts a new generation of ranks and
a new group. After every refit that landed, each receiver compares what it received with
the trainers' tensors of that version, bit for bit. Reported: refits, faults, detected,
the slowest time to detect per fault kind, hangs (must be 0), silent wrong weights (must
be 0). The last line printed is the report, one JSON object.

--delta (`bench/fault_soak_delta.py`): delta refits with an undo log (RefitConfig(delta=True,
undo_bytes=...)); each version changes a few percent of the last one's elements. A rank that
survives a death keeps its process and its base (or shadow) and rejoins the next group; only
the dead rank starts afresh: after a receiver's death the next refit goes whole and must land
(trainer 1 sources no frame, so after its death deltas go on). After every failed
refit each surviving receiver rolls back and the re-applied bytes are compared with the last
version that landed, bit for bit. Also reported: refits that went as deltas, rollbacks ok /
refused (with the reasons) / wrong (must be 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from fault_soak_delta import (  # noqa: E402 - beside this script
    UNDO_BYTES,
    DeltaTally,
    delta_weights,
    roll_back_check,
    transplant,
)
from provenance import save  # noqa: E402 - beside this script

TRAINERS, RECEIVERS = 2, 2
FAULTS = ("none", "drift", "flip", "loader", "kill_receiver", "kill_trainer")
WEIGHTS = (0.45, 0.1, 0.1, 0.1, 0.125, 0.125)
DEATHS = ("kill_receiver", "kill_trainer")
SOURCES = {0}  # the trainers that source frames (the plan's buckets all come from rank 0)


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(12)}
    out["router.bias"] = torch.randn(64, generator=g)
    return out


def version_weights(version: int, delta: bool) -> dict[str, torch.Tensor]:
    """The trainers' tensors of `version`: fresh random ones, or (delta) a sparse change of
    the last version's."""
    return delta_weights(version, weights) if delta else weights(version)


class FaultySource:
    """The trainers' weights of one version; rank 0 drifts, or rank 1 dies, at tensor 4."""

    def __init__(self, inner, fault: str, rank: int) -> None:
        self.inner, self.fault, self.rank = inner, fault, rank

    def plan_specs(self):
        return self.inner.plan_specs()

    def iter_tensors(self, plan):
        for i, (name, tensor) in enumerate(self.inner.iter_tensors(plan)):
            if i == 4 and self.fault == "kill_trainer" and self.rank == 1:
                os._exit(17)
            if i == 4 and self.fault == "drift" and self.rank == 0:
                tensor = tensor.bfloat16()
            yield name, tensor


def receiver_class():
    from common.transfer.sender import RefitReceiver

    class FlippingReceiver(RefitReceiver):
        flip_bucket = -1

        def verify_bytes(self, bucket, header, payload, *args, **kwargs):
            if bucket.index == self.flip_bucket:
                payload[-1] ^= 0xFF
            return super().verify_bytes(bucket, header, payload, *args, **kwargs)

    return FlippingReceiver


def join(rank: int, port: int, timeout_s: float, delta: bool):
    """This rank's endpoint in a new refit group at `port`."""
    from common.config import RefitConfig
    from common.plan import RefitPlan
    from common.source import DictWeightSource
    from common.transfer.sender import RefitReceiver, RefitSender
    from common.wire.group import RefitGroup

    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=TRAINERS + RECEIVERS,
                       num_trainers=TRAINERS, timeout_s=timeout_s, device="cpu")
    extra = {"delta": True, "undo_bytes": UNDO_BYTES} if delta else {}
    config = RefitConfig(bucket_bytes=64 << 10, timeout_s=timeout_s, checksum=True, **extra)
    specs = DictWeightSource(weights(0)).plan_specs()
    if group.is_trainer:
        return RefitSender.setup(group, RefitPlan.build(specs, config))
    return receiver_class()(group, RefitReceiver.setup(group).plan)


def rank_main(rank: int, port: int, timeout_s: float, conn, delta: bool = False) -> None:
    """One rank: join, then one refit per command until told to stop or the group dies (in
    delta mode a survivor waits to rejoin the next group, keeping its base / shadows)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    end = join(rank, port, timeout_s, delta)
    conn.send(("ready",))
    while conn.poll(timeout_s * 4):
        command = conn.recv()
        if command[0] == "stop":
            return
        if command[0] == "rejoin":
            end.group.destroy()
            new = join(rank, command[1], timeout_s, delta)
            transplant(end, new)
            end = new
            conn.send(("ready",))
            continue
        reply = refit_once(end, rank, command, delta)
        conn.send(reply)
        if reply[0] == "RefitCommError" and not delta:
            return  # the group is dead: this generation ends


def refit_once(end, rank: int, command: tuple, delta: bool) -> tuple:
    """One refit on this rank: (outcome, message, seconds, wrong tensors, extra); a
    receiver's extra: its delta frames, or (a failed refit, delta mode) its rollback."""
    from common.errors import RefitError
    from common.source import DictWeightSource

    _, version, fault, victim_bucket, landed = command
    t0, wrong, extra = time.monotonic(), -1, {}
    try:
        if end.group.is_trainer:
            source = DictWeightSource(version_weights(version, delta))
            end.refit(FaultySource(source, fault, rank), version)
        else:
            wrong, extra = receive(end, rank, version, fault, victim_bucket, delta)
        outcome = ("ok", "")
    except RefitError as e:
        outcome = (type(e).__name__, str(e)[:300])
        if delta and not end.group.is_trainer:
            want = version_weights(landed, delta) if landed else {}
            extra = {"rollback": roll_back_check(end, want)}
    return (*outcome, time.monotonic() - t0, wrong, extra)


def receive(receiver, rank: int, version: int, fault: str, bucket: int,
            delta: bool = False) -> tuple[int, dict]:
    """One refit on a receiver (the fault applied if this is the victim, the last receiver);
    then the count of tensors that differ from the trainers' tensors of `version`, and the
    frames that arrived as deltas."""
    victim = rank == TRAINERS + RECEIVERS - 1
    receiver.flip_bucket = bucket if victim and fault == "flip" else -1
    got: dict[str, torch.Tensor] = {}
    calls = []

    def load(items) -> None:
        calls.append(1)
        if victim and len(calls) == bucket + 1 and fault in ("loader", "kill_receiver"):
            if fault == "kill_receiver":
                os._exit(17)
            raise KeyError("soak: a loader error")
        got.update((n, t.clone()) for n, t in items)

    stats = receiver.receive(load, version=version)
    want = version_weights(version, delta)
    wrong = sum(not torch.equal(got.get(n, torch.empty(0)), t) for n, t in want.items())
    return wrong, {"delta_frames": stats.delta_frames}


class Generation:
    """One set of rank processes in one refit group (in delta mode the survivors of a death
    rejoin a new group, `rejoin`)."""

    def __init__(self, timeout_s: float, delta: bool = False) -> None:
        self.timeout_s, self.delta = timeout_s, delta
        self.ctx = mp.get_context("spawn")
        self.conns: list = [None] * (TRAINERS + RECEIVERS)
        self.procs: list = [None] * (TRAINERS + RECEIVERS)
        self._start(range(TRAINERS + RECEIVERS), [])

    def _start(self, fresh, survivors) -> None:
        """Start the `fresh` ranks' processes and ask the `survivors` to rejoin, all in a new
        group; wait until every rank has joined it."""
        from common.wire.group import free_port

        port = free_port()
        for rank in fresh:
            mine, theirs = self.ctx.Pipe()
            proc = self.ctx.Process(target=rank_main,
                                    args=(rank, port, self.timeout_s, theirs, self.delta))
            proc.start()
            theirs.close()  # so that a rank's death closes the pipe here
            self.conns[rank], self.procs[rank] = mine, proc
        for rank in survivors:
            self.conns[rank].send(("rejoin", port))
        for conn in self.conns:
            if not conn.poll(self.timeout_s) or conn.recv()[0] != "ready":
                raise RuntimeError("a rank did not join the refit group")

    def refit(self, version: int, fault: str, bucket: int, wait_s: float,
              landed: int = 0) -> dict[int, tuple]:
        for conn in self.conns:
            conn.send(("refit", version, fault, bucket, landed))
        replies, deadline = {}, time.monotonic() + wait_s
        for rank, conn in enumerate(self.conns):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    replies[rank] = conn.recv()
            except (EOFError, OSError):  # it died
                pass
        return replies

    def rejoin(self, replies: dict[int, tuple]) -> list[int]:
        """After a death: the ranks that did not reply are ended and started afresh (no base),
        the others rejoin the new group with what they hold; returns the fresh ranks."""
        fresh = [rank for rank in range(TRAINERS + RECEIVERS) if rank not in replies]
        for rank in fresh:
            self._end(rank)
        self._start(fresh, [rank for rank in replies])
        return fresh

    def _end(self, rank: int) -> None:
        conn, proc = self.conns[rank], self.procs[rank]
        if proc.is_alive():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    def close(self) -> None:
        for rank in range(TRAINERS + RECEIVERS):
            self._end(rank)


def soak(refits: int, seed: int, timeout_s: float, delta: bool = False) -> dict:
    rng, counts = random.Random(seed), Counter()
    detect_s: dict[str, float] = defaultdict(float)
    tally = DeltaTally(counts, range(TRAINERS, TRAINERS + RECEIVERS), SOURCES)
    landed = 0
    generation, t_start = Generation(timeout_s, delta), time.monotonic()
    try:
        for version in range(1, refits + 1):
            fault = rng.choices(FAULTS, WEIGHTS)[0]
            replies = generation.refit(version, fault, rng.randrange(0, 8), timeout_s + 10,
                                       landed)
            counts["refits"] += 1
            if fault != "none":
                counts[f"fault:{fault}"] += 1
            dead = 1 if fault in DEATHS else 0
            counts["hangs"] += TRAINERS + RECEIVERS - dead - len(replies)
            ok = bool(replies) and all(r[0] == "ok" for r in replies.values())
            if fault == "none":
                counts["landed"] += ok
                counts["wrong_weights"] += sum(max(r[3], 0) for r in replies.values())
            else:
                counts["detected"] += bool(replies) and all(r[0] != "ok" for r in replies.values())
                detect_s[fault] = max([detect_s[fault], *(r[2] for r in replies.values())])
            if delta:
                landed = version if ok and not dead else landed
                tally.landed(replies) if ok and not dead else tally.failed(replies, fault)
            if dead or any(r[0] == "RefitCommError" for r in replies.values()):
                counts["restarts"] += 1
                if delta:
                    tally.restarted(generation.rejoin(replies))
                else:
                    generation.close()
                    generation = Generation(timeout_s)
    finally:
        generation.close()
    counts["failed"] = counts["refits"] - counts["landed"]
    extra = tally.report() if delta else {}
    return {"mode": "delta" if delta else "whole", "counts": dict(counts),
            "slowest_detect_s": dict(detect_s), **extra,
            "seconds": time.monotonic() - t_start, "timeout_s": timeout_s, "seed": seed,
            "hardware": {"machine": platform.machine(), "cpu_cores": os.cpu_count(),
                         "torch": torch.__version__, "backend": "gloo",
                         "ranks": f"{TRAINERS} trainers + {RECEIVERS} receivers"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="24 refits (a short soak)")
    ap.add_argument("--delta", action="store_true",
                    help="delta refits with an undo log; rollbacks checked after each failure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="RefitConfig.timeout_s")
    ap.add_argument("--out", help="write the report here (JSON)")
    args = ap.parse_args()
    report = soak(24 if args.quick else args.refits, args.seed, args.timeout, args.delta)
    save(report, args.out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
