"""The disk tier's writer thread (a part of `kvstore.tiers.disk.DiskTier`, apart for the reader).

The thread takes batches of queued operations (namespace puts, record deletes,
block writes), collapses them per key (the last operation wins), commits the
deletes, writes the data, fdatasyncs once, and commits the new records in one
LMDB transaction (group commit). When nothing is queued and nobody waits in
`flush`, it zero-fills the data file from the `formatted_bytes` watermark, so
that later block writes are overwrites (see tiers/disk.py, "Formatting").

`DiskWriter` holds only methods: the state they share with the owner thread
(`_ops`, `_cv`, `_finished`, the data file `fd`, the LMDB handles) is set up by
`DiskTier.__init__`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable

import lmdb
import msgpack
import numpy as np
import xxhash

from kvstore.tiers.disk_alloc import round_up

log = logging.getLogger("kvstore.tiers.disk")


@dataclass(slots=True, eq=False)
class DiskWrite:
    """One queued block write. The writer sets `checksum`, then `done` (and `error` on failure)."""

    key: bytes
    record: dict
    extents: list
    nbytes: int
    buf: mmap.mmap
    checksum: int | None = None
    done: bool = False
    error: str | None = None
    encode: Callable[[np.ndarray], np.ndarray] | None = None  # compress before writing (writer thread)
    stored: int | None = None  # bytes written when encoded (the extents' total)

    def view(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.nbytes)



class DiskWriter:
    """The writer thread's side of DiskTier."""

    def _run(self) -> None:
        while True:
            with self._cv:
                # Format only when idle: not while writes are queued, nor while someone waits in flush().
                while not self._ops and not self._closing and (
                    self.formatted_bytes >= self.capacity_bytes or self._flushing
                ):
                    self._cv.wait()
                if not self._ops and self._closing:
                    try:
                        self._save_formatted()
                    except lmdb.Error as exc:
                        log.warning("disk tier: formatting progress not saved: %s", exc)
                    return
                # Deletions alone need no sync of their own (see _write_batch): gather them for a while.
                deadline = time.monotonic() + self.delete_delay_s
                while self._ops and not self._num_writes_queued and not self._closing and not self._flushing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch, nbytes = [], 0
                while self._ops and nbytes < self.batch_bytes:
                    op = self._ops.popleft()
                    batch.append(op)
                    if op[0] != "del":
                        self._num_writes_queued -= 1
                    if op[0] == "put":
                        nbytes += op[1].nbytes
                self._busy = True
                self._inflight_puts = sum(1 for op in batch if op[0] == "put")
            done: list[DiskWrite] = []
            if not batch:
                try:
                    self._format_chunk()
                except Exception as exc:  # OSError, lmdb.Error: never let the thread die
                    log.error("disk tier: formatting stopped: %s", exc)
                    self.formatted_bytes = self.capacity_bytes  # writes still work, only slower
            else:
                try:
                    done = self._write_batch(batch)
                except BaseException as exc:  # never let the thread die silently
                    log.exception("disk writer failed")
                    done = [op[1] for op in batch if op[0] == "put"]
                    for job in done:
                        job.error = job.error or f"{type(exc).__name__}: {exc}"
            with self._cv:
                for job in done:
                    job.done = True
                self._finished.extend(done)
                self._busy = False
                self._inflight_puts = 0
                self._cv.notify_all()

    def _write_batch(self, batch: list[tuple]) -> list[DiskWrite]:
        final: dict[bytes, tuple] = {}
        deleted: set[bytes] = set()
        namespaces: list[tuple] = []
        warm = [op[1] for op in batch if op[0] == "warm"]
        for op in batch:
            if op[0] == "warm":
                pass
            elif op[0] == "ns":
                namespaces.append(op)
            elif op[0] == "del":
                final[op[1]] = op
                deleted.add(op[1])
            else:
                final[op[1].key] = op
        jobs = [op[1] for op in batch if op[0] == "put"]
        puts = [job for job in jobs if final.get(job.key) == ("put", job)]
        if deleted or namespaces:
            with self.env.begin(write=True) as txn:
                for _, key, value in namespaces:
                    txn.put(key, value, db=self._db_ns)
                for key in deleted:
                    txn.delete(key, db=self._db_blocks)
        written = []
        for job in puts:
            try:
                self._write_job(job)
                written.append(job)
            except OSError as exc:
                self.counters.write_errors += 1
                job.error = f"write failed: {exc}"
                log.error("disk tier: %s", job.error)
        if written:
            os.fdatasync(self.fd)
            self.counters.fsyncs += 1
            with self.env.begin(write=True, db=self._db_blocks) as txn:
                for job in written:
                    rec = dict(job.record, e=job.extents, n=job.nbytes if job.stored is None else job.stored,
                               x=job.checksum)
                    txn.put(job.key, msgpack.packb(rec))
        self.counters.batches += 1
        for nbytes in warm:  # after the writes: they do not wait for it
            try:
                self.staging.prewarm(nbytes)
            except (OSError, MemoryError) as exc:
                log.warning("disk tier: staging buffers not prefaulted: %s", exc)
        return jobs

    def _format_chunk(self, chunk_bytes: int = 8 << 20) -> None:
        """Zero-fill the next chunk past the watermark, skipping pages that hold block data."""
        pb = self.page_bytes
        start = self.formatted_bytes // pb
        end = min(self.num_pages, start + max(1, chunk_bytes // pb))
        zeros = self._zeros(chunk_bytes)
        free = np.flatnonzero(~self._written[start:end]) + start
        if free.size:
            breaks = np.flatnonzero(np.diff(free) != 1) + 1
            for run in np.split(free, breaks):
                self._pwrite_all(memoryview(zeros)[: run.size * pb], int(run[0]) * pb)
        self.formatted_bytes = end * pb
        if self.formatted_bytes >= self.capacity_bytes or self.formatted_bytes % (32 << 20) < chunk_bytes:
            self._save_formatted()

    def _save_formatted(self) -> None:
        self._meta["formatted_bytes"] = self.formatted_bytes
        with self.env.begin(write=True, db=self._db_meta) as txn:
            txn.put(b"meta", msgpack.packb(self._meta))

    def _zeros(self, size: int) -> mmap.mmap:
        buf = getattr(self, "_zero_buf", None)
        if buf is None or len(buf) < size:
            buf = self._zero_buf = mmap.mmap(-1, round_up(size))
        return buf

    def wait_formatted(self) -> None:
        """Block until the whole data file has been written once (see Formatting)."""
        with self._cv:
            while self.formatted_bytes < self.capacity_bytes or self._ops or self._busy:
                self._cv.wait()

    def _write_job(self, job: DiskWrite) -> None:
        mv = memoryview(job.buf)
        data = job.view()
        if job.encode is not None:  # the staging buffer holds the exact block: store it encoded
            try:
                blob = job.encode(data)
            except Exception as exc:  # noqa: BLE001 - this block fails, not the batch
                raise OSError(errno.EIO, f"encoding failed: {exc}") from None
            if blob.size != sum(n for _, n in job.extents):
                raise OSError(errno.EIO, f"encoded {blob.size} B for {sum(n for _, n in job.extents)} B of pages")
            buf = self._encode_buffer(round_up(blob.size))
            data = np.frombuffer(buf, dtype=np.uint8, count=blob.size)
            data[:] = blob
            mv, job.stored = memoryview(buf), blob.size
        job.checksum = xxhash.xxh3_64_intdigest(data)
        pos = 0
        for offset, length in job.extents:
            span = round_up(length) if self.direct else length
            self._pwrite_all(mv[pos : pos + span], offset)
            self._written[offset // self.page_bytes : (offset + span - 1) // self.page_bytes + 1] = True
            pos += length
        self.counters.writes += 1
        self.counters.bytes_written += job.nbytes if job.stored is None else job.stored

    def _encode_buffer(self, size: int) -> mmap.mmap:
        """The writer thread's page-aligned buffer for encoded blocks (O_DIRECT writes from it)."""
        buf = getattr(self, "_enc_buf", None)
        if buf is None or len(buf) < size:
            buf = self._enc_buf = mmap.mmap(-1, size)
        return buf

    def _pwrite_all(self, mv: memoryview, offset: int) -> None:
        while len(mv):
            n = os.pwrite(self.fd, mv, offset)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            mv, offset = mv[n:], offset + n
