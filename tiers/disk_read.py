"""Reading blocks out of the disk tier's data file: one object, `DataFileReader`, that the tier owns
(tiers/disk.py decides what to read; this module only reads and verifies).

- A block's bytes go where the caller wants them (`dst`, uint8 arrays covering the block in order).
  With O_DIRECT and page-aligned destinations of whole 4 KiB the disk DMAs straight into them
  (`direct_views`); otherwise the read goes through an aligned bounce buffer of the reading thread.
- `read_together` reads several exact blocks whose pieces follow one another in the file with one
  preadv each run, up to RUN_BYTES and IOV_MAX buffers a call (small blocks demoted together sit on
  adjacent pages), and verifies each block on its own as soon as its pieces are in.
- Every block read is verified against its xxh3-64 checksum; a block that does not verify is False,
  a block whose read failed is None (logged), never served.

Threads: any. Each thread has its own bounce and encoded-block buffers (`threading.local`); the counters
are plain ints bumped under the GIL (inspection figures, not invariants).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from kvstore.tiers.disk_alloc import ALIGN, round_up
from kvstore.tiers.disk_writer import IOV_MAX, RUN_BYTES
from kvstore.tiers.pages import contiguous_runs

log = logging.getLogger(__name__)


def open_data_file(data_path: str, capacity_bytes: int, direct: bool | None) -> tuple[int, bool, str]:
    """The data file at `data_path`, preallocated to `capacity_bytes` (cut to it where it was larger: the
    records beyond are dropped at load), opened for O_DIRECT unless `direct` is False or its filesystem
    refuses it: (fd, whether O_DIRECT, why not)."""
    fd = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size > capacity_bytes:
            os.ftruncate(fd, capacity_bytes)
        os.posix_fallocate(fd, 0, capacity_bytes)
    finally:
        os.close(fd)
    if direct is False:
        return os.open(data_path, os.O_RDWR), False, "disabled by configuration"
    try:
        fd = os.open(data_path, os.O_RDWR | os.O_DIRECT)
        probe = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [probe], 0)
        finally:
            probe.close()
        return fd, True, ""
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        reason = f"the filesystem of {os.path.dirname(data_path)} refuses O_DIRECT ({exc.strerror})"
        log.warning("disk tier: buffered I/O with fdatasync: %s", reason)
        return os.open(data_path, os.O_RDWR), False, reason


@dataclass(slots=True)
class ReadCounters:
    reads: int = 0  # blocks read and verified (or not)
    bytes_read: int = 0
    read_calls: int = 0  # preadv calls (blocks on adjacent pages read together share one)


class DataFileReader:
    """Reads and verifies blocks of the data file `fd` (opened with O_DIRECT where `direct`)."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct
        self.counters = ReadCounters()
        self._tls = threading.local()

    def read_block(self, extents: Sequence, nbytes: int, checksum: int | None, dst: Sequence[np.ndarray]) -> bool:
        """Read the block at `extents` into `dst` (covering `nbytes`); True if its checksum verifies."""
        if sum(d.size for d in dst) != nbytes:
            raise ValueError("destination does not cover the block")
        views = self.direct_views(extents, dst)
        if views is not None:
            for (offset, _), bufs in zip(extents, views):
                for i in range(0, len(bufs), IOV_MAX // 2):  # stay under IOV_MAX
                    group = bufs[i : i + IOV_MAX // 2]
                    span = sum(b.size for b in group)
                    self._preadv_all(group, offset, span)
                    offset += span
        else:
            bounce = self._buffer("bounce", round_up(nbytes))
            pos = 0
            for offset, length in extents:
                span = round_up(length) if self.direct else length
                self._preadv_all([bounce[pos : pos + span]], offset, span)
                pos += length
            pos = 0
            for d in dst:
                d[:] = bounce[pos : pos + d.size]
                pos += d.size
        return self._verified(dst, checksum)

    def read_together(self, blocks: Sequence[tuple[Sequence, list[list[np.ndarray]], Sequence[np.ndarray], int]]
                      ) -> list[bool | None]:
        """Several exact blocks, each `(extents, views, dst, checksum)` with `views` from `direct_views`
        (at most IOV_MAX // 2 a piece): their pieces in file order, those that follow one another read
        with one preadv. Per block: True, False (its bytes do not verify) or None (its read failed)."""
        results: list[bool | None] = [None] * len(blocks)
        pieces = []  # (file offset, length, the destination views it fills, block)
        for i, (extents, views, _, _) in enumerate(blocks):
            pieces.extend((offset, length, v, i) for (offset, length), v in zip(extents, views))
        pieces.sort(key=lambda piece: piece[0])
        failed, left = set(), {}  # blocks whose read failed; pieces not read yet, per block
        for piece in pieces:
            left[piece[3]] = left.get(piece[3], 0) + 1
        for start, end in contiguous_runs([(p[0], p[1], len(p[2])) for p in pieces], RUN_BYTES, IOV_MAX):
            offset, at = pieces[start][0], pieces[end - 1][0] + pieces[end - 1][1]
            try:
                self._preadv_all([v for piece in pieces[start:end] for v in piece[2]], offset, at - offset)
            except OSError as exc:  # the blocks of this read fail, not the others
                log.error("disk tier: read of %d B at %d failed: %s", at - offset, offset, exc)
                failed.update(piece[3] for piece in pieces[start:end])
            # Each block is verified as soon as its pieces are in, not after the whole group: the other
            # reader threads read meanwhile.
            for piece in pieces[start:end]:
                i = piece[3]
                left[i] -= 1
                if not left[i] and i not in failed:
                    results[i] = self._verified(blocks[i][2], blocks[i][3])
        return results

    def direct_views(self, extents: Sequence, dst: Sequence[np.ndarray]) -> list[list[np.ndarray]] | None:
        """`dst` cut along `extents` (per extent, the views it fills, in order) where the disk can DMA
        straight into them (O_DIRECT, page-aligned destinations, a block of whole 4 KiB); else None."""
        nbytes = sum(d.size for d in dst)
        if not (self.direct and nbytes % ALIGN == 0 and sum(n for _, n in extents) == nbytes and all(
                d.ctypes.data % ALIGN == 0 and d.size % ALIGN == 0 for d in dst)):
            return None
        segments, out = list(dst), []
        for _, length in extents:
            bufs, need = [], length
            while need:
                seg = segments[0]
                take = min(need, seg.size)
                bufs.append(seg[:take])
                segments[0] = seg[take:]
                if segments[0].size == 0:
                    segments.pop(0)
                need -= take
            out.append(bufs)
        return out

    def blob(self, size: int) -> np.ndarray:
        """A buffer of the calling thread for an encoded block (apart from `read_block`'s bounce buffer)."""
        return self._buffer("blob", size)

    def _verified(self, dst: Sequence[np.ndarray], checksum: int | None) -> bool:
        """Count a block read into `dst`; whether its bytes have `checksum`."""
        self.counters.reads += 1
        self.counters.bytes_read += sum(d.size for d in dst)
        h = xxhash.xxh3_64()
        for d in dst:
            h.update(d)
        return h.intdigest() == checksum

    def _preadv_all(self, bufs: list, offset: int, length: int) -> None:
        self.counters.read_calls += 1
        got = os.preadv(self.fd, bufs, offset)
        if got != length:
            raise OSError(errno.EIO, f"short read of {got} B of {length} B at {offset}")

    def _buffer(self, name: str, size: int) -> np.ndarray:
        """The calling thread's page-aligned buffer `name`, grown to `size` where smaller."""
        buf = getattr(self._tls, name, None)
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, round_up(size))
            setattr(self._tls, name, buf)
        return np.frombuffer(buf, dtype=np.uint8, count=size)
