"""Allocation for the disk tier: pages of the data file, and aligned staging buffers.

`PageAllocator` is the host arena's scheme applied to a file: a free-page stack
that yields ascending pages, allocations described as extents (`[offset,
length]` runs, byte offsets); on a fresh or lightly fragmented file a block is
one extent. Invariant (`check`): every page is free or owned exactly once.

`StagingPool` holds the bounce buffers that demotions copy into: anonymous
mmaps (page aligned, as O_DIRECT needs), prefaulted at creation, recycled by
size, bounded by a byte budget.
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class PageAllocator:
    """Free-page stack over `num_pages` pages; allocations are extents of byte offsets."""

    def __init__(self, num_pages: int, page_bytes: int, used: Iterable[int] = ()) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        taken = np.zeros(num_pages, dtype=bool)
        taken[list(used)] = True
        self._free: list[int] = np.flatnonzero(~taken)[::-1].tolist()  # pop() yields ascending pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def allocate(self, nbytes: int) -> list | None:
        n = self.pages_for(nbytes)
        if nbytes <= 0 or n > len(self._free):
            return None
        pages = sorted(self._free[-n:])
        del self._free[-n:]
        pb, extents, remaining = self.page_bytes, [], nbytes
        run_start = prev = pages[0]
        for p in pages[1:] + [None]:
            if p is not None and p == prev + 1:
                prev = p
                continue
            length = min((prev - run_start + 1) * pb, remaining)
            extents.append([run_start * pb, length])
            remaining -= length
            if p is not None:
                run_start = prev = p
        return extents

    def pages_of(self, extents: Sequence) -> list[int]:
        pb, pages = self.page_bytes, []
        for offset, length in extents:
            pages.extend(range(offset // pb, offset // pb + -(-length // pb)))
        return pages

    def free(self, extents: Sequence) -> None:
        self._free.extend(sorted(self.pages_of(extents), reverse=True))

    def check(self, allocations: Iterable[Sequence]) -> list[str]:
        owner = np.zeros(self.num_pages, dtype=np.int32)
        problems: list[str] = []
        for extents in allocations:
            for offset, length in extents:
                if offset % self.page_bytes or length <= 0 or offset + length > self.num_pages * self.page_bytes:
                    problems.append(f"bad disk extent [{offset}, {length}]")
                    continue
                owner[offset // self.page_bytes : offset // self.page_bytes + -(-length // self.page_bytes)] += 1
        np.add.at(owner, self._free, 1)
        if (owner > 1).any():
            problems.append(f"{int((owner > 1).sum())} disk pages owned twice")
        if (owner == 0).any():
            problems.append(f"{int((owner == 0).sum())} disk pages leaked (neither free nor allocated)")
        return problems


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

    def _trim(self, excess: int) -> None:
        for bufs in self._idle.values():
            while bufs and excess > 0:
                buf = bufs.pop()
                excess -= len(buf)
                self.held_bytes -= len(buf)
                buf.close()
