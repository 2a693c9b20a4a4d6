"""Starting a local Ray node in a test, once more if its raylet did not register in time.

Ray waits a fixed 30 s for a new node's raylet to register with its GCS (`ray._private.node`,
not configurable in this Ray); on a 2-core machine that also runs the other test group's
engines the registration has been seen to take longer. That is Ray's start, not what the
tests check, so such a start is retried (twice: one retry was seen to time out too, with both
test groups loading the 2 cores) after `ray.shutdown()`.
"""

from __future__ import annotations

from typing import Any

SLOW_START = "timed out during startup"


def init_ray(ray: Any, tries: int = 3, **kwargs: Any) -> None:
    """`ray.init(**kwargs)`, tried up to `tries` times while the node's raylet registers too
    late."""
    for attempt in range(1, tries + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if SLOW_START not in str(e) or attempt == tries:
                raise
            ray.shutdown()
