"""The host tier's placement index: which committed block sits on which arena pages, kept beside the arena.

The arena file outlives the daemon in /dev/shm; this index outlives it with it,
so a restart (kill -9, SIGTERM, an upgrade) re-adopts the committed blocks
instead of starting empty. It is an LMDB environment in a private folder next
to the arena (`<arena>.index/`, 0700: nobody else can plant files in it), on
the same tmpfs, so arena and index share their fate (a reboot clears both).
LMDB commits without fsync here: tmpfs has nothing to sync to, and a commit
survives the death of the process that made it. It writes through its map
(`writemap`: no copy of each dirty page out of LMDB's buffers at commit, ~2.5 us
less per block written into a full tier); the data file is then as long as the
map size but sparse, holding only the pages written.

Sub-databases: `meta` (format version, geometry, the arena file's inode),
`namespaces` (id -> fields), `blocks` (msgpack [namespace id, hash] -> record
{e: extents, n: length, p: parent hash, d: depth, a: attention, t: wall-clock
time it reached the tier, x: xxh3_64 of its bytes, or None until taken}).

Who writes (one LMDB environment, every write transaction under `_lock`):
- The owner's thread writes what it makes: the records of committed blocks
  (`record`), their deletions (`forget`), namespaces, and `settle`/`flush`.
  On an asyncio loop, everything a turn of the loop recorded or forgot is
  written in one transaction when that turn ends (packing and putting a
  record costs the loop ~2.6 us; one transaction per turn keeps the commits
  few); a caller that runs no loop (a store used in process, the daemon's
  close in an executor thread) writes each record or deletion at once.
- The `kvstore-host-index` thread writes only the checksums the
  `kvstore-host-hash` thread computes: the hasher runs at nice 19 and must
  never hold the lock the loop waits for.

Rules that make an adopted block safe to serve:
- A record is written only after its block committed (the client copied the
  bytes in before it sent `commit`), so a reserved, never committed block (a
  put cut short by the kill: a torn block) has no record and its pages are
  free at the next start. A kill -9 loses the records of the loop's current
  turn (`pending` until it ends): blocks whose commit was answered in the
  microseconds before the kill are misses after the restart, never wrong.
- A record is deleted before its pages are handed out again: `forget` queues
  the deletion (written with the turn, or at once), and the arena's
  `allocate` commits what is still queued first (`settle`), so no record ever
  points at pages that hold another block. A reserve, which writes nothing
  into its pages before its reply, settles once at its end instead
  (tiers/host.py `settling_once`): one transaction for a batch whose room was
  made block by block, not one a block.
- The checksum is added to the record later, by the hasher, once no block has
  been committed, freed or acquired for `QUIET_S` (or the oldest unchecked
  record is `CHECK_LAG_S` old): hashing reads every byte, and on a
  memory-bound host it would slow the puts and gets it ran beside. A block the
  remote publisher sends gets the xxh3 the publisher took of it, pinned, for
  its header (`offer_checksum`), and is not read again; publishing counts as
  busy meanwhile. A clean stop checks every block first (`flush`).
- Serve first, verify as you go: at adoption every record is checked (extents
  inside the arena, no overlap, length) but no byte is read, and the records
  are read in a thread of their own (tiers/host_scan.py, handed over by
  `adopt`), so a restart serves at once whatever the arena's size. A record with a checksum is
  *unverified* until its bytes are hashed and compared: by the owner's thread
  before the block's bytes are first read (`verify`: a client's acquire, a
  demotion, a copy to another tier), or by the hasher in the background (at
  nice 19, while the store is quiet or once the adoption is `CHECK_LAG_S`
  old). A block that fails is answered False by `verify` and listed by
  `altered` until it leaves the tier; the store discards it either way (once
  it is adopted, if the hasher got to it first), so it is a miss, never
  served. A record without a checksum (a kill -9 before the store was quiet)
  is adopted on the two rules above, and checked in the background like a new
  one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import lmdb
import msgpack
import numpy as np
import xxhash

from kvstore.tiers.host_folder import private_dir
from kvstore.tiers.record_scan import describe, map_bytes, record_key

if TYPE_CHECKING:
    from kvstore.tiers.host_scan import HostScanResult

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_BYTES = 16 << 20  # hashed per batch at most: the hasher re-checks that the store is quiet between batches
QUIET_S = 0.1  # the store has committed, freed and acquired nothing for this long: checksums may be taken
CHECK_LAG_S = 10.0  # ... or the oldest record without one is this old (a store that is never quiet)
VERIFY_CHUNK = 64  # adopted blocks the hasher takes from the unverified ones at a time
COMMIT_RECORDS = 256  # checksummed records the index thread writes in one transaction, under the lock
# Blocks hashed between two yields of the GIL: a checksum lets it go and the hasher took it back at once,
# so the loop waited a switch interval at each of its LMDB calls (tools/bench/bench_gil.py).
HASH_YIELD_EVERY = 16
MAP_FLOOR = 1 << 32  # the index's LMDB map at least (more for an arena of more pages: `map_bytes`)


_PACKER = msgpack.Packer()  # `pack` holds the GIL from start to end: one Packer serves every thread


def checksum(arena: np.ndarray, extents: Iterable) -> int:
    h = xxhash.xxh3_64()
    for offset, length in extents:
        h.update(arena[offset : offset + length])
    return h.intdigest()


@dataclass(slots=True, eq=False)
class _Unverified:
    """An adopted block whose bytes have not been compared with its recorded checksum yet."""

    extents: list
    nbytes: int
    checksum: int


@dataclass(slots=True, eq=False)
class _Pending:
    """A block committed in the arena whose record is not written, or has no checksum yet."""

    key: tuple  # (namespace id, hash): packed when the record is written, not at `record`
    extents: list
    nbytes: int
    meta: tuple  # (parent, depth, attention, stamp)
    since: float = 0.0  # monotonic time its record was written
    hashing: bool = False


class HostIndex:
    """The LMDB placement index of one arena, and the threads that write it."""

    def __init__(self, path: str, arena: np.ndarray, geometry: dict,
                 unmap: Callable[[Iterable], None] | None = None) -> None:
        """Open the index at `path`, creating it if absent. `geometry` (capacity, page size, the arena
        file's inode) must equal what the index recorded, else ValueError (the caller starts empty).
        `unmap(extents)`: drop the process's mapping of pages it hashed (their bytes stay in the arena):
        what a process maps it unmaps at exit, page by page, which would make a stop as slow as the
        arena is large."""
        self.path = path
        self.arena = arena
        self._unmap = unmap or (lambda extents: None)
        private_dir(path)
        self.env = lmdb.open(path, map_size=map_bytes(geometry["capacity_bytes"] // geometry["page_bytes"], MAP_FLOOR),
                             max_dbs=4, subdir=True, sync=False, metasync=False, lock=True, writemap=True)
        try:
            self.blocks_db = self.env.open_db(b"blocks")
            self._db_ns = self.env.open_db(b"namespaces")
            self._db_meta = self.env.open_db(b"meta")
            self._check_meta({"version": FORMAT_VERSION, **geometry})
        except BaseException:
            self.env.close()
            raise
        self._lock = threading.Lock()  # the state below, and every write transaction; never held by the hasher
        self._pending: dict[tuple, _Pending] = {}  # committed, record not yet written (insertion order)
        self._recorded: dict[tuple, bytes] = {}  # key -> its record key, for the keys with a record
        self._unchecked: dict[tuple, _Pending] = {}  # recorded without a checksum (oldest first)
        self._deletes: list[bytes] = []  # record keys to delete before their pages are reused
        # Adopted blocks not verified yet (filled by `adopt` only). The owner's `verify` and `forget` and the
        # hasher take items out with `pop`, atomic under the GIL: whoever pops an item decides it.
        self._unverified: dict[tuple, _Unverified] = {}
        # key -> extents of the blocks the hasher found altered, until the block leaves the tier (`forget`):
        # `altered` lists them, `verify` answers False for them (a block not adopted yet when the
        # store first heard of it is caught when it is).
        self._altered: dict[tuple, list] = {}
        self._early: dict[tuple, list] = {}  # key -> extents of the blocks adopted before `adopt` (`early`)
        # Held while a verification's verdict is recorded (a block leaves `_unverified` and, if altered,
        # enters `_altered` at once): a reader never sees an altered block in neither.
        self._verdict = threading.Lock()
        self._adopted_at = 0.0  # monotonic time of `adopt`
        self.verified_blocks = 0
        self.corrupt_blocks = 0
        self._active_at = 0.0  # monotonic time of the last record or forget (the store is busy)
        # For the index thread: batches of [(item, checksum)] from the hasher; `_index_wake` set after.
        self._sums: deque = deque()
        self._turn: list[_Pending] | None = None  # new records to write when the loop's turn ends (scheduled)
        self._turn_thread = 0  # the thread of the loop whose turn that is
        self._index_wake = threading.Event()
        self._hash_wake = threading.Event()
        self._stopped = threading.Event()
        self._closing = False
        self.records_written = 0
        self.checksums_written = 0
        self.checksums_offered = 0  # of them, taken by a reader that hashed the block anyway (not the hasher)
        self.adopted_unchecked = 0
        self._hasher = threading.Thread(target=self._hash_loop, name="kvstore-host-hash", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-host-index", daemon=True)
        self._hasher.start()
        self._writer.start()

    def _check_meta(self, want: dict) -> None:
        with self.env.begin(write=True, db=self._db_meta) as txn:
            raw = txn.get(b"meta")
            if raw is None:
                if txn.stat(self.blocks_db)["entries"]:
                    raise ValueError("the index has records but no geometry")
                txn.put(b"meta", msgpack.packb(want))
                return
        have = msgpack.unpackb(raw)
        if have != want:
            diff = ", ".join(f"{k} {have.get(k)} -> {v}" for k, v in want.items() if have.get(k) != v)
            raise ValueError(f"the arena does not match the configuration or its index ({diff})")

    # -- re-adopting (at open: the records are read in the background, `HostScan`) ---------
    def num_records(self) -> int:
        with self.env.begin(db=self.blocks_db) as txn:
            return txn.stat(self.blocks_db)["entries"]

    def namespaces(self) -> list[tuple[str, dict]]:
        with self.env.begin(db=self._db_ns) as txn:
            return [(bytes(k).decode(), msgpack.unpackb(v)) for k, v in txn.cursor()]

    def adopt(self, result: HostScanResult) -> None:
        """Take over the records a scan (tiers/host_scan.py) kept (unverified, or unchecked where they have
        no checksum) and delete the others. The owner's thread, before the arena hands out a page: a bad
        record's pages are free, so its deletion is committed first."""
        if result.bad:
            with self._lock, self.env.begin(write=True, db=self.blocks_db) as txn:
                for rkey in result.bad:
                    txn.delete(rkey)
            log.warning("host tier: dropped %d of %d records of the re-adopted arena: %s", len(result.bad),
                        len(result.bad) + len(result.blocks),
                        describe(result.reasons))
        early, self._early = self._early, {}
        for key, extents in early.items():
            result.unverified.pop(key, None)  # (one adopted early was verified, or is in `_unverified` still)
            if key not in result.recorded:  # the scan did not keep its record: the store forgets the block
                with self._lock:
                    self._recorded.pop(key, None)
                self._unverified.pop(key, None)
            elif key in self._recorded:  # still in the arena, at `extents` (that very list)
                if (item := result.unchecked.get(key)) is not None:
                    item.extents = extents
                del result.recorded[key]  # (keyed by the index's key object below, not the scan's: 57 B)
            else:  # it left while the scan ran (its record's deletion queued); its pages: the store's to free
                result.recorded.pop(key, None)
                result.unchecked.pop(key, None)
        with self._lock:
            # (nothing is written into a tier still scanning: these are the blocks adopted early)
            result.recorded.update(self._recorded)
            self._recorded = result.recorded
            self._unchecked = {**result.unchecked, **self._unchecked}
        result.unverified.update(self._unverified)
        self._unverified = result.unverified
        self._adopted_at = time.monotonic()
        self.adopted_unchecked = len(result.unchecked)
        if result.unchecked:
            log.info("host tier: %d re-adopted blocks had no checksum yet (killed before the store was quiet): "
                     "adopted on their commit records, checked in the background", len(result.unchecked))
        if self._unchecked or self._unverified:
            self._hash_wake.set()

    def early(self, key: tuple, rkey: bytes, extents: list, nbytes: int, checksum: int | None) -> None:
        """While the records are read (before `adopt`): the store adopted `key`'s block at `extents` (that
        very list) from its record `rkey`, read on its own. It is verified before its first read (or by the
        hasher) against `checksum`; one without a checksum is checked once the scan's records are adopted,
        as theirs are. `forget` deletes its record; `adopt` keeps what became of it."""
        with self._lock:
            self._recorded[key] = rkey
            self._early[key] = extents
        if checksum is not None:
            self._unverified[key] = _Unverified(extents, nbytes, checksum)

    def put_namespace(self, ns_id: str, fields: dict) -> None:
        with self._lock, self.env.begin(write=True, db=self._db_ns) as txn:
            txn.put(ns_id.encode(), msgpack.packb(fields))

    # -- the owner's thread ---------------------------------------------------------
    def record(self, key: tuple, extents: list, nbytes: int, meta: tuple) -> None:
        """A block committed at `extents`; `meta` = (parent, depth, attention, stamp). Its record is
        written shortly, its checksum once the store is quiet."""
        self._add([_Pending(key, extents, nbytes, meta)])

    def record_many(self, blocks: Sequence[tuple[list, Any]]) -> None:
        """`record` for several blocks (one commit), in order: (extents, meta) where meta is a
        kvstore.tiers.base.BlockMeta (key, parent, depth, attention, stamp)."""
        self._add([_Pending(m[0], x, x[0][1] if len(x) == 1 else sum(n for _, n in x), m[1:]) for x, m in blocks])

    def _add(self, items: list[_Pending]) -> None:
        pending, unchecked = self._pending, self._unchecked
        with self._lock:
            for item in items:
                key = item.key
                pending.pop(key, None)  # (re-inserted: a new record replaces one not yet written)
                unchecked.pop(key, None)
                pending[key] = item
        self._queue(items)

    def offer_checksum(self, key: tuple, extents: list, x: int) -> None:
        """The xxh3_64 of a committed block's bytes at `extents` (that very list), taken while it was pinned
        by a reader that hashed them anyway (the remote publisher): written like the hasher's, which then
        skips the block. Ignored unless the block's record is written and waits for its checksum."""
        item = self._unchecked.get(key)
        if item is not None and item.extents is extents and not item.hashing:
            item.hashing = True
            self.checksums_offered += 1
            self._sums.append([(item, x)])
            self._index_wake.set()

    def forget(self, key: tuple) -> None:
        """The block leaves the tier: drop its pending record, or queue its record's deletion
        (committed at the end of the turn, and by `settle` before its pages are allocated again)."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                return
            rkey = self._recorded.pop(key, None)
            if rkey is None:
                return  # never committed here (an aborted reservation)
            self._unchecked.pop(key, None)
            self._unverified.pop(key, None)  # (before its pages can be reused: see `_verify_some`)
            self._altered.pop(key, None)
            self._deletes.append(rkey)
        if self._turn is not None and threading.get_ident() == self._turn_thread:
            return  # written with this turn (`_queue`'s first case, inline: one forget per evicted block)
        self._queue(None)  # committed promptly: a removed block must not come back after a kill

    def _queue(self, items: list[_Pending] | None) -> None:
        """Have new records (`items`) or the queued deletions (None) written by the calling thread:
        when the turn of the loop it runs ends (one transaction for all that turn recorded or
        forgot), or at once where it runs no loop. The store counts as busy from now to the write
        (no checksums meanwhile: `_busy_for`)."""
        if self._turn is not None and threading.get_ident() == self._turn_thread:  # the turn's next block
            if items is not None:
                self._turn.extend(items)
            return
        self._active_at = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self._turn is not None:  # no loop here, or the turn open is another loop's
            new = [] if items is None else [(m, record_key(m.key), _pack(m, None), False) for m in items]
            with self._lock:
                if not self._closing:  # else `close` writes what is pending
                    self._commit(new, [])
            return
        self._turn, self._turn_thread = [] if items is None else list(items), threading.get_ident()
        loop.call_soon(self._write_turn)

    def _write_turn(self) -> None:
        """The end of a loop turn: write its new records and deletions, one transaction."""
        items, self._turn = self._turn or [], None
        self._active_at = time.monotonic()
        new = [(m, record_key(m.key), _pack(m, None), False) for m in items]  # packed before the lock
        with self._lock:
            if not self._closing:  # else `close` writes what is pending (or, unlinking, drops it)
                self._commit(new, [])

    def busy(self) -> None:
        """Clients are reading: no checksums for QUIET_S (a plain store, no lock: a float is atomic)."""
        self._active_at = time.monotonic()

    @property
    def has_deletes(self) -> bool:
        return bool(self._deletes)

    def settle(self) -> None:
        """Commit the queued deletions now: the freed pages may be reused after this."""
        with self._lock:
            self._commit([], [])

    def pending(self, extents: list) -> bool:
        """Whether the block at `extents` (that very list) waits for its record (only this turn's do)."""
        return any(item.extents is extents for item in list(self._pending.values()))

    @property
    def has_unverified(self) -> bool:
        """Some adopted block is not verified yet, or was found altered and is still in the tier."""
        return bool(self._unverified or self._altered)

    @property
    def num_unverified(self) -> int:
        return len(self._unverified)

    def verify(self, key: tuple, extents: list) -> bool:
        """Before the bytes of the block `key` at `extents` (that very list) are first read: False when
        it is an adopted block whose bytes do not match its recorded checksum (the caller discards it)."""
        item = self._unverified.get(key)
        if item is None or item.extents is not extents:
            return self._altered.get(key) is not extents
        ok = self._hash(extents) == item.checksum
        with self._verdict:
            if self._unverified.pop(key, None) is item:
                self._verified(ok)
                if not ok:
                    self._altered[key] = extents
                return ok
        return self._altered.get(key) is not extents  # the hasher decided it meanwhile

    def _verified(self, ok: bool) -> None:
        if ok:
            self.verified_blocks += 1
        else:
            self.corrupt_blocks += 1

    def altered(self) -> list[tuple[tuple, list]]:
        """(key, extents) of the adopted blocks found altered that are still in the tier (each until the
        store discards it; one not adopted yet stays listed until it is, or until its record is released)."""
        if not self._altered:  # (the usual answer, asked at every request: no lock taken for it)
            return []
        with self._verdict:
            return list(self._altered.items())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_unchecked(self) -> int:
        return len(self._unchecked)

    # -- the index thread: checksums ------------------------------------------------------
    def _write_loop(self) -> None:
        """The checksums the hasher handed over, COMMIT_RECORDS a transaction; records packed before the
        lock is taken, yielding the GIL every few: the loop waits for one short transaction at most (a
        batch's 4,096 in one held the lock, and the loop's next `forget`, 406 ms at 10^7 blocks)."""
        _name_native_thread("kvstore-index")
        while True:
            self._index_wake.wait()
            self._index_wake.clear()  # before draining: what is appended from now on sets it again
            sums = []
            while True:
                try:
                    batch = self._sums.popleft()
                except IndexError:
                    break
                for i, (item, x) in enumerate(batch):
                    sums.append((item, record_key(item.key), _pack(item, x)))
                    if i % 16 == 15:
                        time.sleep(0)
            for at in range(0, max(len(sums), 1), COMMIT_RECORDS):  # (one short transaction at a time)
                with self._lock:
                    if self._closing:
                        return
                    self._commit([], sums[at : at + COMMIT_RECORDS])
                time.sleep(0)

    def _commit(self, new: list, sums: list) -> None:
        """Under `_lock`: write the new records still pending and the checksums of records still
        unchecked (a block freed meanwhile has neither), delete the queued ones, one transaction.
        `new`: [(item, record key, packed record, whether it holds the checksum)]; `sums`: [(item,
        record key, packed record with the checksum)]."""
        sums = list({id(r[0]): r for r in sums if self._unchecked.get(r[0].key) is r[0]}.values())  # (one each)
        # A checked new record (`flush`) whose unchecked version the index thread wrote meanwhile is a checksum.
        sums += [r[:3] for r in new if r[3] and self._unchecked.get(r[0].key) is r[0]]
        new = [r for r in new if self._pending.get(r[0].key) is r[0]]
        if not new and not sums and not self._deletes:
            return
        with self.env.begin(write=True, db=self.blocks_db) as txn:
            for rkey in self._deletes:
                txn.delete(rkey)
            if new or sums:
                txn.cursor().putmulti([(r[1], r[2]) for r in new + sums])
        self._deletes.clear()
        now = time.monotonic()
        for item, rkey, _, checked in new:
            del self._pending[item.key]
            self._recorded[item.key] = rkey
            if not checked:
                item.since = now
                self._unchecked[item.key] = item
        for item, _, _ in sums:
            del self._unchecked[item.key]
        self.records_written += len(new)
        self.checksums_written += len(sums) + sum(1 for r in new if r[3])
        if self._unchecked:
            self._hash_wake.set()

    # -- the hash thread: checksums -----------------------------------------------------------
    def _hash_loop(self) -> None:
        """Checksums of recorded blocks, at the lowest CPU priority and only while the store is quiet.
        Takes no lock the loop waits for: it reads the blocks' pages and hands results on."""
        _name_native_thread("kvstore-hash")
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while not self._closing:
            self._hash_wake.wait()
            wait = self._busy_for()
            if wait > 0:
                self._stopped.wait(min(wait, 1.0))  # `close` wakes it
                continue
            batch, size = [], self._verify_some()
            for item in list(self._unchecked.values()):  # a snapshot (one C-level copy, under the GIL)
                if item.hashing:
                    continue
                if size >= BATCH_BYTES or self._busy_for() > 0 or self._closing:
                    break
                # A block freed meanwhile leaves `_unchecked` first, and its pages are reused only after:
                # the checksum of one still there is of its own bytes (re-checked when written).
                if self._unchecked.get(item.key) is item:
                    item.hashing = True
                    batch.append((item, self._hash(item.extents)))
                    if len(batch) % HASH_YIELD_EVERY == 0:
                        time.sleep(0)
                    size += item.nbytes
                    if size >= BATCH_BYTES:
                        break
            if batch:
                self._sums.append(batch)
                self._index_wake.set()
            elif not self._unverified and not any(not i.hashing for i in list(self._unchecked.values())):
                self._hash_wake.clear()
                if any(not i.hashing for i in list(self._unchecked.values())):
                    self._hash_wake.set()  # one arrived meanwhile

    def _verify_some(self) -> int:
        """Compare adopted blocks with their recorded checksums, up to BATCH_BYTES, while the store stays
        quiet; returns the bytes read. A block freed meanwhile was popped by `forget` before its pages
        could be reused, so a pop that succeeds after the hash means the hash is of the block's own bytes."""
        size = 0
        while size < BATCH_BYTES and not self._closing:
            # The oldest few (one C-level copy, under the GIL): a copy of all of them per batch would cost
            # the square of an arena's blocks (seconds of the GIL at 10^5).
            some = list(itertools.islice(self._unverified.items(), VERIFY_CHUNK))
            if not some:
                break
            for i, (key, item) in enumerate(some):
                if self._busy_for() > 0 or self._closing:
                    return size
                if i % HASH_YIELD_EVERY == HASH_YIELD_EVERY - 1:
                    time.sleep(0)
                ok = self._hash(item.extents) == item.checksum
                with self._verdict:
                    if self._unverified.pop(key, None) is item:
                        self._verified(ok)
                        if not ok:
                            self._altered[key] = item.extents
                size += item.nbytes
                if size >= BATCH_BYTES:
                    break
        return size

    def _hash(self, extents: list) -> int:
        """The xxh3_64 of a block's bytes; its pages are unmapped from this process afterwards."""
        x = checksum(self.arena, extents)
        self._unmap(extents)
        return x

    def _busy_for(self) -> float:
        """Seconds to wait before hashing: 0 once the store is quiet, or the oldest unchecked record is old."""
        quiet_in = self._active_at + QUIET_S - time.monotonic()
        if quiet_in <= 0 or (self._unverified and time.monotonic() - self._adopted_at >= CHECK_LAG_S):
            return 0.0
        try:
            oldest = next(iter(self._unchecked.values()))
        except (StopIteration, RuntimeError):
            return quiet_in
        return 0.0 if time.monotonic() - oldest.since >= CHECK_LAG_S else quiet_in

    def flush(self) -> None:
        """Write every pending record and checksum now, hashing on the caller's thread."""
        with self._lock:
            pending, unchecked = list(self._pending.values()), list(self._unchecked.values())
        new = [(item, record_key(item.key), _pack(item, self._hash(item.extents)), True) for item in pending]
        sums = [(item, record_key(item.key), _pack(item, self._hash(item.extents))) for item in unchecked]
        with self._lock:
            self._commit(new, sums)

    def records(self) -> dict[bytes, dict]:
        with self.env.begin(db=self.blocks_db) as txn:
            return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}

    def close(self, flush: bool = True) -> None:
        """Stop the threads; with `flush`, write what is pending first (a clean stop keeps, and has
        checked, every block)."""
        self._closing = True
        self._stopped.set()
        self._hash_wake.set()
        self._index_wake.set()
        self._hasher.join()
        self._writer.join()
        if flush:
            self.flush()
        self.env.close()
        self.arena = None  # no view of the arena outlives the close: its mapping can go


def _name_native_thread(name: str) -> None:
    """The name `top -H` and /proc/<pid>/task/*/comm show (Python's thread names stay in Python)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _pack(item: _Pending, x: int | None) -> bytes:
    parent, depth, attention, stamp = item.meta
    return _PACKER.pack({"e": item.extents, "n": item.nbytes, "p": parent, "d": depth, "a": attention, "t": stamp,
                         "x": x})
