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
- Its checksum is taken then, off the event loop, by the `kvstore-host-index`
  thread at the lowest CPU priority (nice 19: the copies of a put storm keep
  the CPU); records are written in batches, one LMDB transaction per batch.
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
loop); the index thread hashes and writes. `_lock` orders every write
transaction and the pending/recorded state between them.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from typing import Iterable

import lmdb
import msgpack
import numpy as np
import xxhash

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_BYTES = 64 << 20  # hashed per transaction at most: bounds how long a flush waits behind the thread


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
    key: bytes
    extents: list
    record: dict


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
    """The LMDB placement index of one arena, and the thread that writes it."""

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
        self._lock = threading.Lock()  # the state below, and every write transaction
        self._work = threading.Lock()  # one batch at a time (the thread, or flush on the caller's thread)
        self._cv = threading.Condition(self._lock)
        self._pending: dict[bytes, _Pending] = {}  # committed, record not yet written (insertion order)
        self._pending_ids: set[int] = set()  # id() of the pending blocks' extents lists (`durable`)
        self._recorded: set[bytes] = set()
        self._deletes: list[bytes] = []  # records to delete before their pages are reused
        self._closing = False
        self.records_written = 0
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-host-index", daemon=True)
        self._thread.start()

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
        self._recorded = {record_key(k) for k, _ in kept}
        with self.env.begin(db=self._db_ns) as txn:
            namespaces = [(bytes(k).decode(), msgpack.unpackb(v)) for k, v in txn.cursor()]
        return namespaces, kept, used

    def put_namespace(self, ns_id: str, fields: dict) -> None:
        with self._lock, self.env.begin(write=True, db=self._db_ns) as txn:
            txn.put(ns_id.encode(), msgpack.packb(fields))

    # -- the owner's thread ---------------------------------------------------------
    def record(self, key: tuple, extents: list, record: dict) -> None:
        """A block committed at `extents`: its record (checksum added) will be written shortly."""
        rkey = record_key(key)
        item = _Pending(rkey, extents, {**record, "e": extents, "n": sum(n for _, n in extents)})
        with self._lock:
            old = self._pending.pop(rkey, None)
            if old is not None:
                self._pending_ids.discard(id(old.extents))
            self._pending[rkey] = item
            self._pending_ids.add(id(extents))
            self._cv.notify()

    def forget(self, key: tuple) -> None:
        """The block leaves the tier: drop its pending record, or queue its record's deletion
        (committed by `settle`, which runs before its pages are allocated again)."""
        rkey = record_key(key)
        with self._lock:
            item = self._pending.pop(rkey, None)
            if item is not None:
                self._pending_ids.discard(id(item.extents))
            elif rkey in self._recorded:
                self._recorded.discard(rkey)
                self._deletes.append(rkey)
                self._cv.notify()

    @property
    def has_deletes(self) -> bool:
        return bool(self._deletes)

    def settle(self) -> None:
        """Commit the queued deletions (one transaction): the freed pages may be reused now."""
        with self._lock:
            if not self._deletes:
                return
            with self.env.begin(write=True, db=self._db_blocks) as txn:
                for rkey in self._deletes:
                    txn.delete(rkey)
            self._deletes.clear()

    def pending(self, extents: list) -> bool:
        return id(extents) in self._pending_ids

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- writing records ---------------------------------------------------------------
    def _run(self) -> None:
        try:  # the lowest priority: hashing must never take the CPU from the copies of a put storm
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._lock:
                while not self._pending and not self._deletes and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
            self.settle()  # promptly, so a removed block does not come back after a kill
            self._write_batch()

    def _write_batch(self) -> bool:
        """Hash a batch of pending blocks and write the records still pending afterwards (one txn)."""
        with self._work:
            with self._lock:
                batch, size = [], 0
                for item in self._pending.values():
                    batch.append(item)
                    size += item.record["n"]
                    if size >= BATCH_BYTES:
                        break
            if not batch:
                return False
            # Outside the lock: a block freed meanwhile is no longer pending below, and its pages
            # cannot have been reused while it still was (a freed block leaves `_pending` first).
            sums = [checksum(self.arena, item.extents) for item in batch]
            with self._lock:
                live = [(item, x) for item, x in zip(batch, sums) if self._pending.get(item.key) is item]
                if live:
                    with self.env.begin(write=True, db=self._db_blocks) as txn:
                        for item, x in live:
                            txn.put(item.key, msgpack.packb({**item.record, "x": x}))
                for item, _ in live:
                    del self._pending[item.key]
                    self._pending_ids.discard(id(item.extents))
                    self._recorded.add(item.key)
                self.records_written += len(live)
                self.batches += 1
                self._cv.notify_all()
            return True

    def flush(self) -> None:
        """Write every pending record now, on the caller's thread."""
        while self._write_batch():
            pass
        self.settle()

    def records(self) -> dict[bytes, dict]:
        with self.env.begin(db=self._db_blocks) as txn:
            return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}

    def close(self, flush: bool = True) -> None:
        """Stop the thread; with `flush`, write what is pending first (a clean stop keeps every block)."""
        with self._lock:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        if flush:
            self.flush()
        self.env.close()


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
