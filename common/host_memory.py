"""Host byte buffers, page-locked where asked and the host can lock them.

A receiver that stages frames onto a GPU wants its receive buffers page-locked (its copies to
the GPU then run asynchronously, `common.transfer.apply_device`); where locking fails (no
accelerator runtime, locked memory exhausted) the buffer is pageable: the copies are then
synchronous, slower but correct, and a warning says so once.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_warned: set[str] = set()


def host_bytes(nbytes: int, device: torch.device | str, pinned: bool,
               zeros: bool = False) -> torch.Tensor:
    """`nbytes` uint8 on `device` (zeroed if `zeros`), page-locked if `pinned` and possible."""
    make = torch.zeros if zeros else torch.empty
    if pinned:
        try:
            return make(nbytes, dtype=torch.uint8, device=device, pin_memory=True)
        except RuntimeError as e:
            if (why := str(e).splitlines()[0]) not in _warned:
                _warned.add(why)
                log.warning("page-locked host memory unavailable (%s); staging copies from "
                            "pageable buffers run synchronously", why)
    return make(nbytes, dtype=torch.uint8, device=device)
