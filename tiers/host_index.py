"""The host tier's placement index: which committed block sits on which arena pages, kept beside the arena.

The arena file outlives the daemon in /dev/shm; this index outlives it with it,
so a restart (kill -9, SIGTERM, an upgrade) re-adopts the committed blocks
instead of starting empty. It is an LMDB environment in a private folder next
to the arena (`<arena>.index/`, 0700: nobody else can plant files in it), on
the same tmpfs, so arena and index share their fate (a reboot clears both).
LMDB commits without fsync here: tmpfs has nothing to sync to, and a commit
survives the death of the process that made it.

Sub-databases: `meta` (format version, geometry, the arena file's inode),
`namespaces` (id -> fields), `blocks` (msgpack [namespace id, hash] -> record
{e: extents, n: length, p: parent hash, d: depth, a: attention, t: wall-clock
time it reached the tier, x: xxh3_64 of its bytes}).

Rules that make an adopted block safe to serve:
- A record is written only after its block committed (the client copied the
  bytes in before it sent `commit`), so a reserved, never committed block has
  no record and its pages are free at the next start.
- Its checksum is taken then, off the event loop, by a thread at the lowest
  CPU priority (nice 19: the copies of a put storm keep the CPU); records are
  written in batches, one LMDB transaction per batch.
  A block freed before its record was written is simply never recorded. So a
  committed block is *durable here* a little after its commit (`pending`).
- A record is deleted before its pages are handed out again: `forget` queues
  the deletion, the index thread commits it soon after, and the arena's
  `allocate` commits what is still queued first (`settle`), so no record ever
  points at pages that hold another block.
- At adoption each record is checked (extents inside the arena, no overlap,
  length) and its checksum verified against the bytes: a torn or altered block
  is dropped, never served.

Threads: `record`, `forget`, `settle` run on the owner's thread (the event
loop). The `kvstore-host-hash` thread (nice 19) checksums committed blocks and
hands them to the `kvstore-host-index` thread (normal priority), which writes
them. `_lock` orders every write transaction and the pending/recorded state;
the hasher never takes it, so the loop never waits behind a preempted
low-priority thread.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import lmdb
import msgpack
import numpy as np
import xxhash

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_BYTES = 16 << 20  # hashed per batch at most: bounds a transaction, and the loop's wait for it


class IndexRefused(PermissionError):
    """The index folder is another user's, or a symbolic link: neither used nor removed."""


def index_path(arena_path: str) -> str:
    return arena_path + ".index"


def record_key(key: tuple) -> bytes:
    return msgpack.packb([key[0], key[1]])


def checksum(arena: np.ndarray, extents: Iterable) -> int:
    h = xxhash.xxh3_64()
    for offset, length in extents:
        h.update(arena[offset : offset + length])
    return h.intdigest()


@dataclass(slots=True, eq=False)
class _Pending:
    key: tuple  # (namespace id, hash): packed by the writer thread, not on the loop
    extents: list
    nbytes: int
    meta: tuple  # (parent, depth, attention, stamp)


def remove_index(path: str) -> None:
    """Remove an index folder of ours (a stale one, or one that does not match its arena)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid() or stat.S_ISLNK(st.st_mode):
        raise IndexRefused(f"the host index path {path} belongs to uid {st.st_uid} or is a symbolic link: "
                           f"refusing to use or remove it (remove it yourself, or set host.shm_path)")
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class HostIndex:
    """The LMDB placement index of one arena, and the threads that write it."""

    def __init__(self, path: str, arena: np.ndarray, geometry: dict) -> None:
        """Open the index at `path`, creating it if absent. `geometry` (capacity, page size, the arena
        file's inode) must equal what the index recorded, else ValueError (the caller starts empty)."""
        self.path = path
        self.arena = arena
        _private_dir(path)
        self.env = lmdb.open(path, map_size=1 << 32, max_dbs=4, subdir=True, sync=False, metasync=False, lock=True)
        try:
            self._db_blocks = self.env.open_db(b"blocks")
            self._db_ns = self.env.open_db(b"namespaces")
            self._db_meta = self.env.open_db(b"meta")
            self._check_meta({"version": FORMAT_VERSION, **geometry})
        except BaseException:
            self.env.close()
            raise
        self._lock = threading.Lock()  # the state below, and every write transaction; never held by the hasher
        self._pending: dict[tuple, _Pending] = {}  # committed, record not yet written (insertion order)
        self._pending_ids: set[int] = set()  # id() of the pending blocks' extents lists (`durable`)
        self._recorded: set[tuple] = set()
        self._deletes: list[tuple] = []  # records to delete before their pages are reused
        self._to_hash: queue.SimpleQueue = queue.SimpleQueue()  # _Pending items (None: stop)
        self._hashed: queue.SimpleQueue = queue.SimpleQueue()  # [(item, checksum)] batches (None: wake up)
        self._closing = False
        self.records_written = 0
        self.batches = 0
        self._hasher = threading.Thread(target=self._hash_loop, name="kvstore-host-hash", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-host-index", daemon=True)
        self._hasher.start()
        self._writer.start()

    def _check_meta(self, want: dict) -> None:
        with self.env.begin(write=True, db=self._db_meta) as txn:
            raw = txn.get(b"meta")
            if raw is None:
                if txn.stat(self._db_blocks)["entries"]:
                    raise ValueError("the index has records but no geometry")
                txn.put(b"meta", msgpack.packb(want))
                return
        have = msgpack.unpackb(raw)
        if have != want:
            diff = ", ".join(f"{k} {have.get(k)} -> {v}" for k, v in want.items() if have.get(k) != v)
            raise ValueError(f"the arena does not match the configuration or its index ({diff})")

    # -- loading (at open, before the thread has anything to do) -------------------
    def load(self, capacity_bytes: int, page_bytes: int) -> tuple[list, list, list[int]]:
        """(namespaces, [(key, record)], used pages) of the records that verify; the others are deleted.

        A record is kept when its key and fields are well formed, its extents lie inside the arena
        on page boundaries without overlapping another record's, its length matches, and the
        xxh3_64 of the bytes it points at equals its checksum.
        """
        num_pages = capacity_bytes // page_bytes
        taken = np.zeros(num_pages, dtype=bool)
        kept, bad, used = [], [], []
        reasons: dict[str, int] = {}
        with self.env.begin(db=self._db_blocks) as txn:
            for rkey, raw in txn.cursor():
                rkey = bytes(rkey)
                try:
                    ns_id, h = msgpack.unpackb(rkey)
                    rec = msgpack.unpackb(raw)
                    pages = _pages_of(rec["e"], rec["n"], page_bytes, capacity_bytes)
                    if not isinstance(ns_id, str) or not isinstance(h, bytes) or not isinstance(rec["x"], int):
                        raise ValueError("malformed record")
                    if taken[pages].any():
                        raise ValueError("overlaps another block")
                    if checksum(self.arena, rec["e"]) != rec["x"]:
                        raise ValueError("checksum mismatch (torn or altered bytes)")
                except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                    bad.append(rkey)
                    reasons[str(exc)] = reasons.get(str(exc), 0) + 1
                    continue
                taken[pages] = True
                used.extend(pages)
                kept.append(((ns_id, h), rec))
        if bad:
            with self._lock, self.env.begin(write=True, db=self._db_blocks) as txn:
                for rkey in bad:
                    txn.delete(rkey)
            log.warning("host tier: dropped %d of %d records of the re-adopted arena: %s", len(bad),
                        len(bad) + len(kept), "; ".join(f"{n} {why}" for why, n in reasons.items()))
        self._recorded = {k for k, _ in kept}
        with self.env.begin(db=self._db_ns) as txn:
            namespaces = [(bytes(k).decode(), msgpack.unpackb(v)) for k, v in txn.cursor()]
        return namespaces, kept, used

    def put_namespace(self, ns_id: str, fields: dict) -> None:
        with self._lock, self.env.begin(write=True, db=self._db_ns) as txn:
            txn.put(ns_id.encode(), msgpack.packb(fields))

    # -- the owner's thread ---------------------------------------------------------
    def record(self, key: tuple, extents: list, nbytes: int, meta: tuple) -> None:
        """A block committed at `extents`; `meta` = (parent, depth, attention, stamp). Its record
        (checksum added) will be written shortly."""
        item = _Pending(key, extents, nbytes, meta)
        with self._lock:
            old = self._pending.pop(key, None)
            if old is not None:
                self._pending_ids.discard(id(old.extents))
            self._pending[key] = item
            self._pending_ids.add(id(extents))
        self._to_hash.put(item)

    def forget(self, key: tuple) -> None:
        """The block leaves the tier: drop its pending record, or queue its record's deletion
        (committed by the writer soon, and by `settle` before its pages are allocated again)."""
        with self._lock:
            item = self._pending.pop(key, None)
            if item is not None:
                self._pending_ids.discard(id(item.extents))
                return
            if key not in self._recorded:
                return  # never committed here (an aborted reservation)
            self._recorded.discard(key)
            self._deletes.append(key)
        self._hashed.put(None)  # the writer commits it promptly: a removed block must not come back

    @property
    def has_deletes(self) -> bool:
        return bool(self._deletes)

    def settle(self) -> None:
        """Commit the queued deletions now: the freed pages may be reused after this."""
        with self._lock:
            self._commit([])

    def pending(self, extents: list) -> bool:
        return id(extents) in self._pending_ids

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- writing records ---------------------------------------------------------------
    def _hash_loop(self) -> None:
        """Checksums, at the lowest CPU priority: they must never take the CPU from the copies of a
        put storm. This thread takes no lock the event loop waits for (a preempted nice-19 thread
        holding one would stall the loop): it reads the blocks' pages and hands results on."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._to_hash.get()
            batch, size = [], 0
            while item is not None and not self._closing:
                if self._pending.get(item.key) is item:  # a block freed meanwhile is skipped (re-checked below)
                    # Its pages cannot be reused while it is still pending: a freed block leaves `_pending` first.
                    batch.append((item, checksum(self.arena, item.extents)))
                    size += item.nbytes
                if size >= BATCH_BYTES:
                    break
                try:
                    item = self._to_hash.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._hashed.put(batch)
            if item is None or self._closing:
                return

    def _write_loop(self) -> None:
        """One transaction per batch of checksummed records (and the deletions queued meanwhile).
        Records are packed before the lock is taken, yielding the GIL every few: the loop waits for
        neither this thread's Python work nor more than one short transaction."""
        while True:
            batches = [self._hashed.get()]
            while True:
                try:
                    batches.append(self._hashed.get_nowait())
                except queue.Empty:
                    break
            packed = []
            for i, (item, x) in enumerate(r for batch in batches if batch for r in batch):
                packed.append((item, record_key(item.key), _pack(item, x)))
                if i % 16 == 15:
                    time.sleep(0)
            with self._lock:
                if self._closing:
                    return
                self._commit(packed)

    def _commit(self, packed: list) -> None:
        """Under `_lock`: write the records still pending (a block freed since it was hashed is not),
        delete the queued ones, one transaction. `packed`: [(item, record key, record)]."""
        live = [p for p in packed if self._pending.get(p[0].key) is p[0]]
        if not live and not self._deletes:
            return
        with self.env.begin(write=True, db=self._db_blocks) as txn:
            for key in self._deletes:
                txn.delete(record_key(key))
            for _, rkey, value in live:
                txn.put(rkey, value)
        self._deletes.clear()
        for item, _, _ in live:
            del self._pending[item.key]
            self._pending_ids.discard(id(item.extents))
            self._recorded.add(item.key)
        self.records_written += len(live)
        self.batches += 1

    def flush(self) -> None:
        """Write every pending record and deletion now, hashing on the caller's thread."""
        with self._lock:
            items = list(self._pending.values())
        packed = [(item, record_key(item.key), _pack(item, checksum(self.arena, item.extents))) for item in items]
        with self._lock:
            self._commit(packed)

    def records(self) -> dict[bytes, dict]:
        with self.env.begin(db=self._db_blocks) as txn:
            return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}

    def close(self, flush: bool = True) -> None:
        """Stop the threads; with `flush`, write what is pending first (a clean stop keeps every block)."""
        self._closing = True
        self._to_hash.put(None)
        self._hashed.put(None)
        self._hasher.join()
        self._writer.join()
        if flush:
            self.flush()
        self.env.close()


def _pack(item: _Pending, x: int) -> bytes:
    parent, depth, attention, stamp = item.meta
    return msgpack.packb({"e": item.extents, "n": item.nbytes, "p": parent, "d": depth, "a": attention, "t": stamp,
                          "x": x})


def _private_dir(path: str) -> None:
    """Create the index folder 0700, or check that the existing one is ours and closed to others."""
    try:
        os.mkdir(path, 0o700)  # never follows a symlink at `path`
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"{path} is not a private folder of uid {os.geteuid()} (uid {st.st_uid}, "
                         f"mode {stat.S_IMODE(st.st_mode):04o})")


def _pages_of(extents, nbytes: int, page_bytes: int, capacity_bytes: int) -> list[int]:
    pages, total = [], 0
    for offset, length in extents:
        if offset % page_bytes or length <= 0 or offset + length > capacity_bytes:
            raise ValueError("extent outside the arena")
        pages.extend(range(offset // page_bytes, offset // page_bytes + -(-length // page_bytes)))
        total += length
    if total != nbytes:
        raise ValueError("length does not match the extents")
    return pages
