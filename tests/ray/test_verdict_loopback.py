"""A loopback-only Ray cluster keeps refit on loopback: the trainer actors and the engine use
the address Ray gives their node, so every TCP socket they hold (torch.distributed among the
trainers, the refit group's store and gloo, the engine's own groups) is on 127.0.0.1.

Ray on Linux replaces a 127.0.0.1 node address by the machine's own unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (`ray._private.services.resolve_ip_for_localhost`): the
cluster here is started so, and the test first checks that Ray really kept 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest
import torch

from common.launch.ray_cluster import RayLayout, RayPlacement
from tests.dtensor.models import make_model
from tests.ray.test_multinode import TIMEOUT_S, refit_job
from tests.ray_start import init_ray

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loopback_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    env = {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with pytest.MonkeyPatch.context() as patch:
        # Ray's processes read the variable at their start; this one read it at `import ray`.
        patch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        try:
            init_ray(ray, _node_ip_address="127.0.0.1", num_cpus=3, include_dashboard=False,
                     runtime_env={"env_vars": env}, log_to_driver=False,
                     _temp_dir=str(tmp_path_factory.mktemp("ray")))
            yield ray
        finally:
            ray.shutdown()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> str:
    """A /proc/net/tcp{,6} local address (little-endian 32-bit words) as text."""
    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    addr = ipaddress.ip_address(socket.inet_ntop(
        socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw))
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def bound_addresses(pid: int) -> set[str]:
    """The local addresses of every TCP socket process `pid` holds (listening or connected)."""
    inodes, out = _socket_inodes(pid), set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                out.add(_address(fields[1].split(":")[0]))
    return out


def _pids_titled(prefix: str) -> list[int]:
    """Processes whose title (Ray sets `ray::Class...`) starts with `prefix`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(prefix.encode()):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_verdict_a_loopback_ray_cluster_keeps_every_refit_socket_on_loopback(loopback_ray,
                                                                            tmp_path):
    assert {n["NodeManagerAddress"] for n in loopback_ray.nodes()} == {"127.0.0.1"}
    make_model("qwen3", dtype=torch.bfloat16).save_pretrained(tmp_path / "v0")
    placement = RayPlacement(RayLayout(trainers=2, timeout_s=TIMEOUT_S))
    with refit_job(loopback_ray, placement, tmp_path / "v0", "engine@loopback") as job:
        assert {ip for ip, _ in job.trainers.where} == {"127.0.0.1"}
        pids = [pid for _, pid in job.trainers.where] + _pids_titled("ray::HostActor")
        assert len(pids) == 3, pids
        bound = {pid: bound_addresses(pid) for pid in pids}
        assert all(bound.values()), bound  # each holds the refit group's sockets now
        assert set().union(*bound.values()) == {"127.0.0.1"}, bound
