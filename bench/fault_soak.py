"""Fault soak: many refits over a real gloo refit group, faults injected at random points.

    python bench/fault_soak.py [--refits 200] [--seed 0] [--timeout 60] [--out soak.json]

Ranks are long-lived processes (2 trainers, 2 receivers); before each refit the driver
picks a fault: none, a dtype drift, a byte flipped in a receive buffer, a loader error,
a receiver killed, or a trainer killed. The drift, flip and loader faults must fail the
refit on every rank and leave the group usable. A death must make every survivor raise
fast (the abort that travels), after which the driver starts a new generation of ranks and
a new group. After every refit that landed, each receiver compares what it received with
the trainers' tensors of that version, bit for bit. Reported: refits, faults, detected,
the slowest time to detect per fault kind, hangs (must be 0), silent wrong weights (must
be 0).
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
from provenance import save  # noqa: E402 - beside this script

TRAINERS, RECEIVERS = 2, 2
FAULTS = ("none", "drift", "flip", "loader", "kill_receiver", "kill_trainer")
WEIGHTS = (0.45, 0.1, 0.1, 0.1, 0.125, 0.125)
DEATHS = ("kill_receiver", "kill_trainer")


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(12)}
    out["router.bias"] = torch.randn(64, generator=g)
    return out


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
    from common.broadcast import RefitReceiver

    class FlippingReceiver(RefitReceiver):
        flip_bucket = -1

        def verify_bytes(self, bucket, header, payload, *args, **kwargs):
            if bucket.index == self.flip_bucket:
                payload[-1] ^= 0xFF
            return super().verify_bytes(bucket, header, payload, *args, **kwargs)

    return FlippingReceiver


def rank_main(rank: int, port: int, timeout_s: float, conn) -> None:
    """One rank: join, then one refit per command until told to stop or the group dies."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from common.broadcast import RefitReceiver, RefitSender
    from common.config import RefitConfig
    from common.errors import RefitCommError, RefitError
    from common.plan import RefitPlan
    from common.source import DictWeightSource
    from common.wire.group import RefitGroup

    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=TRAINERS + RECEIVERS,
                       num_trainers=TRAINERS, timeout_s=timeout_s, device="cpu")
    config = RefitConfig(bucket_bytes=64 << 10, timeout_s=timeout_s, checksum=True)
    specs = DictWeightSource(weights(0)).plan_specs()
    if group.is_trainer:
        end = RefitSender.setup(group, RefitPlan.build(specs, config))
    else:
        end = receiver_class()(group, RefitReceiver.setup(group).plan)
    conn.send(("ready",))
    while conn.poll(timeout_s * 4):
        command = conn.recv()
        if command[0] == "stop":
            return
        _, version, fault, victim_bucket = command
        t0, wrong = time.monotonic(), -1
        try:
            if group.is_trainer:
                end.refit(FaultySource(DictWeightSource(weights(version)), fault, rank), version)
            else:
                wrong = receive(end, rank, version, fault, victim_bucket)
            outcome = ("ok", "")
        except RefitError as e:
            outcome = (type(e).__name__, str(e)[:300])
        conn.send((*outcome, time.monotonic() - t0, wrong))
        if outcome[0] == RefitCommError.__name__:
            return  # the group is dead: this generation ends


def receive(receiver, rank: int, version: int, fault: str, bucket: int) -> int:
    """One refit on a receiver (the fault applied if this is the victim, the last receiver);
    then the count of tensors that differ from the trainers' tensors of `version`."""
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

    receiver.receive(load, version=version)
    want = weights(version)
    return sum(not torch.equal(got.get(n, torch.empty(0)), t) for n, t in want.items())


class Generation:
    """One set of rank processes in one refit group."""

    def __init__(self, timeout_s: float) -> None:
        from common.wire.group import free_port

        ctx, port = mp.get_context("spawn"), free_port()
        self.conns, self.procs = [], []
        for rank in range(TRAINERS + RECEIVERS):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, port, timeout_s, theirs))
            proc.start()
            theirs.close()  # so that a rank's death closes the pipe here
            self.conns.append(mine)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(timeout_s) or conn.recv()[0] != "ready":
                raise RuntimeError("a rank did not join the refit group")

    def refit(self, version: int, fault: str, bucket: int, wait_s: float) -> dict[int, tuple]:
        for conn in self.conns:
            conn.send(("refit", version, fault, bucket))
        replies, deadline = {}, time.monotonic() + wait_s
        for rank, conn in enumerate(self.conns):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    replies[rank] = conn.recv()
            except (EOFError, OSError):  # it died
                pass
        return replies

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def soak(refits: int, seed: int, timeout_s: float) -> dict:
    rng, counts = random.Random(seed), Counter()
    detect_s: dict[str, float] = defaultdict(float)
    generation, t_start = Generation(timeout_s), time.monotonic()
    try:
        for version in range(1, refits + 1):
            fault = rng.choices(FAULTS, WEIGHTS)[0]
            replies = generation.refit(version, fault, rng.randrange(0, 8), timeout_s + 10)
            counts["refits"] += 1
            if fault != "none":
                counts[f"fault:{fault}"] += 1
            dead = 1 if fault in DEATHS else 0
            counts["hangs"] += TRAINERS + RECEIVERS - dead - len(replies)
            if fault == "none":
                counts["landed"] += all(r[0] == "ok" for r in replies.values())
                counts["wrong_weights"] += sum(max(r[3], 0) for r in replies.values())
            else:
                counts["detected"] += bool(replies) and all(r[0] != "ok" for r in replies.values())
                detect_s[fault] = max([detect_s[fault], *(r[2] for r in replies.values())])
            if dead or any(r[0] == "RefitCommError" for r in replies.values()):
                generation.close()
                counts["restarts"] += 1
                generation = Generation(timeout_s)
    finally:
        generation.close()
    return {"counts": dict(counts), "slowest_detect_s": dict(detect_s),
            "seconds": time.monotonic() - t_start, "timeout_s": timeout_s, "seed": seed,
            "hardware": {"machine": platform.machine(), "cpu_cores": os.cpu_count(),
                         "torch": torch.__version__, "backend": "gloo",
                         "ranks": f"{TRAINERS} trainers + {RECEIVERS} receivers"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="RefitConfig.timeout_s")
    ap.add_argument("--out", help="write the report here (JSON)")
    args = ap.parse_args()
    report = soak(args.refits, args.seed, args.timeout)
    save(report, args.out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
