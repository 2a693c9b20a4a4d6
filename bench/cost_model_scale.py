"""The cost model at scale: a published model's tensors, a trainer and an engine layout, the
links, the options -> each bucket's stage costs -> the refit's time (`cost_model_core`), as a
range (best / expected / worst) over the measured lends and the assumed figures. In one ordered
stream (`timeline`: every bucket one collective over every trainer and engine worker) or by
concurrent sources (`concurrent_timeline`: each source rank's buckets its own stream)."""

from __future__ import annotations

import copy
import math
import re
import statistics
from dataclasses import replace
from functools import cache

from cost_model_check import machine
from cost_model_core import (
    Bucket,
    StageCosts,
    Timeline,
    concurrent,
    cut,
    gather_group,
    imbalance,
    interleave,
    place_stage,
    simulate,
    spread,
)
from cost_model_inputs import (
    LEND_SPREAD,
    MEMORY_GB,
    Engine,
    Figure,
    Links,
    Options,
    Trainer,
    assumed_at_scale,
    cuda_engine_figures,
    host_range,
    load,
    measured,
    quantize_figure,
    same,
)
from model_shapes import CONFIGS, experts_of, shapes_of

CASES = ("best", "expected", "worst")


class LayoutError(ValueError):
    """A case the model cannot answer: an unknown model, a layout that does not divide it,
    missing links."""


@cache
def figures() -> dict[str, Figure]:
    """Every constant the at-scale model reads, measured (from bench/results/) or assumed."""
    lends = [machine(r) for r in ("gpu_h200x1", "gpu_h200x1_checksum_off")]
    mg = load("mcore_gather_h200")
    nv = [machine(r).wire_Bps / 1e9 for r in ("multi_gpu_nvidia-h200-x2_run1",
                                              "multi_gpu_nvidia-h200-x2_run2")]
    codec, shard = load("delta_codec_h200"), load("shard_cpu_quick")["summary"]
    out = {f.name: f for f in (
        measured("host_s_per_tensor", "gpu_h200x1", host_range([m.host_s for m in lends]),
                 "s", "sender host work per tensor, the two 1 x H200 lends (also "
                 f"gpu_h200x1_checksum_off); worst: {LEND_SPREAD}x their mean"),
        measured("host_s_per_bucket", "gpu_h200x1", host_range([m.bucket_s for m in lends]),
                 "s", "sender host work per bucket, the same lends (fitted on both synthetic "
                 f"lists); worst: {LEND_SPREAD}x their mean"),
        measured("pack_Bps", "gpu_h200x1", same(lends[0].pack_Bps), "B/s", "as a refit packs"),
        measured("gather_Bps", "mcore_gather_h200",
                 (mg["dense"]["gather_gbps"] * 1e9, *same(mg["moe"]["gather_gbps"] * 1e9)[:2]),
                 "B/s", "Megatron gather + convert, TP1 (best: the dense model's)"),
        measured("scatter_Bps", "receiver_scatter_h200",
                 same(load("receiver_scatter_h200")["scatter"]["scatter_tbps"] * 1e12), "B/s",
                 "the CUDA scatter kernel alone"),
        measured("nvlink_bus_GBps", "multi_gpu_nvidia-h200-x2_run1",
                 (max(nv), statistics.mean(nv), min(nv)), "GB/s",
                 "one raw NCCL broadcast, 2 x H200 (also _run2); 8-GPU rings assumed alike"),
        measured("copy_Bps", "delta_codec_h200", same(codec["bytes"] / codec["one_copy_s"]),
                 "B/s", "one device copy"),
        measured("encode_over_copy", "delta_codec_h200",
                 same(codec["summary"]["encode_over_copy_3pct"]), "x one copy", "at 3%"),
        measured("rebuild_over_copy", "delta_codec_h200",
                 same(codec["summary"]["rebuild_over_copy_3pct"]), "x one copy", "at 3%"),
        measured("gather_over_pack", "shard_gather_h200",
                 same(load("shard_gather_h200")["gather_over_pack"]), "x the pack",
                 "the sender's compact need-set gather"),
        measured("need_overhead", "shard_cpu_quick",
                 same(shard["tp2_received_fraction"] / shard["tp2_floor_fraction"]),
                 "x the floor", "need-set bytes over what a worker's map reads"),
        *cuda_engine_figures(),
        quantize_figure(),
    )}
    return out | assumed_at_scale()


def wire_fraction(density: float) -> float:
    """A delta's bytes over the full bytes: the 1-bit-per-2-byte-word mask + changed words."""
    return 1 / 16 + density


def _check(model: str, t: Trainer, e: Engine, links: Links, o: Options) -> None:
    if model not in CONFIGS:
        raise LayoutError(f"unknown model {model!r}; known: {', '.join(CONFIGS)}")
    c, experts = CONFIGS[model], experts_of(CONFIGS[model])
    for what, n, d in (("trainer tp", c.heads, t.tp), ("engine tp", c.heads, e.tp),
                       ("trainer ep", experts or 1, t.ep), ("engine ep", experts or 1, e.ep),
                       ("trainer pp", c.layers, t.pp)):
        if d < 1 or (n % d if what != "trainer pp" else d > n):
            raise LayoutError(f"{what}={d} does not divide {model} ({n})")
    if (t.tp * t.dp) % (t.ep * t.etp):
        raise LayoutError(f"trainer tp x dp ({t.tp * t.dp}) is not a multiple of ep x etp")
    if e.gpus_each % min(e.tp, e.ep) or t.gpus % t.gpus_per_node and t.gpus > t.gpus_per_node:
        raise LayoutError("a layout does not fill its nodes (engine tp / ep, trainer nodes)")
    if min(links.nvlink_GBps, links.nics_per_node, links.nic_Gbps) <= 0:
        raise LayoutError("zero links: NVLink, NICs per node and NIC speed must be > 0")
    if o.mode not in ("full", "delta", "shard") or o.wire_bytes not in (1, 2) or o.buffers < 1:
        raise LayoutError(f"options: mode full|delta|shard, wire bytes 1|2, buffers >= 1: {o}")
    need = _elements(model) * o.wire_bytes / e.gpus_each / 1e9
    if need > 0.9 * MEMORY_GB[links.gpu]:
        raise LayoutError(f"{model} needs {need:.0f} GB per engine GPU: more than "
                          f"{links.gpu}'s {MEMORY_GB[links.gpu]} GB; raise engine tp / ep")


@cache
def _elements(model: str) -> int:
    return sum(math.prod(s) for _, s in shapes_of(CONFIGS[model]))


_LAYER = re.compile(r"\.layers\.(\d+)\.")


@cache
def buckets(model: str, t: Trainer, bucket_bytes: int,
            interleaved: bool = False) -> tuple[Bucket, ...]:
    cuts = cut(owners(model, t), bucket_bytes)
    return tuple(interleave(cuts) if interleaved else cuts)


@cache
def _placed(model: str, pp: int) -> tuple[tuple[int, int | None, int], ...]:
    """(pipeline stage, routed expert index or None, bf16 bytes) per tensor in plan order: a
    layer's tensors in its stage, the embedding in the first, the rest in the last."""
    c, out = CONFIGS[model], []
    for name, shape in shapes_of(c):
        m = _LAYER.search(name)
        stage = int(m.group(1)) * pp // c.layers if m else (0 if "embed" in name else pp - 1)
        ex = re.search(r"\.experts\.(\d+)\.", name)
        size = 4 if name.endswith("e_score_correction_bias") else 2
        out.append((stage, int(ex.group(1)) if ex else None, size * math.prod(shape)))
    return tuple(out)


def owners(model: str, t: Trainer) -> list[tuple[int, int, bool]]:
    """(sender, bf16 bytes, is_expert) per tensor in plan order: a layer's tensors come from
    the first rank of its pipeline stage, its experts from their EP owners."""
    experts = experts_of(CONFIGS[model]) or 1
    return [(stage * t.ep + (0 if k is None else k * t.ep // experts), n, k is not None)
            for stage, k, n in _placed(model, t.pp)]


@cache
def _stages(model: str, t: Trainer) -> dict[int, tuple]:
    """Each pipeline stage's candidate sources (`cost_model_core.place_stage`): (the owners of
    each EP rank, the ranks that may send a dense tensor), in ranks local to the stage."""
    moe = {s for s, k, _ in _placed(model, t.pp) if k is not None}
    return {s: place_stage(t.tp, t.dp, t.ep, t.etp, s in moe) for s in range(t.pp)}


@cache
def sources(model: str, t: Trainer) -> tuple[tuple[int, int, bool], ...]:
    """Concurrent sources: (trainer rank, bf16 bytes, is_expert) per tensor in plan order, as
    the library places them (`_stages`; a stage's ranks follow one another, stages
    outermost): an expert on one of its owners (one per EDP replica), a dense tensor on a rank
    of its stage, each the one with the fewest bytes so far, largest first (`spread`, as
    `common.plan.balance_sources`; the library balances Megatron tensors, which may join
    several of these)."""
    placed, experts, width = _placed(model, t.pp), experts_of(CONFIGS[model]) or 1, t.tp * t.dp
    stages, loads, rank, free = _stages(model, t), {}, [], []
    for i, (s, k, n) in enumerate(placed):
        owners, dense = stages[s]
        ranks = owners[k * t.ep // experts] if k is not None else dense
        rank.append(s * width + ranks[0])
        if len(ranks) == 1:
            loads[rank[i]] = loads.get(rank[i], 0) + n
        else:
            free.append((i, n, [s * width + r for r in ranks]))
    for (i, _, _), r in zip(free, spread(loads, [(n, c) for _, n, c in free]), strict=True):
        rank[i] = r
    return tuple((r, n, k is not None) for r, (_, k, n) in zip(rank, placed, strict=True))


@cache
def joined_gathers(model: str, t: Trainer) -> dict[int, float]:
    """The bf16 bytes each trainer rank moves in the all-gathers it runs for tensors other
    ranks send (`gather_group`: a dense tensor's over its source's TP group, an expert's over
    its owner's ETP group; `_producer` counts a source's own): sources share gathers, and
    every rank runs its gathers in plan order, so it spends that time as its own."""
    out: dict[int, float] = {}
    for source, n, expert in sources(model, t):
        size = t.etp if expert else t.tp
        for peer in gather_group(source, size):
            if peer != source:
                out[peer] = out.get(peer, 0.0) + n * (size - 1) / size
    return out


@cache
def worker_bytes(model: str, e: Engine) -> tuple[float, ...]:
    """The bf16 bytes each GPU of one engine holds: its TP share of the tensors, but of the
    experts (with EP) its EP rank's."""
    experts, dense, own = experts_of(CONFIGS[model]) or 1, 0, [0] * e.ep
    for _, k, n in _placed(model, 1):
        if k is None or e.ep == 1:
            dense += n
        else:
            own[k * e.ep // experts] += n
    return tuple(dense / e.tp + own[w % e.ep] for w in range(e.gpus_each))


@cache
def concurrency(model: str, t: Trainer, e: Engine) -> dict:
    """How many concurrent sources (`sources`) and the imbalance: the busiest source's bytes
    over the mean, and the busiest engine GPU's (`worker_bytes`)."""
    sent: dict[int, int] = {}
    for source, n, _ in sources(model, t):
        sent[source] = sent.get(source, 0) + n
    return {"sources": len(sent), "imbalance": {
        "source_bytes": round(imbalance(list(sent.values())), 3),
        "engine_worker_bytes": round(imbalance(worker_bytes(model, e)), 3)}}


def _rates(f: dict[str, Figure], links: Links, case: str) -> dict[str, float]:
    dev = 1.0 if links.gpu == "h200" else f["device_rate_h100"].pick(case)
    ib = links.nics_per_node * links.nic_Gbps / 8 * 1e9 * f["ib_efficiency"].pick(case)
    return {"host": f["host_s_per_tensor"].pick(case),
            "bucket": f["host_s_per_bucket"].pick(case), "pack": f["pack_Bps"].pick(case) * dev,
            "gather": f["gather_Bps"].pick(case) * dev, "copy": f["copy_Bps"].pick(case) * dev,
            "apply": f["scatter_Bps"].pick(case) * dev / f["apply_over_scatter"].pick(case),
            "nvbus": min(f["nvlink_bus_GBps"].pick(case), links.nvlink_GBps) * 1e9, "ib": ib,
            "lat": f["collective_latency_s"].pick(case)}


def _node_share(e: Engine, expert: bool) -> float:
    """The fraction of a tensor's bytes the busiest engine node needs (shard-to-shard)."""
    split = e.ep if expert and e.ep > 1 else e.tp
    return min(e.gpus_per_node, split) / split


def _gpu_share(b: Bucket, e: Engine) -> float:
    """The bytes of `b` one engine GPU applies."""
    return (b.nbytes - b.expert_bytes) / e.tp + b.expert_bytes / (e.ep if e.ep > 1 else e.tp)


def _producer(b: Bucket, t: Trainer, o: Options, f: dict, r: dict, case: str) -> float:
    """The sender's device work for `b`: gather (+ its TP / ETP all-gather over NVLink), pack
    (shard-to-shard: the compact need-set gather), delta encode + shadow copy, fp8 quantize."""
    dense = b.nbytes - b.expert_bytes
    gathered = dense * (t.tp - 1) / t.tp + b.expert_bytes * (t.etp - 1) / t.etp
    out = b.nbytes / r["gather"] + gathered / r["nvbus"]
    pack = b.nbytes / r["pack"]
    out += pack * f["gather_over_pack"].pick(case) if o.mode == "shard" else pack
    if o.mode == "delta":
        out += b.nbytes * (f["encode_over_copy"].pick(case) + 1) / r["copy"]
    if o.wire_bytes == 1:
        out += b.nbytes * f["quantize_over_copy"].pick(case) / r["copy"]
    return out


def _wire_bytes(b: Bucket, o: Options) -> float:
    return b.nbytes * o.wire_bytes / 2 * (wire_fraction(o.density) if o.mode == "delta" else 1)


def _node_bytes(b: Bucket, e: Engine, o: Options, f: dict, case: str) -> float:
    """The bytes of `b` the busiest engine node takes in: all of them (full / delta: every
    worker gets the bucket), or (shard-to-shard) its workers' need-sets."""
    wb = _wire_bytes(b, o)
    if o.mode != "shard":
        return wb
    return ((b.nbytes - b.expert_bytes) * _node_share(e, False) + b.expert_bytes *
            _node_share(e, True)) / b.nbytes * wb * f["need_overhead"].pick(case)


def _wire(b: Bucket, t: Trainer, e: Engine, o: Options, f: dict, r: dict, case: str) -> float:
    """Full / delta: one ring through every node. Shard-to-shard: the busiest engine node's
    share, or the trainer nodes' egress (each need-set's frame leaves once, into its ring)."""
    wb = _wire_bytes(b, o)
    if o.mode != "shard":  # one ring through every node: the slower of NVLink and the NICs
        return wb / min(r["nvbus"], r["ib"]) + r["lat"]
    senders = max(1, min(t.gpus // t.gpus_per_node, t.pp * t.ep))
    rails = r["ib"] * f["shard_concurrency"].pick(case)
    return max(_node_bytes(b, e, o, f, case) / rails, wb / (r["ib"] * senders)) + r["lat"]


def _apply(b: Bucket, e: Engine, o: Options, f: dict, r: dict, case: str) -> float:
    share = _gpu_share(b, e) * o.wire_bytes / 2
    out = share / r["apply"]
    if o.mode == "delta":
        out += share * (f["rebuild_over_copy"].pick(case) + 1) / r["copy"]
    return out


def _costs(bs: list[Bucket], wire: list[float], t: Trainer, e: Engine, o: Options, f: dict,
           r: dict, case: str) -> StageCosts:
    return StageCosts([b.tensors * r["host"] + r["bucket"] for b in bs],
                      [_producer(b, t, o, f, r, case) for b in bs], wire,
                      [_apply(b, e, o, f, r, case) for b in bs])


def _paused(out: Timeline, f: dict, case: str) -> Timeline:
    out.seconds += f["pause_s"].pick(case)
    out.totals["pause"] = f["pause_s"].pick(case)
    return out


def timeline(model: str, t: Trainer, e: Engine, links: Links, o: Options,
             case: str) -> Timeline:
    """One case (best / expected / worst) of the refit, the engine's pause included."""
    f = figures()
    r = _rates(f, links, case)
    bs = list(buckets(model, t, o.bucket_bytes, o.interleave))
    costs = _costs(bs, [_wire(b, t, e, o, f, r, case) for b in bs], t, e, o, f, r, case)
    return _paused(simulate(bs, costs, o.buffers), f, case)


@cache
def streams(model: str, t: Trainer, bucket_bytes: int) -> dict[int, list[Bucket]]:
    """Each concurrent source's buckets (`sources`), its own tensors in plan order."""
    mine: dict[int, list[tuple[int, int, bool]]] = {}
    for item in sources(model, t):
        mine.setdefault(item[0], []).append(item)
    return {s: cut(items, bucket_bytes) for s, items in mine.items()}


def _stream(bs: list[Bucket], joined: float, rail: float, t: Trainer, e: Engine, o: Options,
            f: dict, r: dict, case: str) -> tuple[list[float], StageCosts]:
    """One source's stream: the bytes each bucket sends and its stage costs, its wire its own
    GPU's rail, its device time also the `joined` bytes of the other sources' all-gathers it
    runs (spread over its buckets by bytes: the plan takes the sources in turn by bytes)."""
    sent = [_wire_bytes(b, o) * (f["need_overhead"].pick(case) if o.mode == "shard" else 1)
            for b in bs]
    costs = _costs(bs, [s / rail + r["lat"] for s in sent], t, e, o, f, r, case)
    share = joined / r["nvbus"] / sum(b.nbytes for b in bs)
    return sent, replace(costs, device=[d + b.nbytes * share
                                        for d, b in zip(costs.device, bs, strict=True)])


def concurrent_timeline(model: str, t: Trainer, e: Engine, links: Links, o: Options,
                        case: str) -> Timeline:
    """One case of a refit with concurrent sources on (`sources`). Two or more: each source's
    stream on its own (`_stream`), then the stages they share: the busiest trainer node's
    egress (its sources' bytes over its NICs) and engine node's ingress (its workers' bytes
    over its NICs; full / delta: and over NVLink), each with the last bucket's apply, and the
    busiest engine GPU's apply of every stream; then the pause. One source: the library sends
    one stream over the whole group, `timeline`'s wire."""
    f = figures()
    r = _rates(f, links, case)
    mine, joined = streams(model, t, o.bucket_bytes), joined_gathers(model, t)
    if len(mine) == 1:
        bs = next(iter(mine.values()))
        wire = [_wire(b, t, e, o, f, r, case) for b in bs]
        return _paused(simulate(bs, _costs(bs, wire, t, e, o, f, r, case), o.buffers), f, case)
    rail = r["ib"] / min(links.nics_per_node, t.gpus_per_node) * f["source_rail"].pick(case)
    runs, egress = [], {}
    for source, bs in mine.items():
        sent, costs = _stream(bs, joined.get(source, 0.0), rail, t, e, o, f, r, case)
        runs.append((bs, costs))
        egress[source // t.gpus_per_node] = egress.get(source // t.gpus_per_node, 0.0) + sum(sent)
    applies = [a for _, c in runs for a in c.apply]
    ingress = sum(_node_bytes(b, e, o, f, case) for bs, _ in runs for b in bs)
    into = (r["ib"] * f["concurrent_shard_rails"].pick(case) if o.mode == "shard" else
            min(r["nvbus"], r["ib"]))  # full / delta: every worker's NVLink too
    shared = {"trainer egress": max(egress.values()) / r["ib"] + max(applies),
              "engine ingress": ingress / into + max(applies),
              "engine apply": sum(applies) * imbalance(worker_bytes(model, e))}
    return _paused(concurrent(runs, shared, o.buffers), f, case)


def predict(model: str, t: Trainer, e: Engine, links: Links, o: Options) -> dict:
    """The refit's seconds per case, the stages' totals and the bounding stage (expected).
    Concurrent sources: by `concurrent_timeline`, with the sources and their imbalance."""
    return copy.deepcopy(_predict(model, t, e, links, o))


@cache
def _predict(model: str, t: Trainer, e: Engine, links: Links, o: Options) -> dict:
    _check(model, t, e, links, o)
    runs = {c: (concurrent_timeline if o.concurrent else timeline)(model, t, e, links, o, c)
            for c in CASES}
    exp = runs["expected"]
    out = {"seconds": {c: round(runs[c].seconds, 4) for c in CASES}, "bound": exp.bound,
           "stages_s": {k: round(v, 4) for k, v in exp.totals.items()}}
    if o.concurrent:
        out["concurrent"] = {**concurrency(model, t, e), "slowest_source_s": {
            k: round(v, 4) for k, v in exp.detail.items()}}
    return out
