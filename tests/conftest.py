"""Session setup shared by every test module."""

from __future__ import annotations


def pytest_configure(config) -> None:
    """Build the sender's native checks once, before any test spawns ranks: a first build
    (~30 s on 2 cores) inside a rank would run into the short refit timeouts tests use."""
    from common.kernels import native

    native.load()
