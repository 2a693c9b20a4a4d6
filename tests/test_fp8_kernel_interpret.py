"""The Triton block-FP8 kernel on a machine without a GPU: Triton's interpreter
(`TRITON_INTERPRET=1`, in a child process: it is read when the kernel is defined) runs the
real kernel on CPU tensors, through the paths the FP8 source uses: the batch into buffers of
its own (`quantize_batch` with a plan's groups: one launch per shape, every scale in one
buffer, one flag; the addresses from the native bucket scan) and the fill straight into frames
laid out as the plan's buckets (`fp8_fill`: a NaN marks the frame's status word).

The interpreter's float-to-e4m3 cast does not round like the GPU's, so the data are exact:
each block is a power of two times e4m3 values, with 448 in it (its scale is then exactly that
power of two and every value divides exactly). What this checks is the addressing: tensors by
address table, partial blocks, strides, scale views into a shared buffer, groups split where
the plan's guess is wrong, outputs at frame slots, a NaN refused or marked, by name.
Bit-for-bit rounding is the H200's test (`tests/test_gpu_fp8.py`), as are UE8M0 scales
(libdevice, which the interpreter lacks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
VALUES = E4M3[E4M3.isfinite() & (E4M3.abs() <= 448)]


def exact(shape: tuple[int, int], block: tuple[int, int], seed: int,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 values times one power of two per block, 448 first in each block."""
    g = torch.Generator().manual_seed(seed)
    k = VALUES[torch.randint(len(VALUES), shape, generator=g)]
    (bm, bn), (m, n) = block, shape
    e = torch.randint(-12, 6, (-(-m // bm), -(-n // bn)), generator=g).float()
    scale = torch.pow(2.0, e).repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]
    k[::bm, ::bn] = 448.0
    return (k * scale).to(dtype)


def check_batch(block: tuple[int, int], ue8m0: bool) -> int:
    """One batch through the kernel, every result against the torch path; the launches."""
    from common.kernels import fp8_kernel
    from common.quant.fp8_batch import quantize_batch
    from common.quant.fp8_blocks import BlockFp8Format, _quantize_in_chunks

    fmt = BlockFp8Format(block, ue8m0=ue8m0)
    xs = [exact((200, 300), block, i) for i in range(3)] + [exact((128, 128), block, 7)]
    xs += [exact((300, 200), block[::-1], 8).t(), exact((129, 257), block, 9, torch.float32),
           exact((1, 300), block, 10)]
    xs[1][:block[0], :block[1]] = 0  # an all-zero block: the clamped scale
    bad = exact((200, 300), block, 11)
    bad[150, 7] = float("nan")
    named = [(f"w{i}", x) for i, x in enumerate(xs)] + [("bad", bad), ("elsewhere", None)]
    # the plan's guess: w0-w2 and bad share a shape; w3 with the transposed one is wrong
    groups = [(0, 1, 2, 7), (3, 4), (5,), (6,), (8,)]
    launches = []
    real = fp8_kernel.launch

    def counted(addrs, count, *args, **kwargs):
        launches.append(count)
        return real(addrs, count, *args, **kwargs)

    fp8_kernel.launch, fp8_kernel.available = counted, lambda x, b: x.numel() > 0
    try:
        out = quantize_batch(named, fmt, groups)
    finally:
        fp8_kernel.launch = real
    assert sorted(launches) == [1, 1, 1, 1, 4], launches  # the wrong group split in two
    assert out[8] is None
    assert out[7].startswith("bad: 1 NaN and 0 inf") and "(150, 7)" in out[7], out[7]
    for (name, x), got in zip(named[:7], out[:7], strict=True):
        rq, rs = _quantize_in_chunks(x, fmt, 1 << 23)
        assert torch.equal(got[0].view(torch.uint8), rq.view(torch.uint8)), name
        assert torch.equal(got[1].view(torch.int32), rs.view(torch.int32)), name
    return len(out)


def check_source() -> int:
    """`Fp8Source` over a plan, the kernel under the interpreter: each bucket goes as a
    `PreparedBucket` the sender fills (`fp8_fill`). Frames laid out as the plan's buckets,
    filled and their other slots copied from `ptrs` (as the pack kernel does), hold the torch
    path's bytes; `views()` gives the same tensors; a NaN marks its frame's status word and
    its check names the tensor, the other frames' checks pass."""
    from common.config import RefitConfig
    from common.kernels import fp8_kernel
    from common.plan import RefitPlan
    from common.quant.fp8_blocks import BlockFp8Format, _quantize_in_chunks
    from common.quant.fp8_plan import Fp8Source, Fp8Targets, scale_name
    from common.source import DictWeightSource, iter_items
    from common.wire.bucket_header import STATUS_NONFINITE

    fmt = BlockFp8Format()
    weights = {f"layers.{i}.proj.weight": exact(shape, fmt.block, i)
               for i, shape in enumerate([(200, 300), (128, 64)] * 3)}  # groups interleave
    weights["norm.weight"] = torch.ones(300, dtype=torch.bfloat16)
    source = Fp8Source(DictWeightSource(weights),
                       Fp8Targets(fmt, frozenset(n for n in weights if "proj" in n)))
    plan = RefitPlan.build(source.plan_specs(), RefitConfig(bucket_bytes=40 << 10))
    want = dict(weights)
    for name in source.targets.names:
        want[name], want[scale_name(name)] = _quantize_in_chunks(weights[name], fmt, 1 << 23)
    fp8_kernel.available = lambda x, b: x.numel() > 0
    got, status, checks = filled_frames(source, plan)
    assert source.by_address == len(plan.buckets) > 2, source.by_address
    assert not status.any() and not any(map(_call, checks))
    for name, x in want.items():
        assert torch.equal(got[name].view(torch.uint8), x.view(torch.uint8)), name
    viewed = dict(iter_items(source.iter_tensors(plan)))  # quantized into buffers of their own
    assert all(torch.equal(viewed[n].view(torch.uint8), x.view(torch.uint8))
               for n, x in want.items())
    last = next(s.name for s in plan.bucket_specs(plan.buckets[-1])  # a NaN in the last
                if s.name in source.targets.names)  # bucket's first target
    weights[last] = weights[last].clone()
    weights[last][3, 4] = float("nan")
    _, status, checks = filled_frames(source, plan)
    assert status.tolist() == [0] * (len(plan.buckets) - 1) + [STATUS_NONFINITE], status
    assert [c is None for c in map(_call, checks)] == [True] * (len(plan.buckets) - 1) + [False]
    assert repr(last) in checks[-1]() and "NaN or inf" in checks[-1](), checks[-1]()
    return len(got) + 1


def _call(check):
    return check()


def filled_frames(source, plan) -> tuple[dict, torch.Tensor, list]:
    """Every bucket of one iteration of `source` filled into a frame of its own (its status
    word in `status`), the other slots copied from their addresses: (name, tensor) of all
    frames, the status words and each fill's check."""
    import ctypes

    from common.packing import BucketLayout
    from common.source import PreparedBucket
    from common.wire.bucket_header import STATUS_NONFINITE

    status = torch.zeros(len(plan.buckets), dtype=torch.int64)
    got, checks = {}, []
    items = source.iter_tensors(plan)
    for bucket in plan.buckets:
        prepared = next(items)
        assert isinstance(prepared, PreparedBucket) and prepared.fill is not None, prepared
        specs = plan.bucket_specs(bucket)
        frame = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        slots = frame.data_ptr() + np.array(bucket.offsets, dtype=np.int64)
        mark = (status.data_ptr() + 8 * bucket.index, STATUS_NONFINITE)
        checks.append(prepared.fill(slots, mark))
        for k in sorted(set(range(len(specs))) - set(prepared.filled.tolist())):
            ctypes.memmove(int(slots[k]), int(prepared.ptrs[k]), specs[k].nbytes)
        got.update(BucketLayout(frame, specs, bucket.offsets).unpack())
    assert next(items, None) is None
    return got, status, checks


def check_scale_alignment() -> int:
    """Each launch's scales start 16-byte aligned in the batch's scale buffer (the pack kernel
    copies 16-byte words from such sources), whatever the groups before it hold."""
    from common.kernels import fp8_kernel
    from common.quant.fp8_batch import start_batch
    from common.quant.fp8_blocks import BlockFp8Format

    fmt, available = BlockFp8Format(), fp8_kernel.available
    named = [(f"w{i}", exact(shape, fmt.block, i))  # 6 scales, 1 scale, 6 scales
             for i, shape in enumerate([(200, 300), (128, 64), (200, 300)])]
    fp8_kernel.available = lambda x, b: x.numel() > 0
    try:
        q_at, s_at = start_batch(named, fmt, [[0], [1], [2]]).addresses()
    finally:
        fp8_kernel.available = available
    assert [int(a) % 16 for a in s_at] == [0, 0, 0], s_at
    return 0


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # UE8M0 scales need libdevice's log2 / exp2, which the interpreter lacks (the H200 tests)
    checked = sum(check_batch(block, ue8m0=False) for block in [(128, 128), (64, 32)])
    checked += check_source() + check_scale_alignment()
    print(f"ok {checked}")


def test_fp8_kernel_under_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.test_fp8_kernel_interpret"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "ok 32", run.stdout[-500:]


if __name__ == "__main__":
    main()
