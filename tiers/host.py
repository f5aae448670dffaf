"""The host tier: one POSIX shared-memory arena, cut into fixed-size pages.

The daemon creates the arena file (under /dev/shm, mode 0600), sizes it to the
byte budget rounded down to whole pages, and prefaults it so that no store pays
first-touch page faults. Local clients map the same file (`map_arena`) and copy
payloads directly; payload bytes never cross the socket for them.

A block occupies ceil(nbytes / page_bytes) pages, allocated as extents
(`[offset, length]` runs) by the shared `PageAllocator` (tiers/pages.py); on a
fresh or lightly fragmented arena a block is one extent, so a copy is one memcpy.

Invariants (see `check`): a page is either free or owned by exactly one
allocation; used + free == capacity; allocation never exceeds capacity.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import numpy as np

from tiers.base import Tier
from tiers.pages import Extents, PageAllocator, pair_runs

_OS_PAGE = mmap.PAGESIZE


class HostArena(Tier):
    """Owner side (the daemon): creates, prefaults, allocates and frees pages (tiers/base.py)."""

    name = "host"
    client_readable = True
    host_memory = True

    def __init__(self, path: str, capacity_bytes: int, page_bytes: int, prefault: bool = True) -> None:
        if page_bytes <= 0 or page_bytes % _OS_PAGE:
            raise ValueError(f"page_bytes must be a positive multiple of {_OS_PAGE}, got {page_bytes}")
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"host capacity {capacity_bytes} B is smaller than one page ({page_bytes} B)")
        self.path = path
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.capacity_bytes = num_pages * page_bytes
        if os.path.exists(path):
            os.unlink(path)  # a stale arena of a previous daemon with the same name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity_bytes)
            self._mm = mmap.mmap(fd, self.capacity_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _advise_hugepages(self._mm)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        if prefault:
            self.buf[::_OS_PAGE] = 0  # touch every OS page: allocate it in tmpfs and map it
        self.pages = PageAllocator(num_pages, page_bytes, label="host")

    # -- bytes (the store's transfers, TCP inline payloads) ----------------------
    def segments(self, location: Extents) -> list[np.ndarray]:
        """The block's bytes in the arena, one view per extent (no copy)."""
        return [self.buf[o : o + n] for o, n in location]

    def write_from(self, alloc: Extents, src: Sequence[np.ndarray], meta=None) -> Extents:
        copy_segments(self.segments(alloc), src)
        return alloc

    def read_into(self, location: Extents, out: Sequence[np.ndarray]) -> bool:
        copy_segments(out, self.segments(location))
        return True

    def read(self, extents: Extents) -> bytes:
        return b"".join(self.buf[o : o + n].tobytes() for o, n in extents)

    def write(self, extents: Extents, data) -> None:
        copy_in(self.buf, extents, data)

    def close(self, unlink: bool = True) -> None:
        self.buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def map_arena(path: str, size: int) -> np.ndarray:
    """Client side: map an existing arena read-write, page tables prefaulted, as a uint8 array."""
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    _advise_hugepages(mm)
    return np.frombuffer(mm, dtype=np.uint8)


def _advise_hugepages(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages: fewer TLB misses per copy (~9% of memcpy speed here).

    Only takes effect where the kernel allows THP for shared memory
    (/sys/kernel/mm/transparent_hugepage/shmem_enabled = advise or always); elsewhere a no-op.
    """
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass


def _as_u8(data, writable: bool = False) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if writable and not data.flags.c_contiguous:
            raise ValueError("the destination must be C-contiguous (a reshape would copy it)")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


FAST_COPY_MIN_BYTES = 4096


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src` for two equal-sized 1-D uint8 arrays, without glibc's `rep movsb`.

    numpy's plain copy is glibc memcpy, which takes `rep movsb` for copies
    from ~64 KiB up to its non-temporal threshold. On AMD EPYC (these VMs;
    most cloud GPU hosts) that reads 4 KiB-page shared memory at half speed:
    7 GB/s against 13 out of the arena in 256 KiB pieces. A ufunc loop over
    8-byte words (`x | 0`, vectorised by numpy) moves 12.7 GB/s there, and
    matches or beats memcpy from 64 KiB to 2 MiB in both directions
    (`tools/bench/bench_store.py --copy-probe`; docs/benchmarks.md, "Store data
    path"). Unaligned or odd-sized runs, and small ones, keep the plain copy.
    """
    n = src.size
    if n >= FAST_COPY_MIN_BYTES and n % 8 == 0:
        s64, d64 = src.view(np.uint64), dst.view(np.uint64)
        if s64.flags.aligned and d64.flags.aligned:
            np.bitwise_or(s64, 0, out=d64)
            return
    dst[:] = src


def copy_segments(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> None:
    """Copy a block held in `src` views into `dst` views (same total size, any split on either side)."""
    if len(dst) == 1 and len(src) == 1 and dst[0].size == src[0].size:
        copy_bytes(dst[0], src[0])
        return
    for di, d_off, si, s_off, n in pair_runs([d.size for d in dst], [s.size for s in src]):
        copy_bytes(dst[di][d_off : d_off + n], src[si][s_off : s_off + n])


def copy_in(arena: np.ndarray, extents: Sequence, data) -> None:
    """Copy a payload (any buffer) into its extents of the arena."""
    src = _as_u8(data)
    total = sum(length for _, length in extents)
    if total != src.size:
        raise ValueError(f"payload is {src.size} B but the extents hold {total} B")
    pos = 0
    for offset, length in extents:
        copy_bytes(arena[offset : offset + length], src[pos : pos + length])
        pos += length


def copy_out(arena: np.ndarray, extents: Sequence, out=None) -> np.ndarray:
    """Copy a block out of the arena into `out` (a writable, contiguous buffer) or a new array."""
    total = sum(length for _, length in extents)
    dst = np.empty(total, dtype=np.uint8) if out is None else _as_u8(out, writable=True)
    if dst.size != total:
        raise ValueError(f"destination is {dst.size} B but the block is {total} B")
    pos = 0
    for offset, length in extents:
        copy_bytes(dst[pos : pos + length], arena[offset : offset + length])
        pos += length
    return dst
