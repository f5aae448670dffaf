"""The disk tier's record scan: its index's block records read at open, in a thread of their own
(tiers/record_scan.py).

A disk tier of millions of blocks takes seconds to minutes to read its index.
A record becomes a `RecoveredBlock` when its key and fields are
well formed, it has a checksum, its extents lie inside the data file on page
boundaries, its length matches them, and it overlaps no record read before it;
the others are *bad*: the tier deletes them. `taken` marks the pages the good
ones hold. Until the tier has taken the result, it knows no free page and so
takes no block (tiers/disk.py): no write can land on a page a record it has
not read yet points at.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import lmdb
import msgpack
import numpy as np

from kvstore.tiers.base import RecoveredBlock
from kvstore.tiers.record_scan import RecordScan

log = logging.getLogger("kvstore.tiers.disk")


class ScanResult(NamedTuple):
    blocks: list[RecoveredBlock]
    bad: list[bytes]  # record keys to delete
    taken: np.ndarray  # per page: held by a good record
    seconds: float


class DiskScan(RecordScan[ScanResult]):
    """One background read of a disk tier's block records."""

    def __init__(self, env: lmdb.Environment, db: object, page_bytes: int, num_pages: int,
                 location: Callable[[list, int, str | None, int], object], decodes: bool = False) -> None:
        """`location(extents, checksum, codec, size)`: the tier's location of a recovered block (`codec`
        the tag of an encoded block's codec, else None; `size` the block's own size); `decodes`: whether
        the tier can decode encoded blocks (if not, their records are bad)."""
        self._decodes = decodes
        self.page_bytes, self.num_pages = page_bytes, num_pages
        self._location = location
        super().__init__(env, db, "kvstore-disk-scan")

    def _scan(self) -> ScanResult:
        t0 = time.monotonic()
        pb, capacity = self.page_bytes, self.page_bytes * self.num_pages
        taken = np.zeros(self.num_pages, dtype=bool)
        blocks: list[RecoveredBlock] = []
        bad: list[bytes] = []
        unpack, location = msgpack.unpackb, self._location
        with self._env.begin(db=self._db) as txn:
            for rkey, raw in self._records(txn):
                try:
                    ns_id, h = unpack(rkey)
                    rec = unpack(raw)
                    extents, checksum = rec["e"], rec["x"]
                    if not isinstance(checksum, int) or not isinstance(ns_id, str) or not isinstance(h, bytes):
                        raise TypeError("no checksum, or a malformed key")
                    runs, total = [], 0
                    for offset, length in extents:
                        if offset % pb or length <= 0 or offset + length > capacity:
                            raise ValueError("extent outside the data file")
                        runs.append((offset // pb, offset // pb + -(-length // pb)))
                        total += length
                    if total != rec["n"] or any(taken[a:b].any() for a, b in runs):
                        raise ValueError("length mismatch or overlap")
                    codec = rec.get("c")
                    if codec is not None and not (self._decodes and isinstance(codec, str)):
                        raise TypeError("an encoded block and no decoder")
                    size = rec["n"] if codec is None else rec["z"]
                    block = RecoveredBlock((ns_id, h), rec.get("p"), size, location(extents, checksum, codec, size),
                                           rec.get("a"), rec.get("t", 0.0))
                except (ValueError, KeyError, TypeError, msgpack.UnpackException):
                    bad.append(bytes(rkey))
                    continue
                for a, b in runs:
                    taken[a:b] = True
                blocks.append(block)
        if bad:
            log.warning("disk tier: %d unusable index records (deleted)", len(bad))
        return ScanResult(blocks, bad, taken, time.monotonic() - t0)
