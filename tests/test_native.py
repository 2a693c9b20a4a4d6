"""The native per-bucket scan agrees with the plan checks it replaces, on every verdict."""

from __future__ import annotations

import shutil

import pytest
import torch

from common import native
from common.plan import TensorSpec

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


@pytest.mark.parametrize("device", DEVICES)
def test_matching_bucket_gives_every_address(module, device: str) -> None:
    ts = tensors(device)
    scan = native.BucketScan(module, [TensorSpec.of(f"t{i}", t) for i, t in enumerate(ts)],
                             torch.device(device, 0) if device == "cuda" else torch.device(device))
    ok, ptrs = scan.scan(ts)
    assert ok and ptrs is not None
    assert list(ptrs) == [t.data_ptr() for t in ts]


@pytest.mark.parametrize("drift", ["dtype", "shape", "rank", "none", "count"])
def test_any_drift_is_a_mismatch(module, drift: str) -> None:
    ts = tensors("cpu")
    scan = native.BucketScan(module, [TensorSpec.of(f"t{i}", t) for i, t in enumerate(ts)],
                             torch.device("cpu"))
    bad = list(ts)
    if drift == "dtype":
        bad[2] = bad[2].int()  # int64 -> int32, same shape
    elif drift == "shape":
        bad[0] = bad[0].reshape(3, 4)  # same numel, transposed shape
    elif drift == "rank":
        bad[4] = bad[4].reshape(7, 1)
    elif drift == "none":
        bad[1] = None
    else:
        bad = bad[:-1]
    assert scan.scan(bad) == (False, None)


def test_non_contiguous_or_other_device_matches_without_addresses(module) -> None:
    ts = tensors("cpu")
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(ts)]
    scan = native.BucketScan(module, specs, torch.device("cpu"))
    strided = list(ts)
    strided[0] = torch.randn(3, 4).bfloat16().t()  # right shape and dtype, not contiguous
    assert scan.scan(strided) == (True, None)
    meta = [torch.empty_like(t, device="meta") for t in ts]  # right specs, no data
    assert scan.scan(meta) == (True, None)
    negated = [*ts[:4], torch._neg_view(ts[4])]  # lazy sign bit: its raw bytes are not the values
    assert scan.scan(negated) == (True, None)
    if torch.cuda.is_available():  # the plan's device is CPU: CUDA sources need no kernel
        elsewhere = native.BucketScan(module, specs, torch.device("cuda", 0))
        assert elsewhere.scan(ts) == (True, None)


def test_switched_off_by_env(monkeypatch) -> None:
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setenv("REFIT_NATIVE", "0")
    assert native.load() is None
