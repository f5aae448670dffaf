"""The host tier's kept records, read at open in a thread of their own (tiers/record_scan.py).

A restart re-adopts the arena a previous daemon left (tiers/host.py) and
serves before its records are read: an arena of 64 KiB blocks holds millions
of them (~7 us each here: a msgpack record, its checks, the objects that
track it). `HostScan` reads them over one LMDB snapshot of the placement index
(tiers/host_index.py); the arena takes its result (`HostArena.scanned`): the
index adopts the records kept and deletes the others, and the pages they hold
are the pages in use. No byte of the arena is read here: a kept record is
verified before its block's bytes are first read, or by the index's hasher.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import lmdb
import msgpack
import numpy as np

from kvstore.tiers.host_index import _Pending, _Unverified
from kvstore.tiers.pages import PageAllocator
from kvstore.tiers.recovered import Recovered
from kvstore.tiers.record_scan import RecordScan, page_runs, store_key


class HostScanResult(NamedTuple):
    blocks: Recovered  # the records kept, in key order
    recorded: dict  # key -> record key, of those
    unverified: dict  # key -> _Unverified: the kept records with a checksum
    unchecked: dict  # key -> _Pending: the kept records without one
    bad: list[bytes]  # record keys to delete
    reasons: dict  # why they are bad -> how many
    taken: np.ndarray  # per page: held by a kept record
    seconds: float
    pages: PageAllocator  # the arena's pages, those of `taken` in use (made here, off the event loop)


class HostScan(RecordScan[HostScanResult]):
    """One background read of a kept arena's records (which are kept: tiers/record_scan.py; a record
    without a checksum is kept too, and checked in the background). No byte of the arena is read."""

    def __init__(self, env: lmdb.Environment, db: object, capacity_bytes: int, page_bytes: int) -> None:
        self.capacity_bytes, self.page_bytes = capacity_bytes, page_bytes
        super().__init__(env, db, "kvstore-host-scan")

    def parse(self, rkey: bytes, raw: bytes) -> tuple[tuple, list]:
        """One record: (its fields as `Recovered.normal` gives them, the record, its record key) and the
        page runs it holds; BAD_RECORD's errors where it is unusable (tiers/record_scan.py). Also what the
        arena reads of one record while it scans (`HostArena.peek`)."""
        key = store_key(rkey)
        rec = msgpack.unpackb(raw)
        runs = page_runs(rec["e"], rec["n"], self.page_bytes, self.capacity_bytes)
        if not (rec["x"] is None or isinstance(rec["x"], int)):
            raise TypeError("a checksum that is no int")
        fields = Recovered.normal((key, rec.get("p"), rec["n"], rec["e"], rec.get("a"), rec.get("t", 0.0)))
        return (fields, rec, bytes(rkey)), runs

    def _scan(self) -> HostScanResult:
        t0 = time.monotonic()
        page_bytes, capacity_bytes, parse = self.page_bytes, self.capacity_bytes, self.parse
        with self._env.begin(db=self._db) as txn:
            found = self._read(txn, capacity_bytes // page_bytes, parse)
        blocks, recorded, unverified, unchecked = Recovered(key_objects=True), {}, {}, {}  # (`recorded`'s keys)
        now = time.monotonic()
        for fields, rec, rkey in found.kept:
            key = fields[0]
            e, n, x = rec["e"], rec["n"], rec["x"]
            recorded[key] = rkey
            if x is None:  # checked in the background, like a new record
                unchecked[key] = _Pending(key, e, n, (rec.get("p"), rec.get("d"), rec.get("a"), rec.get("t")), now)
            else:  # verified before its first read, or in the background
                unverified[key] = _Unverified(e, n, x)
            blocks.append(fields)
        blocks.finder()
        pages = PageAllocator(capacity_bytes // page_bytes, page_bytes, np.flatnonzero(found.taken), label="host")
        return HostScanResult(blocks, recorded, unverified, unchecked, found.bad, found.reasons, found.taken,
                              time.monotonic() - t0, pages)
