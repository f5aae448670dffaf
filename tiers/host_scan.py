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

from kvstore.tiers.base import RecoveredBlock
from kvstore.tiers.host_index import _Pending, _Unverified
from kvstore.tiers.record_scan import RecordScan


class HostScanResult(NamedTuple):
    blocks: list[RecoveredBlock]  # the records kept, in key order
    recorded: dict  # key -> record key, of those
    unverified: dict  # key -> _Unverified: the kept records with a checksum
    unchecked: dict  # key -> _Pending: the kept records without one
    bad: list[bytes]  # record keys to delete
    reasons: dict  # why they are bad -> how many
    taken: np.ndarray  # per page: held by a kept record
    seconds: float


class HostScan(RecordScan[HostScanResult]):
    """One background read of a kept arena's records. A record is kept when its key and fields are well
    formed, its extents lie inside the arena on page boundaries without overlapping another record's
    (the earlier in key order keeps the page) and its length matches. No byte of the arena is read."""

    def __init__(self, env: lmdb.Environment, db: object, capacity_bytes: int, page_bytes: int) -> None:
        self.capacity_bytes, self.page_bytes = capacity_bytes, page_bytes
        super().__init__(env, db, "kvstore-host-scan")

    def _scan(self) -> HostScanResult:
        t0 = time.monotonic()
        page_bytes, capacity_bytes = self.page_bytes, self.capacity_bytes
        kept: list[tuple[tuple, dict, bytes]] = []
        first, last = [], []  # per extent of a kept record: its first and last page + 1
        bad: list[bytes] = []
        reasons: dict[str, int] = {}

        def drop(rkey: bytes, why: str) -> None:
            bad.append(rkey)
            reasons[why] = reasons.get(why, 0) + 1

        unpack = msgpack.unpackb
        with self._env.begin(db=self._db) as txn:
            for rkey, raw in self._records(txn):
                try:
                    ns_id, h = unpack(rkey)
                    rec = unpack(raw)
                    runs = _page_runs(rec["e"], rec["n"], page_bytes, capacity_bytes)
                    if not isinstance(ns_id, str) or not isinstance(h, bytes) or not (
                            rec["x"] is None or isinstance(rec["x"], int)):
                        raise ValueError("malformed record")
                except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                    drop(bytes(rkey), str(exc))
                    continue
                kept.append(((ns_id, h), rec, bytes(rkey)))
                for a, b in runs:
                    first.append(a)
                    last.append(b)
        num_pages = capacity_bytes // page_bytes
        taken = _mark_pages(num_pages, first, last)
        if taken is None:  # two records claim a page (never written so): drop the later ones, in key order
            kept, taken = _without_overlaps(kept, num_pages, page_bytes, drop)
        blocks, recorded, unverified, unchecked = [], {}, {}, {}
        now = time.monotonic()
        for key, rec, rkey in kept:
            e, n, x = rec["e"], rec["n"], rec["x"]
            recorded[key] = rkey
            if x is None:  # checked in the background, like a new record
                unchecked[key] = _Pending(key, e, n, (rec.get("p"), rec.get("d"), rec.get("a"), rec.get("t")), now)
            else:  # verified before its first read, or in the background
                unverified[key] = _Unverified(e, n, x)
            blocks.append(RecoveredBlock(key, rec.get("p"), n, e, rec.get("a"), rec.get("t", 0.0)))
        return HostScanResult(blocks, recorded, unverified, unchecked, bad, reasons, taken, time.monotonic() - t0)


def _without_overlaps(kept: list, num_pages: int, page_bytes: int, drop) -> tuple[list, np.ndarray]:
    """`kept` less every record that claims a page a record before it claims (the slow path)."""
    taken = np.zeros(num_pages, dtype=bool)
    out = []
    for key, rec, rkey in kept:
        runs = _page_runs(rec["e"], rec["n"], page_bytes, num_pages * page_bytes)
        if any(taken[a:b].any() for a, b in runs):
            drop(rkey, "overlaps another block")
            continue
        for a, b in runs:
            taken[a:b] = True
        out.append((key, rec, rkey))
    return out, taken


def _mark_pages(num_pages: int, first: list[int], last: list[int]) -> np.ndarray | None:
    """The pages the runs [first, last) cover, as a bool per page; None when two runs overlap."""
    count = np.zeros(num_pages + 1, dtype=np.int64)
    np.add.at(count, np.asarray(first, dtype=np.int64), 1)
    np.add.at(count, np.asarray(last, dtype=np.int64), -1)
    cover = np.cumsum(count[:-1])
    return None if (cover > 1).any() else cover > 0


def _page_runs(extents, nbytes: int, page_bytes: int, capacity_bytes: int) -> list[tuple[int, int]]:
    """The [first, end) page numbers of each extent; ValueError for one outside the arena or a length
    that does not match."""
    runs, total = [], 0
    for offset, length in extents:
        if offset % page_bytes or length <= 0 or offset + length > capacity_bytes:
            raise ValueError("extent outside the arena")
        runs.append((offset // page_bytes, offset // page_bytes + -(-length // page_bytes)))
        total += length
    if total != nbytes:
        raise ValueError("length does not match the extents")
    return runs
