"""The native per-bucket scan agrees with the plan checks it replaces, on every verdict."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.kernels import native
from common.plan import TensorSpec

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def module():
    if not (shutil.which("c++") and shutil.which("ninja")):
        pytest.skip("no C++ compiler or ninja on PATH: the sender uses its Python checks")
    mod = native.load()
    assert mod is not None, "the native scan must build where a compiler and ninja exist"
    return mod


def tensors(device: str) -> list[torch.Tensor]:
    return [torch.randn(4, 3, device=device).bfloat16(), torch.zeros((), device=device),
            torch.arange(5, device=device), torch.ones(0, 2, device=device) > 0,
            torch.randn(7, device=device).half()]


def pairs(ts: list) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) items as a weight source yields them: fresh name strings."""
    return [("t" + str(i), t) for i, t in enumerate(ts)]


def scan_for(module, ts: list, device: torch.device) -> native.BucketScan:
    return native.BucketScan(module, [TensorSpec.of(f"t{i}", t) for i, t in enumerate(ts)],
                             device)


def taken(scan: native.BucketScan, how: str, items: list) -> tuple:
    """The scan's verdict on `items`, handed as (name, tensor) items or (`take_mapping`, a
    dict source's way) as a dict of them."""
    return scan.take(items) if how == "items" else scan.take_mapping(dict(items))


@pytest.mark.parametrize("how", ["items", "mapping"])
@pytest.mark.parametrize("device", DEVICES)
def test_matching_bucket_gives_every_tensor_and_address(module, device: str, how: str) -> None:
    ts = tensors(device)
    scan = scan_for(module, ts, torch.device(device, 0 if device == "cuda" else None))
    got, ptrs = taken(scan, how, pairs(ts))
    assert got is not None and ptrs is not None
    assert all(a is b for a, b in zip(got, ts, strict=True)) and len(got) == len(ts)
    assert list(ptrs) == [t.data_ptr() for t in ts]


@pytest.mark.parametrize(("how", "drift"), [
    *(("items", d) for d in ["dtype", "shape", "rank", "none", "count", "name", "item"]),
    *(("mapping", d) for d in ["dtype", "shape", "rank", "none", "count", "name", "value"])])
def test_any_drift_is_a_mismatch(module, how: str, drift: str) -> None:
    ts = tensors("cpu")
    scan = scan_for(module, ts, torch.device("cpu"))
    bad = pairs(ts)
    if drift == "dtype":
        bad[2] = ("t2", ts[2].int())  # int64 -> int32, same shape
    elif drift == "shape":
        bad[0] = ("t0", ts[0].reshape(3, 4))  # same numel, transposed shape
    elif drift == "rank":
        bad[4] = ("t4", ts[4].reshape(7, 1))
    elif drift == "none":
        bad[1] = ("t1", None)
    elif drift == "count":
        bad = bad[:-1]
    elif drift == "name":  # a dict: t3 missing
        bad[3] = ("t3.weight", ts[3])
    elif drift == "value":
        bad[3] = ("t3", ts[3].numpy())  # not a tensor
    else:
        bad[3] = ["t3", ts[3]]  # not a (name, tensor) tuple
    assert taken(scan, how, bad) == (None, None)
    assert scan.take(tuple(pairs(ts))) == (None, None)  # not a list: the Python path decides


@pytest.mark.parametrize("how", ["items", "mapping"])
def test_non_contiguous_or_other_device_matches_without_addresses(module, how: str) -> None:
    ts = tensors("cpu")
    scan = scan_for(module, ts, torch.device("cpu"))

    def verdict(items: list) -> tuple[bool, bool]:
        got, ptrs = taken(scan, how, items)
        return got is not None, ptrs is not None

    strided = list(ts)
    strided[0] = torch.randn(3, 4).bfloat16().t()  # right shape and dtype, not contiguous
    assert verdict(pairs(strided)) == (True, False)
    meta = [torch.empty_like(t, device="meta") for t in ts]  # right specs, no data
    assert verdict(pairs(meta)) == (True, False)
    negated = [*ts[:4], torch._neg_view(ts[4])]  # lazy sign bit: its raw bytes are not the values
    assert verdict(pairs(negated)) == (True, False)
    if torch.cuda.is_available():  # the plan's device is CUDA: CPU sources need no kernel
        elsewhere = scan_for(module, ts, torch.device("cuda", 0))
        got, ptrs = taken(elsewhere, how, pairs(ts))
        assert got is not None and ptrs is None


def test_switched_off_by_env(monkeypatch) -> None:
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setenv("REFIT_NATIVE", "0")
    assert native.load() is None


@pytest.mark.parametrize("alignment", [1, 4, 256])
def test_cpu_pack_from_the_scanned_addresses_is_bitwise(module, alignment: int) -> None:
    """On CPU the sender packs with one C++ memcpy loop over the addresses the scan collected,
    misaligned slots (alignment 1 and 4) included."""
    from common.config import RefitConfig
    from common.packing import BucketLayout
    from common.plan import RefitPlan

    ts = [*tensors("cpu"), torch.randn(6, 4).t().contiguous(), torch.tensor(True),
          torch.randint(-(2**60), 2**60, (3,))]
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(ts)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20, alignment=alignment))
    (bucket,) = plan.buckets
    got, ptrs = native.BucketScan(module, specs, torch.device("cpu")).take(pairs(ts))
    assert got is not None and ptrs is not None
    buf = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
    layout = BucketLayout(buf, specs, bucket.offsets)
    layout.pack(got, ptrs)
    assert layout._cpu_table is not None  # the memcpy loop ran, not the torch.cat fallback
    for (name, view), want in zip(layout.unpack(), ts, strict=True):
        assert view.dtype == want.dtype and view.shape == want.shape, name
        assert torch.equal(view.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_a_built_library_is_imported_without_ninja_or_a_compiler(module) -> None:
    """Once built (make setup), any process imports the library for the same source, Python
    and torch directly: no ninja, no compiler on PATH, no rebuild inside a first setup."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from common.kernels import native; assert native.load() is not None")
    env = {**os.environ, "PATH": "/nonexistent", "REFIT_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refit native checks imported" in done.stderr, done.stderr


def test_another_source_builds_elsewhere() -> None:
    """The build directory is keyed by the source: an edited native.cpp is rebuilt."""
    assert native._build_directory("int a;") != native._build_directory("int b;")
