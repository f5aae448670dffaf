"""A persistent tier's block records, read at open in a thread of their own (the disk's and the host arena's).

A tier that keeps millions of blocks takes seconds to read their records (a
msgpack record per block, checked one by one): the daemon serves meanwhile,
and the store adopts the blocks once they are read (kvstore/recovery.py).
`RecordScan` is the thread and its hand-over; a tier's subclass reads its own
records (`_scan`, over one LMDB snapshot) into its result. Until the tier has
taken that result it knows no free page and so takes no block: no write can
land on a page that a record it has not read yet points at.

`_read` is the part both tiers share: a record is kept when the subclass can
parse it (its key and fields well formed, `page_runs`: its extents inside the
tier on page boundaries, their length the block's) and no record before it in
key order claims one of its pages; the others are *bad*, for the tier to
delete. The pages are marked once, at the end (a NumPy slice per record cost
more than the rest of its check); only when two records do claim a page
(never written so) are the records read again, one after the other.
"""

from __future__ import annotations

import threading
import time
from array import array
from contextlib import contextmanager
from typing import Any, Callable, Generic, Iterator, NamedTuple, TypeVar

import lmdb
import msgpack
import numpy as np

from kvstore.keys import HASH_BYTES, TAG_BYTES, Key, block_key, key_ns

YIELD_EVERY = 256  # records between two releases of the GIL (the event loop waits for it meanwhile)

# The address space an LMDB environment of block records reserves per block its tier can hold: a record is
# ~180 B of the tree, and a fill of small blocks grew the disk's file to ~435 B a record with the pages LMDB
# keeps free for its copy-on-write. A map sized for the tier's blocks never meets MDB_MAP_FULL (a fixed map of
# 16 GiB filled at 40-90 million records); it reserves address space only, the file grows as it is written.
MAP_BYTES_PER_RECORD = 1024

R = TypeVar("R")
BAD_RECORD = (ValueError, KeyError, TypeError, msgpack.UnpackException)  # what a record that does not parse raises
_PACKER = msgpack.Packer()  # `pack` holds the GIL from start to end: one Packer serves every thread


def map_bytes(records: int, floor: int) -> int:
    """The map of an LMDB environment for `records` block records: at least `floor` bytes."""
    return max(floor, records * MAP_BYTES_PER_RECORD)


_HEADS: dict[bytes, bytes] = {}  # namespace tag -> the msgpack bytes before a 16-byte hash in its record keys


def record_key(key: Key) -> bytes:
    """A block's key in its tier's records: msgpack `[namespace id, hash]` of the store key. For a
    16-byte hash, the namespace's bytes before it are made once (a quarter of packing the pair)."""
    tag, h = key[:TAG_BYTES], key[TAG_BYTES:]
    if len(h) != HASH_BYTES:
        return _PACKER.pack([key_ns(key), h])  # (packb would make a Packer per call: ~3x the cost)
    head = _HEADS.get(tag)
    if head is None:
        head = _HEADS[tag] = _PACKER.pack([key_ns(key), b"\0" * HASH_BYTES])[:-HASH_BYTES]
    return head + h


class Records(NamedTuple):
    """What `_read` found: the items the parse made of the records kept, in key order, and the rest."""

    kept: Any  # (a list, or what `_read` was given to make)
    bad: list[bytes]  # record keys to delete
    reasons: dict[str, int]  # why they are bad -> how many
    taken: np.ndarray  # per page: held by a kept record


class RecordScan(Generic[R]):
    """One background read of the records of `db` in `env`; `result()` once it is done."""

    # Whether the scan waits while a request reads records of its own (`held`). The disk's does: its
    # scan is the long one (10^7 records, ~8 s). The arena's does not: its blocks adopted by the scan
    # cost less memory than those adopted early (one object less, and none made between a request's
    # transient ones), and held back by a stream of requests it adopted nearly all of them early
    # (bench_scale at 10^5: +450 B of daemon memory a block once recovered).
    YIELDS_TO_REQUESTS = False

    def __init__(self, env: lmdb.Environment, db: object, thread_name: str) -> None:
        self._env, self._db = env, db
        self._result: R | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._running = threading.Event()  # cleared while the loop reads records of its own (`held`)
        self._running.set()
        self._held: lmdb.Transaction | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def result(self, wait: bool = False) -> R | None:
        """The scan's result once it is done (None before, unless `wait`); re-raises its error."""
        if wait:
            self._done.wait()
        elif not self._done.is_set():
            return None
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self) -> None:
        """Abandon the scan (the tier closes before it was done) and wait for its thread."""
        self._stopping = True
        self._running.set()
        self._thread.join()

    def get(self, rkey: bytes) -> bytes | None:
        """One record read on its own (`Tier.peek`): in the transaction `held` opened, else in one of its
        own."""
        txn = self._held
        if txn is not None:
            return txn.get(rkey)
        with self._env.begin(db=self._db) as txn:
            return txn.get(rkey)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Around a request's `get`s (`Tier.peeks`): the reads share one transaction, and the scan's thread
        waits at its next pause (at most YIELD_EVERY records) where it `YIELDS_TO_REQUESTS`. Each LMDB
        call lets the GIL go, and with the scan's thread running the loop waited to have it back at every
        one: 40-60 us a block adopted early, where a read is ~2 us alone."""
        if self._held is not None:  # (nested: the outer one holds)
            yield
            return
        if self.YIELDS_TO_REQUESTS:
            self._running.clear()
        try:
            with self._env.begin(db=self._db) as txn:
                self._held = txn
                try:
                    yield
                finally:
                    self._held = None
        finally:
            self._running.set()

    def _run(self) -> None:
        try:
            self._result = self._scan()
        except BaseException as exc:  # handed to the owner with the result
            self._error = exc
        finally:
            self._done.set()

    def _records(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """(record key, record) of every record in key order, releasing the GIL every YIELD_EVERY (and
        waiting there while the loop reads records of its own, `held`, but never twice in a row); ends
        early when the scan is stopped."""
        running, waited = self._running, False
        for i, item in enumerate(txn.cursor(db=self._db)):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                if self._stopping:
                    return
                if running.is_set() or waited:  # (never at two pauses in a row: requests one after the
                    time.sleep(0)                # other leave it YIELD_EVERY records between them)
                    waited = False
                else:
                    running.wait()
                    waited = True
            yield item

    def _read(self, txn: lmdb.Transaction, num_pages: int,
              parse: Callable[[bytes, bytes], tuple[Any, list[tuple[int, int]]]], one_by_one: bool = False,
              into: Callable[[], Any] = list) -> Records:
        """Every record of the snapshot `txn` through `parse(record key, record)` -> (item, its page runs),
        which raises one of BAD_RECORD for a bad record; the items kept are appended to a new `into()`
        (whose `append` may raise one of BAD_RECORD too). `one_by_one`: the pages are marked as each record
        is kept, and a record that claims a page marked already is bad too (the slow way, for when two do)."""
        kept, bad, reasons = into(), [], {}
        first, last = array("q"), array("q")  # per extent of a kept record: its first page and last + 1
        taken = np.zeros(num_pages, dtype=bool) if one_by_one else None
        for rkey, raw in self._records(txn):
            try:
                item, runs = parse(rkey, raw)
                if taken is not None and any(taken[a:b].any() for a, b in runs):
                    raise ValueError("overlaps another block")
                kept.append(item)
            except BAD_RECORD as exc:
                bad.append(bytes(rkey))
                reasons[str(exc)] = reasons.get(str(exc), 0) + 1
                continue
            for a, b in runs:
                if taken is not None:
                    taken[a:b] = True
                else:
                    first.append(a)
                    last.append(b)
        if taken is None:
            taken = _mark_pages(num_pages, first, last)
            if taken is None:  # two records claim a page (never written so): the later ones in key order go
                return self._read(txn, num_pages, parse, one_by_one=True, into=into)
        return Records(kept, bad, reasons, taken)

    def _scan(self) -> R:
        raise NotImplementedError


_TAG_OF_HEAD: dict[bytes, bytes] = {}  # the bytes of a record key before its 16-byte hash -> its namespace's tag


def store_key(rkey: bytes) -> Key:
    """The store key of a record key (`record_key`); one of BAD_RECORD where it packs none. A key whose
    bytes before a 16-byte hash are those of a key unpacked before is that namespace's (a scan's keys:
    no unpacking but the first of each namespace's)."""
    tag = _TAG_OF_HEAD.get(rkey[:-HASH_BYTES]) if type(rkey) is bytes else None
    if tag is not None:
        return tag + rkey[-HASH_BYTES:]
    ns_id, h = msgpack.unpackb(rkey)
    if not isinstance(ns_id, str) or not isinstance(h, bytes):
        raise TypeError("a malformed key")
    key = block_key(ns_id, h)
    if len(h) == HASH_BYTES and len(_TAG_OF_HEAD) < 4096:
        _TAG_OF_HEAD[bytes(rkey[:-HASH_BYTES])] = key[:TAG_BYTES]
    return key


def describe(reasons: dict[str, int]) -> str:
    """`Records.reasons` for a log line: "3 why; 1 why else"."""
    return "; ".join(f"{n} {why}" for why, n in reasons.items())


def page_runs(extents, nbytes: int, page_bytes: int, capacity_bytes: int) -> list[tuple[int, int]]:
    """The [first, end) page numbers of each extent; ValueError for one outside the tier or a length
    that does not match."""
    runs, total = [], 0
    for offset, length in extents:
        if offset % page_bytes or length <= 0 or offset + length > capacity_bytes:
            raise ValueError("extent outside the tier")
        runs.append((offset // page_bytes, offset // page_bytes + -(-length // page_bytes)))
        total += length
    if total != nbytes:
        raise ValueError("length does not match the extents")
    return runs


def _mark_pages(num_pages: int, first: array, last: array) -> np.ndarray | None:
    """The pages the runs [first, last) cover, as a bool per page; None when two runs overlap."""
    n = num_pages + 1
    starts = np.bincount(np.frombuffer(first, dtype=np.int64), minlength=n)
    ends = np.bincount(np.frombuffer(last, dtype=np.int64), minlength=n)
    cover = np.cumsum(starts[:-1] - ends[:-1])
    return None if (cover > 1).any() else cover > 0
