"""Fixed-size pages and their allocator, shared by every tier (host arena, disk file, GPU pool).

A free-page stack that yields ascending page numbers; an allocation of n bytes
takes ceil(n / page_bytes) pages and is described as *extents*, a list of
`[offset, length]` runs in bytes, in payload order. On a fresh or lightly
fragmented space a block is one extent, so a copy is one memcpy or one syscall.

The free pages are the pages from a watermark up, never allocated since the
allocator was made (implicit: no memory), under a stack of the others, freed
since or found free below the highest page taken at a restart (`array('q')` of
machine integers, 8 bytes a page, with a list's pop/append speed). Allocation
takes the stack's top first, then the watermark's next pages: the order a
stack of every free page would give, without 8 bytes for each page of an empty
tier (8 GB for a 4 TiB disk of 4 KiB pages) or the copies of it that building
such a stack took at a start.

Invariant (`check`): every page is either free or owned by exactly one
allocation; nothing is allocated beyond `num_pages`.
"""

from __future__ import annotations

from array import array
from typing import Callable, Iterable, Sequence

import numpy as np

Extents = list  # list of [offset, length] pairs, in payload order


def allocate_each(allocate: Callable[[int], object | None], nbytes: int, count: int) -> list:
    """`allocate(nbytes)` up to `count` times, until it answers None: the allocations, in order."""
    out = []
    for _ in range(count):
        alloc = allocate(nbytes)
        if alloc is None:
            break
        out.append(alloc)
    return out


def adjacent_groups(blocks: Sequence[Extents], limit: int, apart: Sequence[bool] = ()) -> list[list[int]]:
    """The positions of `blocks` (each its extents) in the order of their first offsets, grouped: a block
    in one extent that starts where the group's last block ended joins the group while it stays within
    `limit` bytes; any other block starts a group, and a block marked in `apart` is in one of its own
    (nothing joins it). One group can then be one vectored I/O (tiers/disk.py)."""
    groups: list[list[int]] = []
    end = size = -1
    for i in sorted(range(len(blocks)), key=lambda i: blocks[i][0][0]):
        extents, alone = blocks[i], bool(apart) and apart[i]
        nbytes = sum(n for _, n in extents)
        if len(extents) == 1 and extents[0][0] == end and size + nbytes <= limit and not alone:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
        end = extents[0][0] + extents[0][1] if len(extents) == 1 and not alone else -1
    return groups


def contiguous_runs(pieces: Sequence[tuple[int, int, int]], limit: int, most: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `pieces` ((offset, length, buffers), sorted by offset) that follow one another
    in the file: one vectored I/O each, of at most `limit` bytes and `most` buffers (a piece larger than
    that alone)."""
    runs = []
    start = 0
    while start < len(pieces):
        end, at, buffers = start + 1, pieces[start][0] + pieces[start][1], pieces[start][2]
        while (end < len(pieces) and pieces[end][0] == at and buffers + pieces[end][2] <= most
               and at + pieces[end][1] - pieces[start][0] <= limit):
            at, buffers, end = at + pieces[end][1], buffers + pieces[end][2], end + 1
        runs.append((start, end))
        start = end
    return runs


class PageAllocator:
    """Free pages over `num_pages` pages (module docstring); allocations are extents of byte offsets."""

    def __init__(self, num_pages: int, page_bytes: int, used: Iterable[int] = (), label: str = "") -> None:
        """`used`: the pages taken already (a restart's records), as page numbers."""
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.label = f"{label} " if label else ""
        used = used if isinstance(used, np.ndarray) else np.array(list(used), dtype=np.int64)
        self._next = int(used.max()) + 1 if used.size else 0  # the watermark: pages from here on are free
        taken = np.zeros(self._next, dtype=bool)
        taken[used] = True
        self._free = array("q", np.flatnonzero(~taken)[::-1].astype(np.int64).tobytes())  # pop(): ascending pages

    @classmethod
    def full(cls, num_pages: int, page_bytes: int, label: str = "") -> PageAllocator:
        """No free page (a tier whose records are not read yet: it takes none until it knows its own)."""
        alloc = cls(num_pages, page_bytes, label=label)
        alloc._next = num_pages
        return alloc

    @property
    def free_pages(self) -> int:
        return len(self._free) + self.num_pages - self._next

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def _take(self, n: int) -> list[int]:
        """n free pages, in the order pops from a stack of every free page would give them (the stack's
        top, then the watermark's next): the caller checked there are n."""
        free = self._free
        k = min(n, len(free))
        pages = free[len(free) - k :].tolist()[::-1] if k else []
        del free[len(free) - k :]
        if k < n:
            pages += range(self._next, self._next + n - k)
            self._next += n - k
        return pages

    def allocate(self, nbytes: int) -> list | None:
        n = self.pages_for(nbytes)
        if nbytes <= 0 or n > len(self._free) + self.num_pages - self._next:
            return None
        if n == 1:  # a block of one page (e.g. 256 KiB blocks on 256 KiB pages): per block on the loop
            if self._free:
                return [[self._free.pop() * self.page_bytes, nbytes]]
            self._next += 1
            return [[(self._next - 1) * self.page_bytes, nbytes]]
        pages = sorted(self._take(n))
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

    def allocate_many(self, nbytes: int, count: int) -> list[list]:
        """`allocate(nbytes)` up to `count` times while pages last, in one call: the same pages in
        the same order as the calls one by one (`free_unused` gives back what the caller did not use)."""
        n = self.pages_for(nbytes)
        if n != 1 or nbytes <= 0:
            return allocate_each(self.allocate, nbytes, count)
        k = min(count, self.free_pages)
        if k <= 0:
            return []
        pb = self.page_bytes
        return [[[p * pb, nbytes]] for p in self._take(k)]

    def free_unused(self, allocations: Sequence) -> None:
        """Give back allocations of `allocate_many` that were not used, as if never taken (the last
        taken goes back first)."""
        for extents in reversed(allocations):
            self.free(extents)

    def pages_of(self, extents: Sequence) -> list[int]:
        pb, pages = self.page_bytes, []
        for offset, length in extents:
            pages.extend(range(offset // pb, offset // pb + -(-length // pb)))
        return pages

    def free(self, extents: Sequence) -> None:
        if len(extents) == 1 and extents[0][1] <= self.page_bytes:  # one page
            self._free.append(extents[0][0] // self.page_bytes)
            return
        self._free.extend(sorted(self.pages_of(extents), reverse=True))

    def check(self, allocations: Iterable[Sequence]) -> list[str]:
        """Problems found comparing the free stack with the live allocations (empty = clean)."""
        owner = np.zeros(self.num_pages, dtype=np.int32)
        problems: list[str] = []
        for extents in allocations:
            for offset, length in extents:
                if offset % self.page_bytes or length <= 0 or offset + length > self.num_pages * self.page_bytes:
                    problems.append(f"bad {self.label}extent [{offset}, {length}]")
                    continue
                owner[offset // self.page_bytes : offset // self.page_bytes + -(-length // self.page_bytes)] += 1
        np.add.at(owner, np.frombuffer(self._free, dtype=np.int64) if len(self._free) else [], 1)
        owner[self._next :] += 1  # (free from the watermark up)
        if (owner > 1).any():
            problems.append(f"{int((owner > 1).sum())} {self.label}pages owned twice")
        if (owner == 0).any():
            problems.append(f"{int((owner == 0).sum())} {self.label}pages leaked (neither free nor allocated)")
        return problems


def pair_runs(dst_sizes: Sequence[int], src_sizes: Sequence[int]):
    """Pair two splits of the same payload: yields (dst index, dst offset, src index, src offset, length)."""
    if sum(dst_sizes) != sum(src_sizes):
        raise ValueError(f"source holds {sum(src_sizes)} B, destination {sum(dst_sizes)} B")
    si, s_off = 0, 0
    for di, d_size in enumerate(dst_sizes):
        d_off = 0
        while d_off < d_size:
            while src_sizes[si] == s_off:
                si, s_off = si + 1, 0
            n = min(d_size - d_off, src_sizes[si] - s_off)
            yield di, d_off, si, s_off, n
            d_off += n
            s_off += n
