"""The disk tier's writer: one object that owns the queue of write operations, its condition and the
thread that works it off (tiers/disk.py owns the writer; nothing else touches its state).

The thread takes batches of queued operations (namespace puts, record deletes,
block writes), collapses them per key (the last operation wins), commits the
deletes, writes the data (the exact blocks in file order, those of adjacent
pages with one pwritev), fdatasyncs once, and commits the new records in one
LMDB transaction (group commit). A block stored compressed is handed to the
encoders (ENCODE_THREADS threads, at the lowest CPU priority) when it is
queued, so they work ahead of the writer; a batch writes its exact blocks and
the encoded ones whose encoding is done, then the others as the encoders finish
them (one sync and one commit for them all: a sync per block encoded cost more
than its write), until work it can do at once is queued or `sync_every_s` has
passed, and puts what is left back at the head of the queue (a batch with
nothing ready waits for an encoding, or for a write queued after it). What the
tier weighs to store a demotion exact rather than have it wait for the
encoders (tiers/disk.py `encoders_behind`): `encode_backlog` (blocks handed to
the encoders and not encoded yet) and their bytes, the exact bytes queued
ahead (`exact_bytes_ahead`), and the writer's measures of the encoders'
seconds per byte and the disk's (`encode_s_per_byte`, `write_s_per_byte`). When nothing is queued and nobody waits in
`flush`, it zero-fills the data file from the `formatted_bytes` watermark, so
that later block writes are overwrites (see tiers/disk.py, "Formatting").

What the owner's thread may call: `put`, `delete`, `put_namespace`, `prewarm`
(queue an operation), `take_finished` (the writes done since the last call),
`wait_progress` (backpressure: until a write finishes or the queue is empty),
`flush`, `wait_formatted`, `close`. The data file and the LMDB environment are
the tier's; the writer writes into them and never closes them.

Invariants: a block's record is committed only after its bytes were written
and fdatasync'd; a deletion queued before a write of the same key is committed
before that write's data (the tier's reuse of a freed slot relies on it).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import lmdb
import msgpack
import numpy as np
import xxhash

from kvstore.tiers.base import ENCODE_THREADS
from kvstore.tiers.disk_alloc import StagingPool, round_up
from kvstore.tiers.pages import contiguous_runs

log = logging.getLogger("kvstore.tiers.disk")

ENCODER_NICE = 19  # the encoders' nice value (the daemon's other threads keep theirs)
IOV_MAX = 1024  # the most buffers one pwritev is given (Linux's limit)
RUN_BYTES = 1 << 20  # blocks on adjacent pages are written (and read: tiers/disk.py) together up to this many
# bytes: enough that 4 KiB blocks cost a syscall per 256; a block this large or larger goes alone, as it did
MEASURE_WEIGHT = 0.125  # the weight of the latest block (or batch) in the writer's averaged measures
SYNC_EVERY_S = 0.05  # blocks encoded while their batch is written wait at most this long for its sync


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
    slot: object = None  # the tier's location of the block, settled by the owner once the write is done
    encode: Callable[[np.ndarray], np.ndarray] | None = None  # compress before writing (an encoder thread)
    encoded: Future | None = None  # the encoding under way: the encoded block, or what encoding raised
    stored: int | None = None  # bytes written when encoded (the extents' total)

    def view(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.nbytes)


@dataclass(frozen=True, slots=True)
class DataFile:
    """The tier's data file as the writer sees it: an open descriptor and its page geometry."""

    fd: int
    direct: bool  # O_DIRECT: writes are page-aligned, lengths rounded up to 4096
    page_bytes: int
    num_pages: int

    @property
    def capacity_bytes(self) -> int:
        return self.page_bytes * self.num_pages


@dataclass(frozen=True, slots=True)
class RecordStore:
    """The tier's LMDB environment and its three sub-databases."""

    env: lmdb.Environment
    blocks: object
    namespaces: object
    meta: object




@dataclass(slots=True)
class WriterCounters:
    writes: int = 0
    bytes_written: int = 0
    write_calls: int = 0  # pwrite/pwritev calls of block data (exact blocks of adjacent pages share one)
    fsyncs: int = 0
    batches: int = 0
    write_errors: int = 0


class DiskWriter:
    """The writer thread of one disk tier, its queue and its formatting watermark."""

    def __init__(self, data: DataFile, records: RecordStore, meta: dict, staging: StagingPool,
                 batch_bytes: int) -> None:
        """`meta`: the tier's meta record (its `formatted_bytes` is saved as formatting goes on).
        Nothing is formatted before `start_formatting`."""
        self.data, self.records, self.meta = data, records, meta
        self.staging = staging
        self.batch_bytes = batch_bytes
        self.counters = WriterCounters()
        self.delete_delay_s = 0.2  # deletions alone are gathered this long before their commit
        self.sync_every_s = SYNC_EVERY_S
        self.formatted_bytes = min(meta.get("formatted_bytes", 0), data.capacity_bytes)
        self._written: np.ndarray | None = None  # pages holding block data (the writer's, once formatting starts)
        self._zero_buf: mmap.mmap | None = None
        self._enc_buf: mmap.mmap | None = None  # the encoded block of the write in progress
        self._encoders: ThreadPoolExecutor | None = None  # made at the first block to encode
        self._encoding: deque[tuple[Future, int]] = deque()  # the owner's encodings and their blocks' sizes,
        # oldest first, done ones dropped lazily
        # What `DiskTier.encoders_behind` weighs (tiers/disk.py): the exact blocks' bytes queued or being
        # written (owner and writer, under the condition), and the measures, averaged over the last blocks
        # (None until measured): encoding seconds per block byte on one encoder thread (the encoders'), and
        # the disk's seconds per byte written (the writer's: a batch's writes and its sync, or formatting).
        self.exact_bytes_ahead = 0
        self.encode_s_per_byte: float | None = None
        self.write_s_per_byte: float | None = None
        self._ops: deque[tuple] = deque()  # ("ns", key, value) | ("del", key) | ("put", DiskWrite) | ("warm", n)
        self._inflight_puts = 0
        self._num_writes_queued = 0  # queued ops other than "del"
        self._num_ready_queued = 0  # queued ops the writer can do without waiting for an encoder
        self._flushing = 0
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._finished: list[DiskWrite] = []  # done jobs the owner has not taken yet
        self._packer = msgpack.Packer()  # the records' (used by the writer thread only)
        self._thread = threading.Thread(target=self._run, name="kvstore-disk-writer", daemon=True)
        self._thread.start()

    # -- the owner's side ---------------------------------------------------------------
    def put(self, job: DiskWrite) -> None:
        """Queue a block write; a block to encode goes to the encoders now (its staging buffer is filled)."""
        if job.encode is not None:
            job.encoded = self.encoders.submit(self._encode, job)
            job.encoded.add_done_callback(self._wake)
            self._encoding.append((job.encoded, job.nbytes))
        self._submit(("put", job))

    @property
    def encoders(self) -> ThreadPoolExecutor:
        """The encoders' threads (made at the first block to encode)."""
        if self._encoders is None:
            self._encoders = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="kvstore-disk-encode",
                                                initializer=_lower_priority)
        return self._encoders

    def _encode(self, job: DiskWrite) -> np.ndarray | Exception:
        """An encoder thread's task: `job`'s block encoded, or what encoding raised; timed into
        `encode_s_per_byte` as soon as it is done (the owner weighs it from the first block of a burst on;
        two threads may race on the average, which only loses a sample)."""
        start = time.perf_counter()
        try:
            return job.encode(job.view())  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which fails this block only
            return exc
        finally:
            self.encode_s_per_byte = _averaged(self.encode_s_per_byte, (time.perf_counter() - start) / job.nbytes)

    def _wake(self, _encoded: Future) -> None:
        with self._cv:
            self._cv.notify_all()

    @property
    def encode_backlog(self) -> int:
        """Blocks handed to the encoders and not encoded yet (owner thread)."""
        return len(self._not_encoded())

    @property
    def encode_backlog_bytes(self) -> int:
        """The bytes of those blocks (owner thread)."""
        return sum(self._not_encoded())

    def _not_encoded(self) -> list[int]:
        encoding = self._encoding
        while encoding and encoding[0][0].done():
            encoding.popleft()
        return [n for f, n in encoding if not f.done()]

    def delete(self, key: bytes) -> None:
        self._submit(("del", key))

    def put_namespace(self, key: bytes, fields: dict) -> None:
        self._submit(("ns", key, msgpack.packb(fields)))

    def prewarm(self, nbytes: int) -> None:
        """Prefault staging buffers for blocks of `nbytes`, up to the budget (after queued writes)."""
        self._submit(("warm", nbytes))

    def _submit(self, op: tuple) -> None:
        with self._cv:
            if self._closing:
                raise OSError(errno.ESHUTDOWN, "disk tier is closed")
            self._ops.append(op)
            if op[0] == "put" and op[1].encode is None:
                self.exact_bytes_ahead += op[1].nbytes
            if op[0] != "del":
                self._num_writes_queued += 1
            if _ready(op):
                self._num_ready_queued += 1
            self._cv.notify_all()

    def take_finished(self) -> list[DiskWrite]:
        """The writes finished (done or failed) since the last call."""
        with self._cv:
            finished, self._finished = self._finished, []
        return finished

    @property
    def has_finished(self) -> bool:
        """Whether writes finished since the last `take_finished`, read without the lock: a write finishing
        meanwhile is seen at the next call."""
        return bool(self._finished)

    def wait_progress(self) -> None:
        """Block until a write has finished, or nothing is queued or in flight."""
        with self._cv:
            while not self._finished and (self._ops or self._busy):
                self._cv.wait()

    @property
    def pending_writes(self) -> int:
        with self._cv:
            return sum(1 for op in self._ops if op[0] == "put") + self._inflight_puts

    def flush(self) -> None:
        """Block until every queued operation is on disk and in the index."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                while self._ops or self._busy:
                    self._cv.wait()
            finally:
                self._flushing -= 1
                self._cv.notify_all()  # the writer may resume formatting

    def wait_formatted(self) -> None:
        """Block until the whole data file has been written once (see tiers/disk.py, Formatting)."""
        with self._cv:
            while self._written is None or self.formatted_bytes < self.data.capacity_bytes or self._ops or self._busy:
                self._cv.wait()

    def start_formatting(self, used: np.ndarray) -> None:
        """The pages that hold blocks are known (`used`, a bool per page): format the others when idle."""
        with self._cv:  # (a bool a page while there is formatting left, none after: 1 GB for 10^9 pages)
            self._written = used.copy() if self.formatted_bytes < self.data.capacity_bytes else used[:0].copy()
            self._cv.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        """`predicate()` under the writer's condition, waiting up to `timeout` s for it (tests)."""
        with self._cv:
            return self._cv.wait_for(predicate, timeout=timeout)

    def close(self) -> None:
        """Finish every queued operation and stop the thread (the file and the index stay open)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        if self._encoders is not None:
            self._encoders.shutdown()

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            done: list[DiskWrite] = []
            if not batch:
                try:
                    self._format_chunk()
                except Exception as exc:  # OSError, lmdb.Error: never let the thread die
                    log.error("disk tier: formatting stopped: %s", exc)
                    self.formatted_bytes = self.data.capacity_bytes  # writes still work, only slower
            else:
                try:
                    done = self._write_batch(batch)
                except BaseException as exc:  # never let the thread die silently
                    log.exception("disk writer failed")
                    done = [op[1] for op in batch if op[0] == "put"]
                    for job in done:
                        job.error = job.error or f"{type(exc).__name__}: {exc}"
            for job in done:  # an encoder still reading the staging buffer of a block not written (replaced, failed)
                if job.encoded is not None:
                    job.encoded.result()
                    job.encoded = None
            with self._cv:
                for job in done:
                    job.done = True
                self.exact_bytes_ahead -= sum(op[1].nbytes for op in batch if op[0] == "put" and op[1].encode is None)
                self._finished.extend(done)
                self._busy = False
                self._inflight_puts = 0
                self._cv.notify_all()
            # The jobs are the owner's now. Kept here while the thread waits for the next batch, a batch
            # (up to batch_bytes of blocks) would keep its staging buffers and records alive.
            batch = done = job = None

    def _next_batch(self) -> list[tuple] | None:
        """The next batch of queued operations; [] to format a chunk; None when closed and drained."""
        with self._cv:
            # Format only when idle: not while writes are queued, nor while someone waits in flush().
            while not self._ops and not self._closing and (
                self.formatted_bytes >= self.data.capacity_bytes or self._flushing or self._written is None
            ):
                self._cv.wait()
            if not self._ops and self._closing:
                try:
                    self._save_formatted()
                except lmdb.Error as exc:
                    log.warning("disk tier: formatting progress not saved: %s", exc)
                return None
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
                if _ready(op):
                    self._num_ready_queued -= 1
                if op[0] == "put":
                    nbytes += op[1].nbytes
            self._busy = True
            self._inflight_puts = sum(1 for op in batch if op[0] == "put")
            return batch

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
        records = self.records
        if deleted or namespaces:
            with records.env.begin(write=True) as txn:
                for _, key, value in namespaces:
                    txn.put(key, value, db=records.namespaces)
                for key in deleted:
                    txn.delete(key, db=records.blocks)
        # The blocks ready to write: exact ones, then encoded ones whose encoding is done. One whose encoding
        # is not done goes back to the head of the queue: neither the disk nor the blocks written with it wait
        # for an encoder. With none ready, the batch waits for an encoding, or for queued work it can do now.
        waiting = [job for job in puts if job.encoded is not None and not job.encoded.done()]
        if waiting and len(waiting) == len(puts):
            with self._cv:
                self._cv.wait_for(lambda: self._num_ready_queued > 0 or any(job.encoded.done() for job in waiting))
        deferred = [job for job in waiting if not job.encoded.done()]
        exact = [job for job in puts if job.encoded is None]
        written = []
        encoded = [job for job in puts if job.encoded is not None and job not in deferred]
        busy = time.perf_counter()  # the writer's time on this batch's writes and sync (not its waits)
        results = [*self._write_exact(exact), *((job, self._write_job(job)) for job in encoded)]
        busy = time.perf_counter() - busy
        # Group commit of encoded blocks: the encoders finish the batch's blocks one at a time, and a sync
        # and a commit for each (a batch each) cost more than the writes of a slow disk. So the blocks
        # encoded meanwhile are written here too, and one fdatasync and one commit cover them all: until
        # none of the batch is left to encode, work the writer can do now is queued, or `sync_every_s` passed.
        sync_by = time.monotonic() + self.sync_every_s
        while deferred and not self._closing:
            with self._cv:
                self._cv.wait_for(lambda: self._num_ready_queued > 0 or any(job.encoded.done() for job in deferred),
                                  timeout=max(0.0, sync_by - time.monotonic()))
            ready = [job for job in deferred if job.encoded.done()]
            if not ready:
                break
            deferred = [job for job in deferred if job not in ready]
            start = time.perf_counter()
            results += [(job, self._write_job(job)) for job in ready]
            busy += time.perf_counter() - start
            if self._num_ready_queued or time.monotonic() >= sync_by:
                break
        for job, error in results:
            if error is None:
                written.append(job)
            else:
                self.counters.write_errors += 1
                job.error = f"write failed: {error}"
                log.error("disk tier: %s", job.error)
        if written:
            start = time.perf_counter()
            os.fdatasync(self.data.fd)
            self.counters.fsyncs += 1
            busy += time.perf_counter() - start
            wrote = sum(job.nbytes if job.stored is None else job.stored for job in written)
            self.write_s_per_byte = _averaged(self.write_s_per_byte, busy / wrote)
            pack = self._packer.pack  # (the writer thread's own: `packb` makes a Packer a call)
            with records.env.begin(write=True, db=records.blocks) as txn:
                for job in written:
                    rec = dict(job.record, e=job.extents, n=job.nbytes if job.stored is None else job.stored,
                               x=job.checksum)
                    txn.put(job.key, pack(rec))
        self.counters.batches += 1
        if deferred:  # (last: a batch that fails fails them with it)
            with self._cv:
                self._ops.extendleft(("put", job) for job in reversed(deferred))
                self._num_writes_queued += len(deferred)
                self._inflight_puts -= len(deferred)
            jobs = [job for job in jobs if job not in deferred]
        for nbytes in warm:  # after the writes: they do not wait for it
            try:
                self.staging.prewarm(nbytes)
            except (OSError, MemoryError) as exc:
                log.warning("disk tier: staging buffers not prefaulted: %s", exc)
        return jobs

    def _write_exact(self, jobs: list[DiskWrite]) -> list[tuple[DiskWrite, str | None]]:
        """Write blocks stored exact from their staging buffers, in file order, the pieces of adjacent
        pages with one `pwritev` (up to RUN_BYTES): a demotion burst fills pages in order, so small blocks
        go to the disk in large writes (one 4 KiB O_DIRECT write a block was the disk tier's limit).

        Each job with the error of its write, or None. The jobs of a batch never share a page (a freed
        block's write and the write of the block its pages went to are never in one batch: `_write_batch`
        drops the first), and blocks of one offset keep their queue order (a stable sort). An error is kept
        as its text: the exception would keep its frames, and their views of the staging buffers, alive."""
        data, pieces = self.data, []
        for job in jobs:
            mv, pos = memoryview(job.buf), 0
            for offset, length in job.extents:
                span = round_up(length) if data.direct else length
                pieces.append((offset, mv[pos : pos + span], job))
                pos += length
        pieces.sort(key=lambda piece: piece[0])
        errors: dict[DiskWrite, str] = {}
        for start, end in contiguous_runs([(p[0], len(p[1]), 1) for p in pieces], RUN_BYTES, IOV_MAX):
            offset, at = pieces[start][0], pieces[end - 1][0] + len(pieces[end - 1][1])
            for piece in pieces[start:end]:  # (hashed just before its write, as one block at a time was)
                if piece[2].checksum is None:
                    piece[2].checksum = xxhash.xxh3_64_intdigest(piece[2].view())
            try:
                self._pwrite_all([piece[1] for piece in pieces[start:end]], offset)
            except OSError as exc:  # the blocks of this write fail, not the batch
                for piece in pieces[start:end]:
                    errors.setdefault(piece[2], str(exc))
            else:
                self._mark_written(offset, at - offset)
        for job in jobs:
            if job not in errors:
                self.counters.writes += 1
                self.counters.bytes_written += job.nbytes
        return [(job, errors.get(job)) for job in jobs]

    def _write_job(self, job: DiskWrite) -> str | None:
        """Write one block stored encoded (the encoder's result); what failed, or None."""
        try:
            blob, job.encoded = job.encoded.result(), None  # type: ignore[union-attr]
            if isinstance(blob, Exception):  # this block fails, not the batch
                raise OSError(errno.EIO, f"encoding failed: {blob}")
            if blob.size != sum(n for _, n in job.extents):
                raise OSError(errno.EIO, f"encoded {blob.size} B for {sum(n for _, n in job.extents)} B of pages")
            buf = self._encode_buffer(round_up(blob.size))
            payload = np.frombuffer(buf, dtype=np.uint8, count=blob.size)
            payload[:] = blob
            mv, job.stored = memoryview(buf), blob.size
            job.checksum = xxhash.xxh3_64_intdigest(payload)
            pos, data = 0, self.data
            for offset, length in job.extents:
                span = round_up(length) if data.direct else length
                self._pwrite_all([mv[pos : pos + span]], offset)
                self._mark_written(offset, span)
                pos += length
        except OSError as exc:
            return str(exc)
        self.counters.writes += 1
        self.counters.bytes_written += job.stored
        return None

    def _mark_written(self, offset: int, nbytes: int) -> None:
        """The pages of [offset, offset + nbytes) hold block data: formatting skips them."""
        if self._written is not None:  # (always, once the tier allocates: see start_formatting)
            pb = self.data.page_bytes
            self._written[offset // pb : (offset + nbytes - 1) // pb + 1] = True

    def _encode_buffer(self, size: int) -> mmap.mmap:
        """The writer thread's page-aligned buffer for encoded blocks (O_DIRECT writes from it)."""
        if self._enc_buf is None or len(self._enc_buf) < size:
            self._enc_buf = mmap.mmap(-1, size)
        return self._enc_buf

    def _format_chunk(self, chunk_bytes: int = 8 << 20) -> None:
        """Zero-fill the next chunk past the watermark, skipping pages that hold block data."""
        pb, data = self.data.page_bytes, self.data
        start = self.formatted_bytes // pb
        end = min(data.num_pages, start + max(1, chunk_bytes // pb))
        zeros = self._zeros(chunk_bytes)
        free = np.flatnonzero(~self._written[start:end]) + start
        if free.size:
            began = time.perf_counter()
            breaks = np.flatnonzero(np.diff(free) != 1) + 1
            for run in np.split(free, breaks):
                self._pwrite_all([memoryview(zeros)[: run.size * pb]], int(run[0]) * pb)
            if free.size * pb >= 1 << 20:  # (the disk measured before any block is written: see encoders_behind)
                self.write_s_per_byte = _averaged(self.write_s_per_byte, (time.perf_counter() - began) / (free.size * pb))
        self.formatted_bytes = end * pb
        if self.formatted_bytes >= data.capacity_bytes:
            self._written = self._written[:0].copy()  # formatted: nothing left to skip
        if self.formatted_bytes >= data.capacity_bytes or self.formatted_bytes % (32 << 20) < chunk_bytes:
            self._save_formatted()

    def _save_formatted(self) -> None:
        self.meta["formatted_bytes"] = self.formatted_bytes
        records = self.records
        with records.env.begin(write=True, db=records.meta) as txn:
            txn.put(b"meta", msgpack.packb(self.meta))

    def _zeros(self, size: int) -> mmap.mmap:
        if self._zero_buf is None or len(self._zero_buf) < size:
            self._zero_buf = mmap.mmap(-1, round_up(size))
        return self._zero_buf

    def _pwrite_all(self, views: list[memoryview], offset: int) -> None:
        """Write `views` back to back from `offset`, all of them (one pwritev while it writes them all)."""
        fd = self.data.fd
        while views:
            n = os.pwrite(fd, views[0], offset) if len(views) == 1 else os.pwritev(fd, views, offset)
            self.counters.write_calls += 1
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views = views[1:]
            if n:
                views = [views[0][n:], *views[1:]]


def _averaged(average: float | None, sample: float) -> float:
    """An average over about the last `1 / MEASURE_WEIGHT` samples (exponentially weighted)."""
    return sample if average is None else average + MEASURE_WEIGHT * (sample - average)


def _ready(op: tuple) -> bool:
    """A queued operation the writer can do without waiting for an encoder (all but blocks to encode)."""
    return op[0] != "put" or op[1].encoded is None


def _lower_priority() -> None:
    """An encoder thread runs on the CPU time the daemon's loop and the writer leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENCODER_NICE)
    except OSError as exc:
        log.debug("disk tier: encoder thread priority unchanged: %s", exc)

