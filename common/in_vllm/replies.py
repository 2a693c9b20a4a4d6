"""Every worker's answer, on every data-parallel replica of an `AsyncLLM`.

`AsyncLLM.collective_rpc` answers with the first replica's workers only when the engine runs
data-parallel replicas (vLLM's DP clients ask every replica and keep the first answer), so a
replica holding other weights would go unseen. Here its engine-core client asks every replica:
vLLM 0.32 has a call for it (`call_utility_all_async`); 0.26 has none, so each replica is asked
with the call its own DP client uses for one (`_call_utility_async(..., engine=)`); one replica
answers through `collective_rpc`. (The other version differences: `common.in_vllm.compat`,
which this module does not import: it runs in `vllm serve`'s API server.)
"""

from __future__ import annotations

import asyncio
from typing import Any


async def every_worker(llm: Any, method: str) -> list[Any]:
    """`method` of the worker extension on every worker of every replica of `llm`."""
    core = getattr(llm, "engine_core", None)
    rpc = ("collective_rpc", method, None, (), None)  # the utility: method, timeout, args, kwargs
    if (ask_all := getattr(core, "call_utility_all_async", None)) is not None:
        per_replica = await ask_all(*rpc)
    elif len(getattr(core, "core_engines", ())) > 1:
        per_replica = await asyncio.gather(*[core._call_utility_async(*rpc, engine=engine)
                                             for engine in core.core_engines])
    else:
        return list(await llm.collective_rpc(method))
    return [reply for replies in per_replica for reply in replies]


def expected_workers(llm: Any) -> int:
    """Workers across every replica (TP x PP x DP)."""
    return int(llm.vllm_config.parallel_config.world_size_across_dp)
