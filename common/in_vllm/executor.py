"""`RefitMultiprocExecutor`: vLLM's multiprocess executor, reading every worker's reply.

vLLM's `MultiprocExecutor.collective_rpc` reads the workers' replies in rank order and raises
at the first failed one, leaving the later workers' replies queued: the next call then reads
the previous call's replies (every later call shifted by one). A refit that fails on every
worker (one verdict on every rank) would so poison the engine's next control call at TP>=2.
This subclass reads every worker's reply of a call that waits for all of them before the
first failure is raised. Use it for engines with more than one worker per replica:
`--distributed-executor-backend common.in_vllm.executor.RefitMultiprocExecutor` (`vllm serve`)
or `distributed_executor_backend=RefitMultiprocExecutor` (`LLM` / `AsyncLLM`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.executor.multiproc_executor import MultiprocExecutor


class _Replies:
    """The replies of one call to every worker: the first read drains them all (in rank
    order, within the call's timeout), then each worker's is handed out as vLLM asks."""

    def __init__(self, queues: Sequence[Any]) -> None:
        self.queues = list(queues)
        self.read: list[tuple[bool, Any]] | None = None  # per worker: (ok, reply or error)

    def get(self, rank: int, timeout: float | None) -> Any:
        if self.read is None:
            self.read = []
            deadline = None if timeout is None else time.monotonic() + timeout
            for queue in self.queues:  # one deadline for them all, as vLLM's own loop
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self.read.append((True, queue.dequeue(timeout=left)))
                except Exception as e:  # noqa: BLE001 - handed to vLLM in its worker's turn
                    self.read.append((False, e))
        ok, value = self.read[rank]
        if not ok:
            raise value
        return value


class _ReplyQueue:
    """Worker `rank`'s response queue as vLLM's reply loop sees it (`dequeue` only)."""

    def __init__(self, replies: _Replies, rank: int) -> None:
        self.replies, self.rank = replies, rank

    def dequeue(self, timeout: float | None = None, **_: Any) -> Any:
        return self.replies.get(self.rank, timeout)


class RefitMultiprocExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose calls to every worker leave no reply behind (module
    docstring); calls answered by one worker (the model's steps) are vLLM's own."""

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None, **aggregators: Any) -> Any:
        if unique_reply_rank is not None or any(aggregators.values()):
            return super().collective_rpc(method, timeout, args, kwargs, non_block,
                                          unique_reply_rank, **aggregators)
        queues = self.response_mqs
        replies = _Replies(queues)
        # vLLM's reply loop reads `self.response_mqs` once, as the call is made
        self.response_mqs = [_ReplyQueue(replies, rank) for rank in range(len(queues))]
        try:
            return super().collective_rpc(method, timeout, args, kwargs, non_block,
                                          unique_reply_rank, **aggregators)
        finally:
            self.response_mqs = queues
