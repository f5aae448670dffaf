"""The client's side of the host arena: mapping the daemon's arena file, and copying blocks in and
out of it. The daemon's side (creating, paging, indexing the arena) is tiers/host.py, which uses
these too; a client (kvstore/client.py) imports only this module of the tiers.

A client maps with O_NOFOLLOW and, given the daemon's uid, refuses a file that
another user owns or that is smaller than announced (`map_arena`): /dev/shm is
shared by every user and the arena's name is predictable.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Sequence

import numpy as np

from kvstore.tiers.pages import pair_runs


class ArenaRefused(PermissionError):
    """Something at the arena's path must not be used, removed or mapped (another user's file, a
    symlink, a file smaller than announced). kvstore raises it on as OwnershipError."""


def _describe(st: os.stat_result) -> str:
    kind = "symbolic link" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "special file"
    return f"a {kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def map_arena(path: str, size: int, owner_uid: int | None = None) -> np.ndarray:
    """Client side: map an existing arena read-write, page tables prefaulted, as a uint8 array.

    Never through a symlink; with `owner_uid` (the daemon's, from SO_PEERCRED) a file that
    another user owns is refused (ArenaRefused), and so is one smaller than `size`
    (touching past its end would SIGBUS), before anything is mapped.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArenaRefused(f"the arena path {path} is a symbolic link: not mapped") from None
        raise
    try:
        if owner_uid is not None:
            _check_arena(fd, path, size, owner_uid)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    _advise_hugepages(mm)
    return np.frombuffer(mm, dtype=np.uint8)


def _check_arena(fd: int, path: str, size: int, owner_uid: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner_uid:
        raise ArenaRefused(f"the arena {path} is {_describe(st)}, but the daemon runs as uid {owner_uid}: "
                             f"not mapped (another user's file at the arena's path)")
    if st.st_size < size:
        raise ArenaRefused(f"the arena {path} holds {st.st_size} B, the daemon announced {size} B: not mapped")


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


SMALL_COPY_BYTES = 64 << 10  # below this glibc's memcpy does not take `rep movsb`: a plain copy is best


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src` for two equal-sized 1-D uint8 arrays, without glibc's `rep movsb`.

    numpy's plain copy is glibc memcpy, which takes `rep movsb` for copies
    from ~64 KiB up to its non-temporal threshold. On AMD EPYC (these VMs;
    most cloud GPU hosts) that reads 4 KiB-page shared memory at half speed:
    7 GB/s against 13 out of the arena in 256 KiB pieces. A ufunc loop over
    8-byte words (`x | 0`, vectorised by numpy) moves 12.7 GB/s there, and
    matches or beats memcpy from 64 KiB to 2 MiB in both directions
    (`tools/bench/bench_store.py --copy-probe`; docs/benchmarks.md, "Store data
    path"). Unaligned or odd-sized runs, and small ones, keep the plain copy: under 64 KiB memcpy takes
    no `rep movsb`, and the ufunc's call costs more than the copy (4 KiB out of the arena into a staging
    buffer: 1.8 us against 0.8).
    """
    n = src.size
    if n >= SMALL_COPY_BYTES and n % 8 == 0:
        s64, d64 = src.view(np.uint64), dst.view(np.uint64)
        if s64.flags.aligned and d64.flags.aligned:
            np.bitwise_or(s64, 0, out=d64)
            return
    dst[:] = src


def copy_held(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src` without letting the GIL go, for small pieces. NumPy lets it go for a copy of more
    than 500 elements, and a thread waiting for it (the disk writer) takes it: in the daemon, each such
    hand-over cost the event loop ~7 us of kernel time on these VMs, against 0.8 us for the copy of a
    4 KiB block (a demotion into the disk tier: 47 -> 38 us a block in process). A large copy is worth
    the hand-over: other threads run while it copies."""
    try:
        memoryview(dst)[:] = memoryview(src)
    except (TypeError, ValueError):  # (not two plain buffers of one shape: NumPy's copy, or its error)
        dst[:] = src


def copy_segments(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> None:
    """Copy a block held in `src` views into `dst` views (same total size, any split on either side).
    The daemon's copy: pieces under SMALL_COPY_BYTES keep the GIL (`copy_held`)."""
    if len(dst) == 1 and len(src) == 1 and dst[0].size == src[0].size:
        _copy_piece(dst[0], src[0])
        return
    for di, d_off, si, s_off, n in pair_runs([d.size for d in dst], [s.size for s in src]):
        _copy_piece(dst[di][d_off : d_off + n], src[si][s_off : s_off + n])


def _copy_piece(dst: np.ndarray, src: np.ndarray) -> None:
    (copy_held if src.size < SMALL_COPY_BYTES else copy_bytes)(dst, src)


_U8 = np.dtype(np.uint8)


def copy_in_many(arena: np.ndarray, extents: Sequence[Sequence], payloads: Sequence) -> None:
    """`copy_in` for several blocks. A small block in one extent from a flat uint8 array (a client's
    batch of small blocks) is one slice assignment; the rest go through `copy_in`."""
    for ext, data in zip(extents, payloads):
        if len(ext) == 1 and type(data) is np.ndarray and data.dtype is _U8 and data.ndim == 1:
            offset, length = ext[0]
            if length < SMALL_COPY_BYTES and data.size == length:
                arena[offset : offset + length] = data
                continue
        copy_in(arena, ext, data)


def copy_out_many(arena: np.ndarray, extents: Sequence[Sequence], outs: Sequence) -> None:
    """`copy_out` of several blocks into their `outs`, with `copy_in_many`'s fast path."""
    for ext, out in zip(extents, outs):
        if len(ext) == 1 and type(out) is np.ndarray and out.dtype is _U8 and out.ndim == 1:
            offset, length = ext[0]
            if length < SMALL_COPY_BYTES and out.size == length:
                out[:] = arena[offset : offset + length]
                continue
        copy_out(arena, ext, out)


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
