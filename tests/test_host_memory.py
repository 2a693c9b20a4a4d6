"""Host buffers for staging onto a GPU: page-locked where the host can lock them, else
pageable with one warning (the staging copies then run synchronously)."""

from __future__ import annotations

import logging

import torch

from common import host_memory


def test_host_bytes_are_page_locked_where_possible_else_pageable_and_said_once(
        caplog, monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="common.host_memory"):
        made = [host_memory.host_bytes(64, "cpu", pinned=True, zeros=True) for _ in range(3)]
    assert all(t.numel() == 64 and t.dtype == torch.uint8 and not t.any() for t in made)
    locks = torch.cuda.is_available()
    assert all(t.is_pinned() == locks for t in made)
    warnings = [r for r in caplog.records if "page-locked host memory unavailable" in r.message]
    assert len(warnings) == (0 if locks else 1), caplog.text
    assert not host_memory.host_bytes(8, "cpu", pinned=False).is_pinned()
