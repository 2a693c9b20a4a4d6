"""`common.delta.codec`: lossless deltas rebuild every byte, go whole when not smaller, and refuse a
delta that cannot apply before writing anything (CPU: the native loop and, "cpu-torch", the
torch ops used where it is not built; CUDA where present)."""

from __future__ import annotations

import pytest
import torch

from common.delta.codec import PREAMBLE_BYTES, DeltaError, apply, delta_bytes, encode
from common.kernels import native

DEVICES = ["cpu", "cpu-torch"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    if request.param == "cpu-torch":
        monkeypatch.setattr(native, "load", lambda: None)
        return "cpu"
    return request.param


def payload(seed: int, device: str) -> torch.Tensor:
    """Mixed dtypes back to back and an odd length: bf16, fp32 (with NaNs and -0.0), bytes."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(5000, generator=g).bfloat16().view(torch.uint8),
             torch.tensor([0.0, float("nan"), 1.5] * 100).view(torch.uint8),
             torch.randn(3001, generator=g).view(torch.uint8),
             torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8)]
    return torch.cat(parts).to(device)


def perturbed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`base` with about `fraction` of its 2-byte words changed, some only by a bit pattern
    a value comparison misses (-0.0 for 0.0, another NaN), and the odd last byte."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    words = new[: new.numel() // 2 * 2].view(torch.int16)
    hit = torch.rand(words.numel(), generator=g) < fraction
    words[hit.to(new.device)] ^= 0x0101
    fp32 = new[10000 : 10000 + 1200].view(torch.float32)
    fp32[0::3] = -0.0  # was 0.0
    fp32[1::3] = torch.tensor(float("nan")).view(torch.int32).add(1).view(torch.float32)
    new[-1] ^= 0xFF
    return new


@pytest.mark.parametrize("fraction", [0.0, 0.03, 0.2])
def test_delta_rebuilds_every_byte_and_is_sized_by_its_changed_words(device, fraction):
    base = payload(0, device)
    new = perturbed(base, fraction, 1)
    changed = int((new[:-1].view(torch.int16) != base[:-1].view(torch.int16)).sum())
    delta = encode(new, base, base_version=7)
    assert delta is not None and delta.numel() == delta_bytes(new.numel(), changed)
    assert delta.numel() < (0.0625 + fraction + 0.06) * new.numel()  # bitmask + values
    target = base.clone()
    assert apply(delta, target, base_version=7) == changed
    assert torch.equal(target, new)


def test_delta_of_a_mostly_changed_payload_goes_whole(device):
    base = payload(0, device)
    assert encode(perturbed(base, 0.99, 2), base, base_version=1) is None


def test_delta_that_cannot_apply_is_refused_before_a_byte_is_written(device):
    base = payload(0, device)
    delta = encode(perturbed(base, 0.03, 3), base, base_version=4)
    target = base.clone()
    cases = {
        "this receiver holds v5": (delta, 5),
        "malformed or truncated": (delta[:-2], 4),
        "not a refit delta": (torch.zeros_like(delta), 4),
        "shorter than its preamble": (delta[: PREAMBLE_BYTES - 1], 4),
    }
    extra = delta.clone()  # one more word marked than there are values
    mask = extra[PREAMBLE_BYTES : PREAMBLE_BYTES + 64]
    mask[mask != 0xFF] = 0xFF
    cases["its bitmask marks"] = (extra, 4)
    for why, (bad, version) in cases.items():
        with pytest.raises(DeltaError, match=why):
            apply(bad, target, base_version=version)
        assert torch.equal(target, base), why
    with pytest.raises(DeltaError, match="a target of"):
        apply(delta, base[:-1].clone(), base_version=4)


def reference(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
    """The delta the torch ops make on CPU: every device's must equal it byte for byte."""
    native_load = native.load
    native.load = lambda: None
    try:
        return encode(new.cpu(), base.cpu(), base_version=3)
    finally:
        native.load = native_load


BLOCK_WORDS = 4096  # the CUDA kernels' block: sizes around its edges


@pytest.mark.parametrize("nbytes", [200, 201, 2 * BLOCK_WORDS - 2, 2 * BLOCK_WORDS,
                                    2 * BLOCK_WORDS + 1, 2 * BLOCK_WORDS + 18,
                                    6 * BLOCK_WORDS + 3, 2 * 33 * BLOCK_WORDS - 14])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_delta_bytes_are_the_same_on_every_device_at_every_size(device, nbytes, fraction):
    """Odd lengths, lengths off the kernels' block and bitmask padding, none / some / all of
    the words changed (all: goes whole), NaN payloads and -0.0 (bit patterns, not values)."""
    g = torch.Generator().manual_seed(nbytes)
    base = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    base[: nbytes // 4 * 4].view(torch.float32)[::5] = float("nan")
    new = base.clone()
    words = new[: nbytes // 2 * 2].view(torch.int16)
    hit = torch.rand(words.numel(), generator=g) < fraction
    words[hit] ^= 0x0100
    new[: nbytes // 4 * 4].view(torch.float32)[1::7] = -0.0
    base[: nbytes // 4 * 4].view(torch.float32)[1::7] = 0.0
    if nbytes % 2:
        new[-1] ^= 0x5A
    want = reference(new, base)
    base, new = base.to(device), new.to(device)
    got = encode(new, base, base_version=3)
    if want is None:
        assert got is None
        return
    assert got is not None and got.device == new.device and torch.equal(got.cpu(), want)
    target = base.clone()
    changed = int((new[: nbytes // 2 * 2].view(torch.int16)
                   != base[: nbytes // 2 * 2].view(torch.int16)).sum())
    assert apply(got, target, base_version=3) == changed
    assert torch.equal(target, new)


def test_delta_of_many_blocks_at_once(device):
    """A payload of thousands of kernel blocks (on CUDA they run at once and each finds its
    value slots from the blocks before it), then a run of them unchanged."""
    if device != "cuda":
        pytest.skip("the CUDA kernels' look-back across blocks running at once")
    g = torch.Generator(device=device).manual_seed(5)
    base = torch.randint(0, 256, (96 << 20,), generator=g, dtype=torch.uint8, device=device)
    new = base.clone()
    words = new.view(torch.int16)
    words[torch.rand(words.numel(), generator=g, device=device) < 0.05] ^= 0x0F0F
    words[(40 << 20) // 2 : (50 << 20) // 2] = base.view(torch.int16)[(40 << 20) // 2 :
                                                                       (50 << 20) // 2]
    for _ in range(3):
        delta = encode(new, base, base_version=9)
        assert torch.equal(delta.cpu(), encode(new.cpu(), base.cpu(), base_version=9))
        target = base.clone()
        apply(delta, target, base_version=9)
        assert torch.equal(target, new)
