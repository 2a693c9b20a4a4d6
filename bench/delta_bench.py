"""Delta codec benchmark: encode and rebuild of a model's bytes at a given density, against
one copy of the same bytes (`common.delta`).

The list is the broadcast benchmark's MoE one (20,000 bf16 tensors of 0.39 MB: 7.86 GB on the
GPU; scaled down on CPU), cut into 256 MiB buckets like a refit; a fraction of its 2-byte words
changed at random (3% and 15%: the densities measured at RL learning rates). Per bucket, encode
(compare with the base, bitmask + changed values) and rebuild (apply onto a copy of the base),
each rebuilt bucket checked bit for bit against the new bytes; one host sync per bucket, as in
a refit. The baseline: one copy of all the bytes, in the same run.

    .venv/bin/python bench/delta_bench.py --quick --out bench/results/delta_codec_cpu.json
    python3 bench/delta_bench.py --gpu --out bench/results/delta_codec_h200.json

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import bench_args, finish  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.delta import apply, encode  # noqa: E402

TENSOR_BYTES, BUCKET_BYTES = 393_216, 256 << 20


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


def main() -> None:
    args = bench_args(__doc__, "on the CUDA device (the 7.86 GB list)")
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
    finish(result, summary, args.out)


if __name__ == "__main__":
    main()
