"""The disk tier's record scan: its index's block records read at open, in a thread of their own
(tiers/record_scan.py).

A disk tier of millions of blocks takes seconds to minutes to read its index.
A record becomes a row of `Recovered` columns when it is kept (tiers/record_scan.py:
well formed, inside the data file, its pages its own) and has a checksum; the
others are *bad*: the tier deletes them, and so are the oldest past the tier's
`max_blocks` (a cap lowered since: `newest`). `taken` marks the pages the kept
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

from kvstore.tiers.disk_slot import codec_of, extents_of
from kvstore.tiers.pages import PageAllocator
from kvstore.tiers.recovered import Recovered
from kvstore.tiers.record_scan import RecordScan, describe, page_runs, record_key, store_key

log = logging.getLogger("kvstore.tiers.disk")


class ScanResult(NamedTuple):
    blocks: Recovered
    bad: list[bytes]  # record keys to delete
    taken: np.ndarray  # per page: held by a good record
    seconds: float
    encoded: list  # the locations of the blocks kept encoded (found here, not on the tier's event loop)
    pages: PageAllocator  # the tier's pages, those of `taken` in use (made here: ~0.4 s of 10^7 pages)


class DiskScan(RecordScan[ScanResult]):
    """One background read of a disk tier's block records."""

    YIELDS_TO_REQUESTS = True

    def __init__(self, env: lmdb.Environment, db: object, page_bytes: int, num_pages: int,
                 location: Callable[[list, int, str | None, int], object], decodes: bool = False,
                 max_blocks: int | None = None) -> None:
        """`location(extents, checksum, codec, size)`: the tier's location of a recovered block (`codec`
        the tag of an encoded block's codec, else None; `size` the block's own size); `decodes`: whether
        the tier can decode encoded blocks (if not, their records are bad); `max_blocks`: the most it
        keeps (`newest`)."""
        self._decodes = decodes
        self._max_blocks = max_blocks
        self.page_bytes, self.num_pages, self._capacity = page_bytes, num_pages, page_bytes * num_pages
        self._location = location
        super().__init__(env, db, "kvstore-disk-scan")

    def parse(self, rkey: bytes, raw: bytes) -> tuple[tuple, list]:
        """One record: (key, parent hash, size, location, attention, stamp), as `Recovered` takes it, and the
        page runs it holds; BAD_RECORD's errors where it is unusable (tiers/record_scan.py). Also what the
        tier reads of one record while it scans (`DiskTier.peek`)."""
        key = store_key(rkey)
        rec = msgpack.unpackb(raw)
        extents, checksum = rec["e"], rec["x"]
        if not isinstance(checksum, int):
            raise TypeError("no checksum")
        runs = page_runs(extents, rec["n"], self.page_bytes, self._capacity)
        codec = rec.get("c")
        if codec is not None and not (self._decodes and isinstance(codec, str)):
            raise TypeError("an encoded block and no decoder")
        size = rec["n"] if codec is None else rec["z"]
        return (key, rec.get("p"), size, self._location(extents, checksum, codec, size), rec.get("a"),
                rec.get("t", 0.0)), runs

    def _scan(self) -> ScanResult:
        t0 = time.monotonic()
        pb, parse = self.page_bytes, self.parse
        with self._env.begin(db=self._db) as txn:
            found = self._read(txn, self.num_pages, parse, into=Recovered)
        if found.bad:
            log.warning("disk tier: %d unusable index records (deleted): %s", len(found.bad),
                        describe(found.reasons))
        kept = found.kept
        if self._max_blocks is not None and len(kept) > self._max_blocks:  # (the tier's cap was lowered)
            kept = newest(kept, self._max_blocks, found.taken, found.bad, pb)
        kept.finder()  # (its sort, here: NumPy lets the event loop run meanwhile)
        encoded = [loc for loc in kept.locations.odd.values() if codec_of(loc) is not None]  # (a plain int: exact)
        pages = PageAllocator(self.num_pages, pb, np.flatnonzero(found.taken), label="disk")
        return ScanResult(kept, found.bad, found.taken, time.monotonic() - t0, encoded, pages)


def newest(blocks: Recovered, most: int, taken: np.ndarray, bad: list[bytes], page_bytes: int) -> Recovered:
    """The `most` of `blocks` that reached the disk last, in their order; the others' pages are marked free
    in `taken` and their record keys added to `bad`. As a smaller budget at a restart keeps what fits, a
    lower cap keeps the newest (a block reaches the disk before its parent: the oldest are leaves, and a
    block whose parent went is an orphan the recovery frees)."""
    stamps = np.frombuffer(blocks.stamps, np.float64)
    keep = np.zeros(len(blocks), dtype=bool)
    keep[np.argsort(stamps, kind="stable")[len(blocks) - most :]] = True
    for i in np.flatnonzero(~keep).tolist():
        for offset, length in extents_of(blocks.locations[i]):
            taken[offset // page_bytes : (offset + length - 1) // page_bytes + 1] = False
        bad.append(record_key(blocks.keys[i]))
    log.warning("disk tier: %d blocks, more than max_blocks %d: the %d that reached it first are dropped",
                len(blocks), most, len(blocks) - most)
    return blocks.take(np.flatnonzero(keep))
