"""The model-shaped part of the delta benchmark (`bench/delta_bench.py --models`): real refits
of the Qwen3-30B-A3B-shaped list over a gloo group, delta against full, and the undo log's cost.

The list: `bench/model_shapes.py`'s Qwen3-30B-A3B (18,867 bf16 tensors) scaled as the
broadcast benchmark scales it on CPU (`DEFAULT_MODEL_SCALE["cpu"]`, 0.002 of each first
dimension: 145 MB), random values, cut into `BUCKET_BYTES` buckets, 2 buffers. One trainer
and `RECEIVERS` receivers, each a local process with one thread (`broadcast_bench.run_ranks`),
real `RefitSender` / `RefitReceiver` over one `RefitGroup`, four plans set up on it:
`full` (delta off), `delta` (`RefitConfig(delta=True)`), and both again with an undo log large
enough for every frame of the model (`UNDO_FACTOR` x the bucket payload bytes): `full_undo`,
`delta_undo`; `undo_bytes=0` otherwise. Each receiver loads every bucket into a model of its
own per plan (one `torch._foreach_copy_` per bucket, what a loader's copy would be); after every
refit the bytes of each receiver's models are compared with the trainer's (CRC-32), so every
figure comes from refits that landed bit for bit.

Versions: v1 random, then per density (3% and 15%) `WARMUP` + `REPS` versions, each changing
that fraction of the last one's elements (a random pick, each picked bf16 element plus a
standard normal draw, as `tests/test_delta_refit.py`'s `version_tensors` does; the fraction
whose bits did change is measured and reported). Every version is refit by all four plans
in turn (the order rotated per version), each refit between two barriers of all ranks.
v1 (the delta plans' first refit goes whole: nobody holds a base) and the first `WARMUP`
versions of each density are not counted; the figures are medians over the `REPS` after them.

Per refit: `refit_s`, from the barrier before to the barrier after (every rank done, its base
or shadow commit included: a receiver commits its staged undo log after the status exchange,
so the trainer's own `refit()` time would miss it); the sender's `RefitStats` (`pack_s`,
`delta_s`, `send_s`, `seconds`, `wire_bytes`) and its wall time; each receiver's own
`RefitStats` (`seconds`, `wait_s`, `load_s`, `delta_s`, `wire_bytes`, `delta_frames`).

Figures (per density, `full` / `delta`, i.e. both with `undo_bytes=0`):
- `qwen3_30b_refit_ratio_*`: median `refit_s` of `delta` over that of `full`.
- `qwen3_30b_wire_fraction_*`: the receiver's median wire bytes, `delta` over `full`.
- `qwen3_30b_codec_wire_ratio_*` (issue 25's "encode + wire + decode" over "pack + wire"),
  from the stats: delta side = sender `delta_s` (pack + encode of its delta-mode frames:
  every frame after v1) + the receiver's `wait_s` (blocked on the group's collectives: the
  wire) + its `delta_s` (rebuilding each frame: a copy of the base + applying the delta); full
  side = sender `pack_s` + the receiver's `wait_s`. Each side's per-refit sum (with several
  receivers, the largest receiver's `wait_s` + `delta_s`), median over the counted refits;
  the ratio of the two medians. The receiver's wait also covers the time it waits for the
  sender's pack / encode of the frame it is to get next, so each side counts part of the
  sender's work twice; `..._isolated_wire_*` replaces the receiver's wait with a plain gloo
  broadcast of the same bytes (the counted refits' median) between the same two processes
  (one tensor from a barrier, `REPS` times after one untimed: the slower rank's median).
  Left out of both: the load, the sender's shadow commit (it applies the staged deltas
  after the status exchange), the receiver's base update (with `undo_bytes=0` each delta is
  applied to the base right after the rebuild, outside `delta_s`); `refit_s` has them all.
- `undo_cost_full` / `undo_cost_delta`: median `refit_s` with the undo log over without, per
  density (`..._3pct`, `..._15pct`); `undo_cost_full` / `undo_cost_delta` are the 3% ones.
- `medians_*`: the raw medians per plan, among them `sender_commit_s` / `rx_commit_s`: the
  time `refit()` / `receive()` took after its stats' `seconds` were taken (the status
  exchange): the trainer's shadow commit, the receiver's undo log commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from typing import Any

import torch
from broadcast_bench import DEFAULT_MODEL_SCALE, make_specs, run_ranks  # beside this script
from model_shapes import MODELS, qwen3_shapes, scaled

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender, RefitStats
from common.wire.group import RefitGroup

BUCKET_BYTES = 16 << 20  # 9 buckets of the scaled list: frames to pipeline
RECEIVERS = 1  # one receiver process beside the trainer: one core each on the 2-core VM
DENSITIES = (0.03, 0.15)
WARMUP, REPS = 2, 9  # versions per density: not counted, counted
UNDO_FACTOR = 2  # undo_bytes = this x the plan's bucket payload bytes: every frame fits
PLANS = {"full": (False, False), "delta": (True, False), "full_undo": (False, True),
         "delta_undo": (True, True)}  # name -> (delta, undo log)
TIMEOUT_S = 120.0
_CODEC = ("refit_s", "sender_pack_s", "sender_delta_s", "rx_wait_s", "rx_delta_s", "rx_load_s",
          "rx_wire_bytes", "sender_commit_s", "rx_commit_s")
RAW = {"full": _CODEC, "delta": _CODEC, "full_undo": ("refit_s", "rx_commit_s"),
       "delta_undo": ("refit_s", "rx_commit_s")}  # the medians the summary line shows


def model_specs(scale: float) -> list:
    """The Qwen3-30B-A3B-shaped list, scaled, all on the one trainer (rank 0)."""
    _, config = MODELS["moe"]
    return make_specs(scaled(qwen3_shapes(config), scale), 1)


def flat_model(specs: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One bf16 buffer of every tensor, back to back, and each tensor's view into it."""
    sizes = [torch.Size(s.shape).numel() for s in specs]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16)
    views = {s.name: v.view(s.shape) for s, v in zip(specs, flat.split(sizes), strict=True)}
    return flat, views


def perturb(flat: torch.Tensor, density: float, version: int) -> float:
    """`density` of the elements (a random pick, seeded by `version`) plus a standard normal
    draw, in place; the fraction of the elements whose bits changed."""
    g = torch.Generator().manual_seed(version)
    idx = (torch.rand(flat.numel(), generator=g) < density).nonzero().squeeze(1)
    old = flat[idx]
    new = old + torch.randn(idx.numel(), generator=g).to(flat.dtype)
    flat[idx] = new
    return int((old.view(torch.int16) != new.view(torch.int16)).sum()) / flat.numel()


def schedule() -> list[tuple[int, float | None, bool]]:
    """(version, density, counted): v1 random, then WARMUP + REPS versions per density."""
    out: list[tuple[int, float | None, bool]] = [(1, None, False)]
    for density in DENSITIES:
        out += [(len(out) + 1 + i, density, i >= WARMUP) for i in range(WARMUP + REPS)]
    return out


def crc(flat: torch.Tensor) -> int:
    return zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))


def plan_config(delta: bool, undo: bool, specs: list) -> RefitConfig:
    payload = RefitPlan.build(specs, RefitConfig(bucket_bytes=BUCKET_BYTES))
    undo_bytes = UNDO_FACTOR * sum(b.nbytes for b in payload.buckets) if undo else 0
    return RefitConfig(bucket_bytes=BUCKET_BYTES, num_buffers=2, timeout_s=TIMEOUT_S,
                       delta=delta, undo_bytes=undo_bytes)


def stats_row(stats: RefitStats) -> dict[str, Any]:
    keys = ("seconds", "produce_s", "pack_s", "delta_s", "send_s", "wait_s", "load_s")
    return {**{k: getattr(stats, k) for k in keys}, "wire_bytes": stats.wire_bytes,
            "delta_frames": stats.delta_frames}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict | None:
    """One rank: the four plans' refits of every version (see the module doc); rank 0
    returns every rank's figures."""
    torch.set_num_threads(1)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=1, timeout_s=TIMEOUT_S, device="cpu")
    try:
        mine = run_rank(group, model_specs(args.scale))
        text = json.dumps({k: mine[k] for k in ("refits", "raw_wire", "setup_s")}).encode()
        assert len(text) < 1 << 20, len(text)
        rows = group.all_gather_bytes(text, 1 << 20, "gather results")
        if group.rank:
            return None
        return {r: json.loads(b.decode()) if r else mine for r, b in enumerate(rows)}
    finally:
        group.destroy()


def run_rank(group: RefitGroup, specs: list) -> dict:
    t_setup = time.perf_counter()
    flat, views = flat_model(specs)
    if group.is_trainer:
        torch.manual_seed(0)
        flat.copy_(torch.randn(flat.numel()))
        ends = {name: RefitSender.setup(group, RefitPlan.build(specs, plan_config(*on, specs)))
                for name, on in PLANS.items()}
        models = {}
    else:
        ends = {name: RefitReceiver.setup(group) for name in PLANS}
        models = {name: flat_model(specs) for name in PLANS}
    out: dict[str, Any] = {"setup_s": time.perf_counter() - t_setup, "refits": [],
                           "versions": {}, "raw_wire": {}}

    def barrier() -> None:
        group.all_gather_bytes(b"", 8, "barrier")

    order = list(PLANS)
    for version, density, counted in schedule():
        if group.is_trainer:
            changed = perturb(flat, density, version) if density else 1.0
            out["versions"][version] = {"density": density, "changed_fraction": changed,
                                        "crc": crc(flat)}
        k = version % len(order)
        for name in order[k:] + order[:k]:
            barrier()
            t0 = time.perf_counter()
            if group.is_trainer:
                stats = ends[name].refit(DictWeightSource(views), version)
            else:
                model = models[name][1]

                def load(items: list, model: dict = model) -> None:
                    torch._foreach_copy_([model[n] for n, _ in items], [t for _, t in items])

                stats = ends[name].receive(load, version=version)
            t1 = time.perf_counter()
            barrier()
            row = {"plan": name, "version": version, "density": density, "counted": counted,
                   "own_s": t1 - t0, "refit_s": time.perf_counter() - t0, **stats_row(stats)}
            if not group.is_trainer:
                row["crc"] = crc(models[name][0])
            out["refits"].append(row)
        if density and version == schedule_last(density):
            out["raw_wire"][pct(density)] = raw_wire(group, out["refits"], density)
    return out


def pct(density: float) -> str:
    return f"{round(density * 100)}pct"


def schedule_last(density: float) -> int:
    return max(v for v, d, _ in schedule() if d == density)


def raw_wire(group: RefitGroup, refits: list[dict], density: float) -> dict[str, float]:
    """A plain broadcast from the trainer of the median bytes the `delta` and `full` refits
    of `density` sent (one tensor each), from a barrier: this rank's median of REPS after one
    untimed; the sizes are the trainer's, broadcast to every rank."""
    sizes = torch.zeros(2, dtype=torch.int64)
    if group.is_trainer:
        for i, name in enumerate(("delta", "full")):
            sizes[i] = int(statistics.median(r["wire_bytes"] for r in refits if r["counted"]
                                             and r["plan"] == name and r["density"] == density))
    group.wait(group.broadcast(sizes, 0), "raw wire sizes")
    out = {}
    for name, size in zip(("delta", "full"), sizes.tolist(), strict=True):
        data = torch.full((size,), 7, dtype=torch.uint8)  # real pages, not the zero page
        times = []
        for _ in range(REPS + 1):
            group.all_gather_bytes(b"", 8, "barrier")
            t0 = time.perf_counter()
            group.wait(group.broadcast(data, 0), f"raw {size} bytes")
            times.append(time.perf_counter() - t0)
        out[f"{name}_bytes"], out[f"{name}_s"] = size, statistics.median(times[1:])
    group.take_bytes_moved()  # not the next refit's
    return out


def merged(ranks: dict[int, dict]) -> list[dict]:
    """One row per (plan, version): the trainer's figures, `refit_s` the slowest rank's (every
    rank's runs from one barrier to the next), each receiver's under `rx`."""
    trainer = ranks[0]
    rows = []
    for i, row in enumerate(trainer["refits"]):
        rx = {r: ranks[r]["refits"][i] for r in sorted(ranks) if r}
        assert all((x["plan"], x["version"]) == (row["plan"], row["version"])
                   for x in rx.values())
        want = trainer["versions"][row["version"]]["crc"]
        rows.append({**row, "refit_s": max([row["refit_s"], *(x["refit_s"] for x in
                                                                rx.values())]),
                     "bit_for_bit": all(x["crc"] == want for x in rx.values()),
                     "rx": {r: {k: x[k] for k in ("seconds", "own_s", "wait_s", "load_s",
                                                  "delta_s", "wire_bytes", "delta_frames")}
                            for r, x in rx.items()}})
    return rows


def medians(rows: list[dict], plan: str, density: float) -> dict[str, float]:
    """The counted refits of `plan` at `density`: the median of each figure, and of each side
    of the codec-wire ratio (see the module doc)."""
    mine = [r for r in rows if r["counted"] and r["plan"] == plan and r["density"] == density]
    delta = PLANS[plan][0]

    def rx_max(r: dict, *keys: str) -> float:
        return max(sum(x[k] for k in keys) for x in r["rx"].values())

    def med(fn) -> float:
        return statistics.median(fn(r) for r in mine)

    return {"refits": len(mine), "refit_s": med(lambda r: r["refit_s"]),
            "sender_seconds": med(lambda r: r["seconds"]),
            "sender_own_s": med(lambda r: r["own_s"]),
            "sender_pack_s": med(lambda r: r["pack_s"]),
            "sender_delta_s": med(lambda r: r["delta_s"]),
            "sender_send_s": med(lambda r: r["send_s"]),
            # after its stats' `seconds`: the sender's shadow commit, the receiver's base one
            "sender_commit_s": med(lambda r: r["own_s"] - r["seconds"]),
            "rx_commit_s": med(lambda r: rx_max(r, "own_s") - rx_max(r, "seconds")),
            "rx_wait_s": med(lambda r: rx_max(r, "wait_s")),
            "rx_load_s": med(lambda r: rx_max(r, "load_s")),
            "rx_delta_s": med(lambda r: rx_max(r, "delta_s")),
            "rx_wire_bytes": med(lambda r: rx_max(r, "wire_bytes")),
            "rx_delta_frames": med(lambda r: rx_max(r, "delta_frames")),
            "codec_side_s": med(lambda r: r["delta_s"] + rx_max(r, "wait_s", "delta_s")
                                if delta else r["pack_s"] + rx_max(r, "wait_s"))}


def bench_models(scale: float | None = None) -> tuple[dict, dict]:
    """Run it (see the module doc): (the report, the summary)."""
    scale = scale or DEFAULT_MODEL_SCALE["cpu"]
    specs = model_specs(scale)
    args = argparse.Namespace(scale=scale, deadline=900)
    t0 = time.perf_counter()
    ranks = run_ranks(1 + RECEIVERS, args, rank_main)
    wall = time.perf_counter() - t0
    rows = merged(ranks)
    summary: dict[str, Any] = {"bit_for_bit": all(r["bit_for_bit"] for r in rows)}
    per_density = {}
    for density in DENSITIES:
        m = {plan: medians(rows, plan, density) for plan in PLANS}
        at = pct(density)
        raw = {k: max(r["raw_wire"][at][k] for r in ranks.values())  # the slower rank's
               for k in ranks[0]["raw_wire"][at]}
        changed = [v["changed_fraction"] for v in ranks[0]["versions"].values()
                   if v["density"] == density]
        full, delta = m["full"], m["delta"]
        iso_delta = delta["sender_delta_s"] + raw["delta_s"] + delta["rx_delta_s"]
        iso_full = full["sender_pack_s"] + raw["full_s"]
        summary.update({
            f"qwen3_30b_changed_fraction_{at}": statistics.mean(changed),
            f"qwen3_30b_refit_ratio_{at}": delta["refit_s"] / full["refit_s"],
            f"qwen3_30b_wire_fraction_{at}": delta["rx_wire_bytes"] / full["rx_wire_bytes"],
            f"qwen3_30b_codec_wire_ratio_{at}": delta["codec_side_s"] / full["codec_side_s"],
            f"qwen3_30b_codec_isolated_wire_ratio_{at}": iso_delta / iso_full,
            f"undo_cost_full_{at}": m["full_undo"]["refit_s"] / full["refit_s"],
            f"undo_cost_delta_{at}": m["delta_undo"]["refit_s"] / delta["refit_s"],
            f"medians_{at}": {plan: {k: round(v, 4) for k, v in m[plan].items()
                                      if k in RAW[plan]} for plan in PLANS},
            f"isolated_wire_s_{at}": {k: round(raw[f"{k}_s"], 4) for k in ("delta", "full")}})
        per_density[at] = {"medians": m, "raw_wire": raw, "changed_fraction": changed,
                            "isolated_wire_sides_s": {"delta": iso_delta, "full": iso_full}}
    summary["undo_cost_full"] = summary["undo_cost_full_3pct"]
    summary["undo_cost_delta"] = summary["undo_cost_delta_3pct"]
    summary["wall_s"] = round(wall, 1)
    report = {"model": f"{MODELS['moe'][0]} at scale {scale}", "tensors": len(specs),
              "bytes": sum(s.nbytes for s in specs), "bucket_bytes": BUCKET_BYTES,
              "num_buffers": 2, "receivers": RECEIVERS, "densities": list(DENSITIES),
              "warmup_per_density": WARMUP, "reps": REPS, "undo_factor": UNDO_FACTOR,
              "setup_s": {r: v["setup_s"] for r, v in ranks.items()},
              "per_density": per_density, "refits": rows}
    return report, summary

