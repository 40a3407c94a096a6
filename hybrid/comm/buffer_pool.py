"""Reusable flat buffers, bounded.

A fresh CPU buffer page-faults its way into memory on every use (an 8 MB fp32 buffer cost ~3 ms on the
bench machine, on every call), so buffers a step asks for again and again -- the pairwise exchange's
receive buffers (``hybrid.comm``), stage 2-3 gradient buckets (``hybrid.zero.buckets``) -- are kept and
handed out again. A `BufferPool` keys them by ``(dtype, device, numel)`` and holds at most ``cap_numel``
elements, counting the buffers handed out and not yet given back together with the kept ones: a buffer
given back past the cap is dropped. A kept buffer holds whatever its last user left in it.
"""

from __future__ import annotations

import torch


class BufferPool:
    def __init__(self, cap_numel: int):
        self.cap_numel = cap_numel
        self.in_use_numel = 0  # elements handed out and not given back
        self._kept: dict = {}  # (dtype, device, numel) -> buffers
        self._kept_numel = 0

    def may_take(self, numel: int) -> bool:
        """Whether ``numel`` more elements in use stay within the cap (always, when none is in use)."""
        return self.in_use_numel == 0 or self.in_use_numel + numel <= self.cap_numel

    def take(self, numel: int, dtype: torch.dtype, device, *, zeroed: bool = False) -> torch.Tensor:
        """A kept buffer of that shape if any, else a new one (zero-filled when ``zeroed``)."""
        kept = self._kept.get((dtype, torch.device(device), numel))
        if kept:
            buf = kept.pop()
            self._kept_numel -= numel
        else:
            buf = (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
        self.in_use_numel += numel
        return buf

    def give(self, buf: torch.Tensor, *, keep: bool = True) -> None:
        """Return a buffer from ``take``; it is kept for reuse if ``keep`` and the cap allows."""
        n = buf.numel()
        self.in_use_numel -= n
        if keep and self._kept_numel + self.in_use_numel + n <= self.cap_numel:
            self._kept.setdefault((buf.dtype, buf.device, n), []).append(buf)
            self._kept_numel += n

    def kept(self) -> list:
        """The buffers held for reuse (for memory reports)."""
        return [b for bufs in self._kept.values() for b in bufs]

    def clear(self) -> None:
        """Drop every kept buffer."""
        self._kept.clear()
        self._kept_numel = 0
