"""Guarantees of `HttpEngine`'s liveness watch (against a local HTTP stub, no vLLM server) and of
the loaded-bytes and base hashes (`REFIT_HASH_LOADED=1`), each held by a fast test
(`pytest -k guarantee`)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from common.clients import http_engine
from common.clients.engine_client import EngineError
from common.clients.http_engine import HttpEngine
from common.delta.store import FrameStore
from common.in_vllm.loaded_hash import LoadedHashes
from common.packing import byte_view
from common.wire.group import free_port


class _Stub(BaseHTTPRequestHandler):
    """`GET /health` answers `server.health` (after `server.health_delay_s`); `GET /is_paused`
    answers after `server.call_s`."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server = self.server
        if self.path == "/health":
            time.sleep(server.health_delay_s)
            status, body = server.health, b""
        else:
            server.release.wait(server.call_s)
            status, body = 200, b'{"is_paused": false}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Stub)
    server.daemon_threads, server.release = True, threading.Event()
    server.health, server.health_delay_s, server.call_s = 200, 0.0, 0.0
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.release.set()
    server.shutdown()
    server.server_close()


def test_guarantee_health_503_is_a_dead_engine_and_200_a_live_one(stub, monkeypatch) -> None:
    """`GET /health` -> 503 (vLLM's engine-dead signal) and a refused connection are a dead
    engine; 200, any other status and a slow answer ("busy") are a live one. An outstanding call
    (here `is_paused`) is abandoned within about a second of the server saying 503, naming the
    engine; with /health at 200 a slow call still returns."""
    server, url = stub
    engine = HttpEngine(url, name="stub", timeout_s=30.0)
    assert engine.dead() is None  # 200
    server.health = 503
    assert "GET /health -> 503" in (engine.dead() or ""), engine.dead()
    for status in (500, 502, 404):
        server.health = status
        assert engine.dead() is None, status
    server.health, server.health_delay_s = 503, 0.5  # too slow an answer: busy, not dead
    monkeypatch.setattr(http_engine, "_HEALTH_TIMEOUT_S", 0.1)
    assert engine.dead() is None
    server.health_delay_s = 0.0
    assert HttpEngine(url, alive=lambda: "exited 9").dead() == "exited 9"
    refused = HttpEngine(f"http://127.0.0.1:{free_port()}")
    assert "refuses connections" in (refused.dead() or ""), refused.dead()

    server.call_s, server.health = 1.5, 200  # a slow call on a live server returns
    assert engine.is_paused() is False
    server.call_s, server.health = 8.0, 503  # a call that would hang, on a dead engine
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"engine stub: GET /is_paused abandoned: the engine "
                                          r"died \(GET /health -> 503"):
        engine.is_paused()
    assert time.monotonic() - t0 < 5.0


# name -> (dtype, shape): bf16 / fp32 / fp16 / int32, 0-d, 1-element and odd sizes
SPECS = {"embed": (torch.bfloat16, (5, 3)), "norm": (torch.float32, (7,)),
         "scale": (torch.bfloat16, (1,)), "bias": (torch.float16, (3, 1, 3)),
         "step": (torch.int32, ()), "proj": (torch.float32, (2, 9)),
         "gate": (torch.bfloat16, (11,))}


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=gen) * 3).to(d) for n, (d, s) in SPECS.items()}


def _changed(tensors: dict, name: str, how: str) -> dict:
    """`tensors` with one element of `name` (the middle one) +1, or its last byte flipped."""
    out = {n: t.clone() for n, t in tensors.items()}
    if how == "element":
        flat = out[name].view(-1)
        flat[flat.numel() // 2] += 1
    else:
        byte_view(out[name])[-1] ^= 0xFF
    assert not torch.equal(out[name], tensors[name]), (name, how)
    return out


def _variants(tensors: dict) -> dict[tuple[str, str], dict]:
    return {(n, how): _changed(tensors, n, how)
            for n in tensors for how in ("element", "last byte")}


def _distinct(original: str, digests: dict[tuple[str, str], str]) -> None:
    same = [k for k, d in digests.items() if d == original]
    assert not same, f"a change of these left the digest unchanged: {same}"
    seen: dict[str, tuple] = {}
    for key, digest in digests.items():
        assert digest not in seen, f"{key} and {seen[digest]} give the same digest"
        seen[digest] = key


def _loaded_digest(tensors: dict) -> str:
    hashes = LoadedHashes()  # fed as `DirectLoad` feeds it: add(param name, tensor) per tensor
    for name, tensor in tensors.items():
        hashes.add(name, tensor)
    return hashes.digest()


def test_guarantee_the_loaded_hash_changes_with_any_one_tensor_or_byte() -> None:
    """The loaded-bytes digest changes when any one tensor of the plan changes (one element, or
    only the last byte of its last element), each change to a different digest; it does not
    depend on the order the tensors were hashed in (it is a per-name table)."""
    tensors = _tensors()
    original = _loaded_digest(tensors)
    _distinct(original, {k: _loaded_digest(v) for k, v in _variants(tensors).items()})
    names = list(tensors)
    for order in (names[::-1], sorted(names), names[3:] + names[:3]):
        assert _loaded_digest({n: tensors[n] for n in order}) == original, order


def _base_report(frames: dict[str, torch.Tensor], order: list[str]) -> dict:
    """`undo.base_report` of a base built as the receiver builds it: each frame's bytes staged
    whole (bucket index = its place in `SPECS`), then committed."""
    from common.in_vllm.undo import base_report  # imports vllm

    index = {n: i for i, n in enumerate(SPECS)}
    store = FrameStore(torch.device("cpu"), None)
    store.begin("layout")
    for name in order:
        store.stage_whole(index[name], byte_view(frames[name].contiguous()))
    store.commit(1)
    return base_report(store)


def test_guarantee_the_base_hash_changes_with_any_one_frame_or_byte(monkeypatch) -> None:
    """With REFIT_HASH_LOADED=1 the base report's hash changes when any one frame of the base
    changes (one element, or only its last byte), each change to a different hash, whatever
    order the frames were received in; without it there is no hash."""
    tensors, names = _tensors(), list(SPECS)
    monkeypatch.delenv("REFIT_HASH_LOADED", raising=False)
    assert "base_hash" not in _base_report(tensors, names)
    monkeypatch.setenv("REFIT_HASH_LOADED", "1")
    report = _base_report(tensors, names)
    assert report["base_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    original = report["base_hash"]
    _distinct(original, {k: _base_report(v, names)["base_hash"]
                         for k, v in _variants(tensors).items()})
    assert _base_report(tensors, names[::-1])["base_hash"] == original
