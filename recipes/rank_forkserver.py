"""A multiprocessing context whose processes fork from a server that imported torch and the
refit core once: a rank then starts in milliseconds instead of paying the imports (about 1.5 s
of CPU each, which on 2 cores is most of a short multi-rank test).

It is the stdlib's forkserver with a server of its own: Python keeps one forkserver per
process, whose preload list is its first user's; `LocalEngine` preloads vLLM into that one,
and training ranks must not carry vLLM's import (nor its patches of torch).
"""

from __future__ import annotations

import io
import os
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

PRELOAD = ("torch", "torch.distributed", "common.transfer.sender", "common.transfer.receiver",
           "common.wire.group")

_SERVER = forkserver.ForkServer()
_SERVER.set_forkserver_preload(list(PRELOAD))


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver `Popen`, connecting to `_SERVER` instead of the process-wide one
    (the body of `popen_forkserver.Popen._launch` with that one name changed)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process, as in the stdlib
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:  # noqa: N802 - the stdlib's name
        return _Popen(process_obj)


class RankContext(context.ForkServerContext):
    """`mp.get_context("forkserver")` with `_SERVER` behind its `Process`."""

    Process = _Process


def rank_context() -> RankContext:
    return RankContext()
