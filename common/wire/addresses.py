"""Which local address a socket of the refit group binds, so that nothing listens wider than
the address the job was given (a loopback-only cluster stays on loopback; a multi-NIC node
talks over the interface that routes to rank 0, not whatever its hostname resolves to)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][0]


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float,
              wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore at `host`:`port`; the master listens on `host` only (TCPStore alone would
    listen on every address of the machine)."""
    if is_master:
        listen = {"master_listen_fd": _listening_fd(host, port)}
    else:
        listen = {}
        _await_listener(host, port, timeout_s)
    return dist.TCPStore(host, port, world_size, is_master=is_master,
                         timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=wait_for_workers, **listen)


def _await_listener(host: str, port: int, timeout_s: float, every_s: float = 0.2) -> None:
    """Return once `host`:`port` accepts a connection. An engine often joins before the
    training ranks are up; TCPStore's own retries back off to a minute and more between
    tries, so a store that comes up meanwhile could go unseen past the trainers' timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=every_s):
                return
        except OSError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing accepted a connection at {host}:{port} for "
                                   f"{timeout_s:.0f}s (the first training rank hosts the "
                                   f"refit group's store there: not started, or gone): "
                                   f"{e}") from e
            time.sleep(min(every_s, left))


def _listening_fd(host: str, port: int) -> int:
    """A TCP socket listening on `host`:`port` only, as a file descriptor the store owns."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def local_address_toward(host: str, port: int) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket is only
    connected): the address peers reach this rank at when they reach `host` like it does."""
    with socket.socket(_family(host), socket.SOCK_DGRAM) as sock:
        sock.connect((host, port or 9))
        return sock.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` (e.g. "lo" for 127.0.0.1), or
    None: what GLOO_SOCKET_IFNAME takes for a group that torch builds itself."""
    import psutil  # a dependency of ray, the only caller's world

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def bind_process_to(address: str) -> None:
    """Sockets that torch (gloo's default device) and vLLM (`VLLM_HOST_IP`) open in this
    process bind `address`, e.g. the IP Ray gave this node, unless the user already chose
    (GLOO_SOCKET_IFNAME / VLLM_HOST_IP set)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_of(address)):
        os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ.setdefault("VLLM_HOST_IP", address)
