"""Allocation for the disk tier: pages of the data file, and aligned staging buffers.

`PageAllocator` (tiers/pages.py) is the scheme every tier shares, applied here
to the data file.

`StagingPool` holds the bounce buffers that demotions copy into: anonymous
mmaps (page aligned, as O_DIRECT needs), prefaulted at creation, recycled by
size, bounded by a byte budget. Idle ones beyond KEEP_BYTES are given back to
the system when the owner collects finished writes and none is queued
(`shrink`): a burst of demotions may fill the whole budget, resident, and the
daemon would otherwise keep it for good (at 10^5 blocks of 4 KiB, 132 MiB:
a third of its memory).
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict

from kvstore.tiers.pages import PageAllocator  # noqa: F401  (re-exported for kvstore.tiers.disk)

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
KEEP_BYTES = 64 << 20  # idle staging kept once the writer's queue is empty (the rest is unmapped)


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def new_buffer(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer, prefaulted in one call (first-touch faults cost more than the copy)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


class StagingPool:
    """Page-aligned anonymous buffers, recycled by size, bounded by `budget_bytes` (one always allowed).

    Used from the owner thread (take, give) and the writer thread (prewarm), hence the lock.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._idle: dict[int, list[mmap.mmap]] = defaultdict(list)
        self.held_bytes = 0  # idle + in use
        self.used_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap | None:
        size = round_up(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                self.used_bytes += size
                return idle.pop()
            if self.held_bytes + size > self.budget_bytes and self.used_bytes:
                self._trim(self.held_bytes + size - self.budget_bytes)
                if self.held_bytes + size > self.budget_bytes:
                    return None
            self.held_bytes += size
            self.used_bytes += size
        return new_buffer(size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self.used_bytes -= len(buf)
            self._idle[len(buf)].append(buf)

    def prewarm(self, nbytes: int, max_buffers: int = 256) -> None:
        """Fill the budget with idle buffers of this size (writer thread, when a namespace appears)."""
        size = round_up(nbytes)
        for _ in range(max_buffers):
            with self._lock:
                if self.held_bytes + size > self.budget_bytes:
                    return
                self.held_bytes += size
            buf = new_buffer(size)
            with self._lock:
                self._idle[size].append(buf)

    def shrink(self, keep_bytes: int | None = None) -> None:
        """Unmap idle buffers until the pool holds at most `keep_bytes` (KEEP_BYTES; buffers in use stay)."""
        keep_bytes = KEEP_BYTES if keep_bytes is None else keep_bytes
        with self._lock:
            if self.held_bytes > keep_bytes:
                self._trim(self.held_bytes - keep_bytes)

    def _trim(self, excess: int) -> None:
        for bufs in self._idle.values():
            while bufs and excess > 0:
                buf = bufs.pop()
                excess -= len(buf)
                self.held_bytes -= len(buf)
                buf.close()
