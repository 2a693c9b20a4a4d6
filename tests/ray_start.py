"""Starting a local Ray node in a test, once more if its raylet did not register in time.

Ray waits a fixed 30 s for a new node's raylet to register with its GCS (`ray._private.node`,
not configurable in this Ray); on a 2-core machine that also runs the other test group's
engines the registration has been seen to take longer. That is Ray's start, not what the
tests check, so such a start is retried once after `ray.shutdown()`.
"""

from __future__ import annotations

from typing import Any

SLOW_START = "timed out during startup"


def init_ray(ray: Any, **kwargs: Any) -> None:
    """`ray.init(**kwargs)`, retried once if the node's raylet registered too late."""
    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
        if SLOW_START not in str(e):
            raise
        ray.shutdown()
        ray.init(**kwargs)
