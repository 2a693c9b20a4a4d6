"""Every worker's answer, on every data-parallel replica of an `AsyncLLM`.

`AsyncLLM.collective_rpc` answers with the first replica's workers only when the engine runs
data-parallel replicas (vLLM's DP clients ask every replica and keep the first answer), so a
replica holding other weights would go unseen. Its engine-core client asks each replica in
turn here (`call_utility_all_async`, vLLM's own per-replica call); a client without it (one
replica in process) answers through `collective_rpc`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


async def every_worker(llm: Any, method: str) -> list[Any]:
    """`method` of the worker extension on every worker of every replica of `llm`."""
    ask_all = getattr(getattr(llm, "engine_core", None), "call_utility_all_async", None)
    if ask_all is None:
        return list(await llm.collective_rpc(method))
    # the engine core's own collective_rpc utility: (method, timeout, args, kwargs)
    per_replica = await ask_all("collective_rpc", method, None, (), None)
    return [reply for replies in per_replica for reply in replies]


def expected_workers(llm: Any) -> int:
    """Workers across every replica (TP x PP x DP)."""
    return int(llm.vllm_config.parallel_config.world_size_across_dp)
