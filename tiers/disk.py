"""The disk tier: one preallocated data file, aligned I/O, an LMDB index.

Layout of the tier's folder:

    blocks.dat    the data file, preallocated (fallocate) to the byte budget rounded
                  down to whole pages; a block occupies ceil(nbytes / page_bytes)
                  pages, described as extents (`[offset, length]` runs) exactly like
                  the host arena; the free-page stack hands out ascending pages, so
                  a block is usually one extent and one syscall.
    owner.lock    flock'd by the owning process: one daemon per folder.
    index.lmdb/   LMDB, three sub-databases: `blocks` (key -> record), `namespaces`
                  (namespace id -> its fields), `meta` (format version, page size).

A block record holds its extents, length, xxh3_64 checksum of the payload, the
parent hash, depth, attention and the wall-clock time it reached the disk (its
last access: a disk block that is hit is promoted and leaves the disk).

Compressed blocks (`write_from(..., codec=)`, kvstore/compression.py): the pages hold the
encoded block, the record adds the block's own size (`z`) and the codec's tag
(`c`); length and checksum are those of the encoded bytes. The writer thread
encodes (the staging buffer holds the exact block, and serves it while the
write is pending); a read verifies the checksum, then `decoder` expands the
block into the reader's views in the reader thread. A record of an encoded
block is dropped at open when the tier has no decoder.

Formatting: fallocate reserves the space, but the first O_DIRECT write into an
unwritten extent costs ext4 an extent conversion (measured here: 0.55 GB/s
against 2+ GB/s for an overwrite). So the writer thread, whenever it has
nothing queued, zero-fills the file from a watermark (`formatted_bytes`, kept
in `meta`) in 8 MiB writes, skipping pages a block was written to; afterwards
every block write is an overwrite. `wait_formatted` waits for it (benchmarks).

I/O is O_DIRECT where the filesystem accepts it (probed at open: open + one
aligned read); otherwise buffered with a logged reason (`direct_reason`).
Every write comes from a page-aligned anonymous mmap (a staging buffer), at
page-aligned offsets, with lengths rounded up to 4096.

Opening reads no block record: the scan (tiers/disk_scan.py) reads them in a
thread of its own, and until it is done the tier has no free page, so nothing
is written over a block it has not read yet; `scanned` hands the blocks to the
store (kvstore/recovery.py adopts them while the daemon serves) and the tier
then knows its free pages. Records that are unusable (malformed, outside the
file, overlapping one read before) are deleted. Meanwhile `peek` reads one
block's record (a request names it); a page given back meanwhile stays taken.

Durability rule: a block is *acknowledged* (durable) exactly when its LMDB
record is committed. The writer thread commits a record only after the block's
bytes were written and the data file was fdatasync'd, and LMDB commits with
sync=True. So after a crash every record points at complete bytes, and a slot
without a record is free. A record is still trusted only after its checksum
verifies on read (lazy verification at promotion): a mismatch is a miss and the
record is removed by the caller. Deletions of records are committed before any
data of the same batch is written, so a freed slot is never rewritten while a
record still points at it. Deletions alone are gathered for up to
`delete_delay_s` before they are committed (a promotion storm would otherwise
sync the index once per block); a deletion lost in a crash only brings back a
block whose bytes are still intact in its slot (the slot was not reused, since
its reuse would have committed the deletion first).

Threads: everything but the writer (`DiskWriter`, tiers/disk_writer.py: its
own queue, condition and thread) and the reads (`read_into`, `read_many` and the
`DataFileReader` they use, tiers/disk_read.py) runs on the owner's thread
(the daemon's event loop). The writer takes batches of queued operations
(namespace puts, record deletes, block writes), collapses them per key (the
last operation wins), commits deletes, writes data, fdatasyncs once, and
commits the new records in one transaction (group commit). `read_into` and
`read_many` are blocking and run in the caller's executor threads.

Blocks on adjacent pages move together: the writer writes the exact blocks of
a batch in file order, those whose pages follow one another with one pwritev,
and a promotion reads such blocks with one preadv (`runs` groups them,
`read_many` reads a group and verifies each block on its own), up to
RUN_BYTES a call. Blocks demoted together sit on adjacent pages (the free
pages are handed out in ascending order), so small blocks (4-64 KiB) reach
the disk in large I/Os instead of one syscall each; a block of RUN_BYTES or
more still takes one call of its own.

Staging buffers are bounded (`staging_bytes`): when they are all in flight,
`stage` waits for the writer (backpressure) instead of growing without limit.

Invariants (see `check`): a page is free or owned by exactly one block;
used + free == capacity; no record outside the data file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Sequence

import lmdb
import msgpack
import numpy as np
import xxhash

from kvstore.keys import Key, key_ns, key_text
from kvstore.tiers.base import ENCODE_THREADS, BlockMeta, CompressedTally, RecoveredBlock, Tier
from kvstore.tiers.disk_alloc import ALIGN, PageAllocator, StagingPool
from kvstore.tiers.disk_read import DataFileReader, open_data_file
from kvstore.tiers.disk_scan import DiskScan
from kvstore.tiers.disk_slot import OFFSET_SHIFT, DiskSlot, checksum_of, codec_of, extents_of, settled
from kvstore.tiers.disk_writer import IOV_MAX, RUN_BYTES, DataFile, DiskWrite, DiskWriter, RecordStore
from kvstore.tiers.host import copy_segments
from kvstore.tiers.pages import adjacent_groups
from kvstore.tiers.record_scan import BAD_RECORD, map_bytes, record_key, store_key
from kvstore.tiers.recovered import Recovered

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DATA_FILE = "blocks.dat"
INDEX_DIR = "index.lmdb"
LOCK_FILE = "owner.lock"
ENCODE_BACKLOG = ENCODE_THREADS  # the encoders are behind with this many blocks not encoded: one a thread
# An exact block up to this size is hashed on the owner thread as it is staged (xxh3: ~0.3 us at 4 KiB),
# so its location is a plain int from the start: a disk of 10^7 small blocks holds no slot object a block.
# A larger one is hashed by the writer, off the event loop (its slot's 92 B are nothing beside its bytes).
HASHED_HERE_BYTES = 16 << 10
INDEX_MAP_FLOOR = 1 << 34  # the index's LMDB map at least (more for a tier of more blocks: `map_bytes`)
Location = "int | DiskSlot"  # a block's location in this tier (tiers/disk_slot.py)


@dataclass(slots=True)
class DiskCounters:
    """The owner's counts (the writer and the reader keep their own: `DiskWriter.counters`,
    `DataFileReader.counters`)."""

    recovered_records: int = 0
    dropped_records: int = 0
    backpressure_waits: int = 0


class DiskTier(Tier):
    """Owner side of the disk tier: allocation, staging, reads, the index; it owns the writer.

    As a store tier (tiers/base.py) a block's location is a plain int or a `DiskSlot`
    (tiers/disk_slot.py); `Location` below."""

    name = "disk"
    persistent = True

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        page_bytes: int = 64 * 1024,
        direct: bool | None = None,
        staging_bytes: int = 256 << 20,
        batch_bytes: int = 64 << 20,
        decoder: Callable[[np.ndarray, Sequence[np.ndarray]], bool] | None = None,
        max_blocks: int | None = None,
    ) -> None:
        """`max_blocks`: the most blocks it holds, whatever room its pages leave (None: as many as fit).
        Every block it holds is indexed in the store's memory (a few hundred bytes each), so a disk of
        small blocks can hold more than the host's memory can index: the daemon caps it (`[disk]
        max_blocks`, kvstore/chain.py) and past the cap the tier evicts as a full one does. A restart that
        finds more (the cap was lowered) keeps the newest (tiers/disk_scan.py `newest`)."""
        if page_bytes <= 0 or page_bytes % ALIGN:
            raise ValueError(f"disk page_bytes must be a positive multiple of {ALIGN}, got {page_bytes}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.path = path
        self.decoder = decoder  # expands an encoded block into host memory (kvstore/compression.py)
        self.compressed = CompressedTally()
        self._lock_fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one owner per folder, until close()
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OSError(errno.EBUSY, f"disk tier folder {path} is in use by another process") from None
        self.counters = DiskCounters()
        self.scan_s: float | None = None  # how long the scan of the index took
        self.env = lmdb.open(
            os.path.join(path, INDEX_DIR), map_size=INDEX_MAP_FLOOR, max_dbs=4, subdir=True,
            sync=True, metasync=True, lock=True,
        )
        self._db_blocks = self.env.open_db(b"blocks")
        self._db_ns = self.env.open_db(b"namespaces")
        self._db_meta = self.env.open_db(b"meta")
        self.page_bytes = self._load_meta(page_bytes)
        self.num_pages = capacity_bytes // self.page_bytes
        if self.num_pages < 1:
            raise ValueError(f"disk capacity {capacity_bytes} B is smaller than one page ({self.page_bytes} B)")
        self.capacity_bytes = self.num_pages * self.page_bytes
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"disk max_blocks must be at least 1, got {max_blocks}")
        self.max_blocks = self.num_pages if max_blocks is None else min(max_blocks, self.num_pages)
        self.blocks = 0  # allocations it holds: blocks and copies, written or being written
        if map_bytes(self.max_blocks, INDEX_MAP_FLOOR) > INDEX_MAP_FLOOR:  # (before any write: none yet)
            self.env.set_mapsize(map_bytes(self.max_blocks, INDEX_MAP_FLOOR))
        self.fd, self.direct, self.direct_reason = open_data_file(os.path.join(path, DATA_FILE), self.capacity_bytes,
                                                                  direct)
        self.reader = DataFileReader(self.fd, self.direct)  # reads and verifies blocks (any thread)
        # No free page until the records are read (`scanned`): nothing is written over a block.
        self.alloc = PageAllocator.full(self.num_pages, self.page_bytes, label="disk")
        self._scan: DiskScan | None = DiskScan(self.env, self._db_blocks, self.page_bytes, self.num_pages,
                                             DiskSlot.recovered, decodes=decoder is not None,
                                             max_blocks=self.max_blocks)
        self._over_cap = self.num_kept_records > self.max_blocks  # (the scan keeps the newest: no `peek`)
        self.staging = StagingPool(staging_bytes)
        self._failed: list[DiskWrite] = []  # failed jobs the owner has not yet collected
        # The writes of plain-int locations not yet settled, by offset: pending, or failed and not yet freed
        self._jobs: dict[int, DiskWrite] = {}
        self.writer = DiskWriter(DataFile(self.fd, self.direct, self.page_bytes, self.num_pages),
                                 RecordStore(self.env, self._db_blocks, self._db_ns, self._db_meta),
                                 self._meta, self.staging, batch_bytes)

    # -- opening ----------------------------------------------------------------
    def _load_meta(self, page_bytes: int) -> int:
        with self.env.begin(write=True, db=self._db_meta) as txn:
            raw = txn.get(b"meta")
            if raw is None:
                self._meta = {"version": FORMAT_VERSION, "page_bytes": page_bytes, "formatted_bytes": 0}
                txn.put(b"meta", msgpack.packb(self._meta))
                return page_bytes
        meta = self._meta = msgpack.unpackb(raw)
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"disk tier at {self.path} has format {meta.get('version')}, expected {FORMAT_VERSION}")
        if meta["page_bytes"] != page_bytes:
            log.warning("disk tier at %s keeps its page size %d B (asked for %d B)", self.path, meta["page_bytes"], page_bytes)
        return int(meta["page_bytes"])

    def load_namespaces(self) -> list[tuple[bytes, dict]]:
        with self.env.begin(db=self._db_ns) as txn:
            return [(bytes(k), msgpack.unpackb(v)) for k, v in txn.cursor()]

    # -- allocation (owner thread; the page bookkeeping is Tier's) -----------------
    @property
    def pages(self) -> PageAllocator:
        return self.alloc

    def allocate(self, nbytes: int):
        if self.blocks >= self.max_blocks:
            return None
        alloc = self.alloc.allocate(nbytes)
        if alloc is not None:
            self.blocks += 1
        return alloc

    def shortfall(self, nbytes: int) -> int:  # (asked once a victim while a demotion makes room: inline)
        alloc = self.alloc
        short = (alloc.pages_for(nbytes) - alloc.free_pages) * self.page_bytes
        over = self.blocks + 1 - self.max_blocks  # (a block over the cap is missing a page's worth)
        return short if over <= 0 else max(short, over * self.page_bytes)

    def batch_shortfall(self, nbytes: int, count: int) -> int:
        short = super().batch_shortfall(nbytes, count)
        over = self.blocks + count - self.max_blocks
        return short if over <= 0 else max(short, over * self.page_bytes)

    def release(self, extents: Sequence, key: bytes | None) -> None:
        """Free a block's pages and queue the removal of its record (ordered before any reuse); while the
        tier scans, the pages stay taken (the scan counts them its record's: the store frees them later)."""
        if self._scan is None:
            self.alloc.free(extents)
        self.blocks -= 1
        if key is not None:
            self.writer.delete(key)

    # -- the store's tier interface (tiers/base.py) --------------------------------
    def free(self, location: Location, key: tuple | None = None) -> None:
        if type(location) is int:
            if self._jobs:
                self._jobs.pop(location >> OFFSET_SHIFT, None)  # (its pages, the only ones at that offset, go)
        elif location.codec is not None and self._scan is None:  # (while it scans: counted at `scanned`)
            self._held_compressed(location, -1)
        self.release(extents_of(location), None if key is None else record_key(key))

    def _held_compressed(self, slot: DiskSlot, sign: int) -> None:
        self.compressed.count(slot.codec, sign, slot.logical, sum(n for _, n in slot.extents))  # type: ignore[arg-type]

    def locate(self, location: Location) -> list:
        return extents_of(location)

    def write_from(self, alloc: list, src: Sequence[np.ndarray], meta: BlockMeta, codec=None) -> Location:
        """Copy the block into a staging buffer now; the writer thread makes it durable later (encoded
        with `codec`, a kvstore.compression.StoredCodec, where given). An exact block of at most
        `HASHED_HERE_BYTES` in one extent is hashed here, as it is staged: its location is then a plain
        int from the start (tiers/disk_slot.py), and the writer does not hash it again."""
        record = {"p": meta.parent, "d": meta.depth, "a": meta.attention, "t": meta.stamp}
        nbytes = sum(s.size for s in src)
        if codec is not None:  # stored encoded: the record keeps the block's own size and the codec
            record["z"], record["c"] = nbytes, codec.tag
        job = self.stage(record_key(meta.key), record, alloc, nbytes)
        staged = job.view()
        copy_segments([staged], src)
        if codec is None and nbytes <= HASHED_HERE_BYTES and len(alloc) == 1:
            checksum = xxhash.xxh3_64_intdigest(staged)
            where = settled(alloc, checksum)
            if where is not None:
                job.checksum, job.slot = checksum, where
                self._jobs[where >> OFFSET_SHIFT] = job
                self.submit(job)
                return where
        if codec is not None:
            job.encode = codec.encode
        job.slot = slot = DiskSlot(alloc, None, job, None if codec is None else codec.tag, nbytes)
        if codec is not None:
            self._held_compressed(slot, +1)
        self.submit(job)
        return slot

    def encoders_behind(self, nbytes: int = 0) -> bool:
        """Whether a block of `nbytes` demoted now would hold the writer up if it were encoded (the store
        then stores it exact, where `[compression] exact_when_busy`). Not while an encoder thread is
        free. With every thread busy, once the writer has measured the encoders and the disk: whether
        the encoders would finish it (after what they hold) later than the writer, busy with the exact
        blocks queued ahead of it, would reach it. A disk slower than the encoders keeps them all busy
        then, and each block encoded is fewer bytes for it to write."""
        writer = self.writer
        if writer.encode_backlog < ENCODE_BACKLOG:
            return False
        encode_s, write_s = writer.encode_s_per_byte, writer.write_s_per_byte
        if encode_s is None or write_s is None:
            return True
        encoded_by = (writer.encode_backlog_bytes + nbytes) * encode_s / ENCODE_THREADS
        return encoded_by > writer.exact_bytes_ahead * write_s

    def _job(self, location: Location) -> DiskWrite | None:
        """The write of `location` not yet settled (pending, or failed), else None."""
        if type(location) is int:
            return self._jobs.get(location >> OFFSET_SHIFT) if self._jobs else None
        return location.job

    def read_blocks(self, location: Location) -> bool:
        if type(location) is not int:
            location.known_checksum()  # settle a finished write here, on the owner thread
        job = self._job(location)
        return job is None or job.done

    def read_into(self, location: Location, out: Sequence[np.ndarray]) -> bool:
        """Serve a pending block from its staging buffer (owner thread), else read and verify it."""
        job = self._job(location)
        if job is not None:
            if not job.done:
                copy_segments(out, [job.view()])
                return True
            if job.error is not None:
                raise OSError(errno.EIO, "the block's write failed: its bytes are lost")
        if type(location) is int or location.codec is None:
            return self.reader.read_block(extents_of(location), sum(o.size for o in out), checksum_of(location), out)
        stored = sum(n for _, n in location.extents)
        blob = self.reader.blob(stored)
        if not self.reader.read_block(location.extents, stored, location.checksum, [blob]):
            return False
        return self.decoder is not None and self.decoder(blob, out)  # decoded here, in the reader thread

    def stored_encoded(self, location: Location) -> int:
        """The stored size of a block whose bytes here are encoded and written (after `read_blocks` said
        so), else 0: a reader that decodes blocks itself (the GPU tier's, kvstore/gpu_decode.py) reads
        those with `read_encoded`."""
        if type(location) is int or location.codec is None or location.job is not None:
            return 0
        return sum(n for _, n in location.extents)

    def read_encoded(self, location: Location, blob: np.ndarray) -> bool:
        """(A reader thread.) An encoded block's stored bytes into `blob` (`stored_encoded` of them);
        True if they verify against the tier's checksum. The codec's own checksum is the decoder's to check."""
        return self.reader.read_block(location.extents, blob.size, location.checksum, [blob])

    def failed_writes(self) -> list[Key]:
        return [store_key(job.key) for job in self.take_failed()]

    def lost(self, location: Location) -> bool:
        job = self._job(location)
        return job is not None and job.done and job.error is not None

    def durable(self, location: Location) -> bool:
        job = self._job(location)
        return job is None or (job.done and job.error is None)

    def recover(self) -> tuple[list[tuple[str, dict]], list[RecoveredBlock]]:
        """The namespaces; the blocks come from the background scan (`scanned`)."""
        return [(k.decode(), fields) for k, fields in self.load_namespaces()], []

    @property
    def scanning(self) -> bool:
        return self._scan is not None

    @property
    def peekable(self) -> bool:
        return self._scan is not None and not self._over_cap

    def peeks(self) -> ContextManager[None]:
        return self._scan.held() if self.peekable else nullcontext()

    def peek(self, key: Key) -> tuple | None:
        """While the tier scans: `key`'s record read from the index alone, judged as the scan judges one
        (`Recovered.normal`'s fields; whether another claims its pages is the scan's to find); None where it
        has none or an unusable one. None at all where the cap was lowered (the scan keeps the newest)."""
        scan, rkey = self._scan, record_key(key)
        if not self.peekable or (raw := scan.get(rkey)) is None:
            return None
        try:
            return Recovered.normal(scan.parse(rkey, raw)[0])
        except BAD_RECORD:
            return None  # (the scan deletes it)

    @property
    def num_kept_records(self) -> int:
        with self.env.begin(db=self._db_blocks) as txn:
            return txn.stat(self._db_blocks)["entries"]

    def scanned(self, wait: bool = False) -> Recovered | list | None:
        """The blocks the scan of the index found (once; None while it runs, unless `wait`). From then on
        the tier knows its free pages: it allocates, and the writer formats what is free."""
        if self._scan is None:
            return []
        result = self._scan.result(wait)
        if result is None:
            return None
        self._scan = None
        self.alloc = result.pages
        self.blocks = len(result.blocks)
        for key in result.bad:  # (committed before any write into their pages: see the module docstring)
            self.writer.delete(key)
        self.writer.start_formatting(result.taken)
        for location in result.encoded:
            self._held_compressed(location, +1)
        self.counters.recovered_records = len(result.blocks)
        self.counters.dropped_records += len(result.bad)
        self.scan_s = result.seconds
        return result.blocks

    def persist_namespace(self, ns_id: str, fields: dict) -> None:
        self.writer.put_namespace(ns_id.encode(), fields)

    def persisted_namespaces(self) -> set[str]:
        return {k.decode() for k, _ in self.load_namespaces()}

    def check_records(self, placed: dict) -> list[str]:
        """The index against the store's disk blocks (call after `flush`: no write pending)."""
        problems = []
        records = self.index_records()
        for key, slot in placed.items():
            rec = records.pop(record_key(key), None)
            if rec is None:
                problems.append(f"disk block {key_text(key)} has no index record")
            elif rec["e"] != extents_of(slot) or rec["n"] != sum(n for _, n in extents_of(slot)):
                problems.append(f"index record of {key_text(key)} disagrees with its slot")
            elif rec["x"] != (checksum_of(slot) if type(slot) is int else slot.known_checksum()):
                problems.append(f"index checksum of {key_text(key)} disagrees with the store")
        if records:
            problems.append(f"{len(records)} index records belong to no disk block")
        for ns_id in {key_ns(key) for key in placed} - self.persisted_namespaces():
            problems.append(f"namespace {ns_id} of disk blocks is not in the index")
        return problems

    # -- writes ------------------------------------------------------------------
    def stage(self, key: bytes, record: dict, extents: list, nbytes: int) -> DiskWrite:
        """A write job with a staging buffer to fill; waits for the writer while staging is exhausted."""
        self.reap()
        while (buf := self.staging.take(nbytes)) is None:
            self.counters.backpressure_waits += 1
            self.writer.wait_progress()
            self.reap()
        return DiskWrite(key, record, extents, nbytes, buf)

    def submit(self, job: DiskWrite) -> None:
        self.writer.put(job)

    def prewarm(self, nbytes: int) -> None:
        """Have the writer prefault staging buffers for blocks of `nbytes`, up to the budget."""
        self.writer.prewarm(nbytes)

    def reap(self) -> None:
        """Recycle the staging buffers of finished writes and settle their slots (a slot keeps no job once
        its write is durable: a million disk blocks would keep a million jobs); failed ones wait in
        `take_failed`. Nothing to do (the usual case, a call a demotion) takes no lock."""
        if not self.writer.has_finished:
            return
        finished = self.writer.take_finished()
        for job in finished:
            self.staging.give(job.buf)
            if job.error is not None:
                self._failed.append(job)
                continue
            slot, job.slot = job.slot, None
            if type(slot) is int:
                if self._jobs.get(slot >> OFFSET_SHIFT) is job:
                    del self._jobs[slot >> OFFSET_SHIFT]
            elif isinstance(slot, DiskSlot) and slot.job is job:
                slot.checksum, slot.job = job.checksum, None
        if finished and not self.writer.pending_writes:
            self.staging.shrink()  # the burst is written: its idle buffers go back to the system

    def take_failed(self) -> list[DiskWrite]:
        """Writes that failed since the last call (their bytes are lost; the owner drops the blocks)."""
        self.reap()
        failed, self._failed = self._failed, []
        return failed

    @property
    def pending_writes(self) -> int:
        return self.writer.pending_writes

    @property
    def formatted_bytes(self) -> int:
        return self.writer.formatted_bytes

    def wait_formatted(self) -> None:
        """Block until the whole data file has been written once (see Formatting)."""
        self.writer.wait_formatted()

    def flush(self) -> None:
        """Block until every queued operation is on disk and in the index."""
        self.writer.flush()

    # -- reads (any thread) -----------------------------------------------------
    def runs(self, locations: Sequence[Location]) -> list[list[int]]:
        """The positions of `locations` grouped for `read_many` (a reader thread's task each): in file order,
        blocks on adjacent pages together up to RUN_BYTES, an encoded block alone."""
        apart = [codec_of(loc) is not None for loc in locations]
        return adjacent_groups([extents_of(loc) for loc in locations], RUN_BYTES, apart)

    def read_many(self, reads: Sequence[tuple[Location, Sequence[np.ndarray]]]) -> list[bool | None]:
        """`read_into` of several written blocks (a reader thread; the owner settled them: `read_blocks`):
        the exact blocks whose extents follow one another in the data file are read with one preadv
        (small blocks demoted together sit on adjacent pages; one 4 KiB read a block was the limit of a
        promotion of small blocks), each verified on its own (`DataFileReader.read_together`). Per block:
        True, False (its bytes do not verify) or None (its read failed)."""
        results: list[bool | None] = [None] * len(reads)
        together, at = [], []  # the exact blocks read together (`read_together`'s), their positions
        for i, (slot, dst) in enumerate(reads):
            exact = type(slot) is int or (slot.codec is None and slot.job is None)
            extents = extents_of(slot)
            views = self.reader.direct_views(extents, dst) if exact else None
            if views is None or max(map(len, views)) > IOV_MAX // 2:
                # encoded, where O_DIRECT cannot read into, or in so many pieces of host memory that one
                # extent takes several calls (`read_block` splits them): on its own
                results[i] = super().read_many([(slot, dst)])[0]
                continue
            together.append((extents, views, dst, checksum_of(slot)))
            at.append(i)
        for i, ok in zip(at, self.reader.read_together(together)):
            results[i] = ok
        return results

    # -- the index, for checks --------------------------------------------------
    def index_records(self) -> dict[bytes, dict]:
        with self.env.begin(db=self._db_blocks) as txn:
            return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}

    def check(self, locations: Iterable) -> list[str]:
        """Pages against the live locations (the tier's, or extents), budget, data file size."""
        locations = list(locations)
        problems = self.alloc.check(extents_of(loc) if type(loc) is int or isinstance(loc, DiskSlot) else loc
                                    for loc in locations)
        if self.blocks != len(locations):
            problems.append(f"disk tier counts {self.blocks} blocks, the store holds {len(locations)}")
        if self.used_bytes > self.capacity_bytes:
            problems.append("disk tier over budget")
        if os.fstat(self.fd).st_size > self.capacity_bytes:
            problems.append("disk data file is larger than the budget")
        return problems

    def stats(self) -> dict:
        c, w, r = self.counters, self.writer.counters, self.reader.counters
        return {
            "path": self.path,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "page_bytes": self.page_bytes,
            "held_blocks": self.blocks,  # (blocks, copies and blocks being written: what max_blocks caps)
            "max_blocks": self.max_blocks,
            "direct_io": self.direct,
            "direct_io_fallback_reason": self.direct_reason,
            "pending_writes": self.pending_writes,
            "formatted_bytes": self.formatted_bytes,
            "staging_bytes": self.staging.used_bytes,
            "staging_held_bytes": self.staging.held_bytes,  # in use and idle (prefaulted: resident)
            "bytes_written": w.bytes_written,
            "bytes_read": r.bytes_read,
            "writes": w.writes,
            "reads": r.reads,
            "read_calls": r.read_calls,
            "write_calls": w.write_calls,
            "fsyncs": w.fsyncs,
            "write_errors": w.write_errors,
            "backpressure_waits": c.backpressure_waits,
            "recovered_records": c.recovered_records,
            "scanning": self._scan is not None,
            "scan_s": self.scan_s,
            "dropped_records": c.dropped_records,
            "compressed": self.compressed.stats(),
        }

    def close(self) -> None:
        """Finish every queued write, stop the writer, close the index and the file."""
        if self._scan is not None:
            self._scan.stop()
        self.writer.close()
        self.reap()
        self.env.close()
        os.close(self.fd)
        os.close(self._lock_fd)
