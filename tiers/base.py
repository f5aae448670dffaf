"""The tier interface: what `kvstore.store.TieredStore` needs of any tier.

A tier is a byte budget cut into pages plus a way to move a block's bytes in
and out. It knows nothing of keys' meaning, order, pins or the prefix tree:
the store owns those for every pair of tiers (tiers and eviction never import
each other). Implementations: `tiers/gpu.py` (`GpuPool`), `tiers/host.py`
(`HostArena`), `tiers/disk.py` (`DiskTier`); a remote tier implements the same.

What a tier declares
--------------------
- `name`: one of `TIER_ORDER`, which also ranks tiers fastest first. A store's
  chain is any subsequence of that order.
- `client_readable`: clients read and write its bytes themselves (the host
  arena by mmap, the GPU pool by CUDA IPC); blocks of other tiers (disk,
  remote) are promoted into a readable tier before a client sees them.
- `host_memory`: `segments(location)` gives the block's bytes as host-memory
  views (the arena), so any other tier copies straight into or out of them.
  Every transfer between two tiers goes through such a tier (the host arena
  is in every chain), never through an extra staging copy.
- `persistent`: it keeps blocks across a restart (`recover`, and `scanned` for
  a tier that reads its records in the background: the disk tier). A persistent
  tier that clients write (the host arena) learns of each block that comes to
  sit committed in it through `placed`; the others record a block when they
  take its bytes (`write_from`).
- `accepts_demotions`: victims of the tier above move down into it. The remote
  tier (tiers/remote.py) does not: it is shared, and what is published to it
  is decided by kvstore/sharing.py.

Moving bytes (one block at a time, but for the reads of `read_many`)
--------------------------------------------------------------------
- `write_from(alloc, src, meta) -> location`: take the block's bytes from the
  host-memory views `src` into the pages `alloc`. The bytes are taken by the
  time it returns (a persistent tier may make them durable later: until then
  `read_into` still serves them and `failed_writes` reports a loss). A tier
  that compresses (the disk tier) also takes `codec=` (kvstore/compression.py):
  `alloc` then has `codec.stored_bytes`, the tier stores `codec.encode(bytes)`,
  encoding off the event loop, and `read_into` gives the decoded block.
- `read_into(location, out) -> bool`: copy the block into the host-memory views
  `out`; False when the bytes do not verify (checksum), and the store then
  drops the block. `read_blocks(location)` says whether that call waits on
  I/O: the store then runs it in an executor thread, off the event loop, a
  task for each group `runs(locations)` makes, reading a group with
  `read_many` (True, False or None where a read failed, per block). By
  default a group is one block; the disk tier groups blocks on adjacent
  pages and reads a group with one call.
- `verify(location, key) -> bool`: before the bytes of a block a tier kept
  across a restart are first read by anyone (a client's acquire, a copy to
  another tier): False when they do not match their recorded checksum (the
  store discards the block). `verifying` is true while the tier holds such
  blocks not verified yet (the host arena serves first and verifies as it goes).

All other methods run on the store's thread.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import ContextManager, Iterable, NamedTuple, Sequence

import numpy as np

from kvstore.keys import Key  # noqa: F401  (also this module's name)
from kvstore.tiers import TIER_ORDER  # noqa: F401  (also this module's name)
from kvstore.tiers.pages import PageAllocator, allocate_each

log = logging.getLogger("kvstore.tiers")


class BlockMeta(NamedTuple):
    """What a persistent tier records with a block (to rebuild the tree at restart). A named tuple:
    the store makes one per committed block on the commit path."""

    key: Key
    parent: bytes | None  # the parent's hash; None for a root
    depth: int
    attention: float | None
    stamp: float  # wall-clock time the block reached the tier


class RecoveredBlock(NamedTuple):
    """A block a persistent tier found at open (a named tuple: a tier makes one per record, millions of
    them for a disk tier)."""

    key: Key
    parent: bytes | None
    nbytes: int
    location: object
    attention: float | None
    stamp: float


ENCODE_THREADS = min(4, os.cpu_count() or 1)  # a batch's blocks are encoded (decoded) on this many threads at once


class CompressedTally:
    """The compressed blocks a tier holds, per codec tag: how many, their decoded and their stored bytes."""

    def __init__(self) -> None:
        self._rows: dict[str, list[int]] = {}

    def count(self, tag: str, sign: int, logical: int, stored: int) -> None:
        """A block encoded with `tag` came in (+1) or left (-1)."""
        row = self._rows.setdefault(tag, [0, 0, 0])
        row[0] += sign
        row[1] += sign * logical
        row[2] += sign * stored

    def stats(self) -> dict:
        return {tag: {"blocks": n, "logical_bytes": logical, "stored_bytes": stored,
                      "ratio": round(logical / stored, 3) if stored else None}
                for tag, (n, logical, stored) in sorted(self._rows.items()) if n}


class Tier:
    """Base of every tier. Paged tiers set `self.pages` (a PageAllocator) and inherit the bookkeeping."""

    name: str = ""
    client_readable: bool = False
    host_memory: bool = False
    persistent: bool = False
    accepts_demotions: bool = True  # the remote tier does not: what reaches it is the publish policy's choice
    pages: PageAllocator
    page_bytes: int
    capacity_bytes: int

    # -- page bookkeeping ---------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.pages.free_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - self.free_bytes

    def pages_for(self, nbytes: int) -> int:
        return self.pages.pages_for(nbytes)

    def fits(self, nbytes: int) -> bool:
        """Could a block of `nbytes` ever be placed here (the tier empty)?"""
        return 0 < self.pages.pages_for(nbytes) <= self.pages.num_pages

    def shortfall(self, nbytes: int) -> int:
        """Bytes still to be freed before `nbytes` can be allocated (<= 0: none)."""
        return (self.pages.pages_for(nbytes) - self.pages.free_pages) * self.page_bytes

    def batch_shortfall(self, nbytes: int, count: int) -> int:
        """Bytes still to be freed before `count` blocks of `nbytes` can be allocated (<= 0: none)."""
        return count * self.pages_for(nbytes) * self.page_bytes - self.free_bytes

    def allocate(self, nbytes: int):
        """Pages for `nbytes` (an allocation the tier understands), or None when there is no room."""
        return self.pages.allocate(nbytes)

    def allocate_many(self, nbytes: int, count: int) -> list:
        """`allocate(nbytes)` up to `count` times while there is room, in one call: the allocations
        those calls would have made, in order. What the caller does not use goes back through
        `free_unused`, as if never taken."""
        return allocate_each(self.allocate, nbytes, count)

    def free_unused(self, allocations: Sequence) -> None:
        """Give back unused allocations of `allocate_many` (no block was ever placed in them)."""
        for alloc in reversed(allocations):
            self.free(alloc)

    def free(self, location, key: Key | None = None) -> None:
        """Give a block's pages back (and forget its record, in a persistent tier)."""
        self.pages.free(location)

    # Whether `placed` records anything (the kept host arena's index does): the store builds a BlockMeta a
    # block for it only then (a disk tier records a block when it writes it; a demotion would build one for
    # nothing).
    records_placed = False

    def placed(self, location, meta: "BlockMeta") -> None:
        """A committed block now sits at `location` (its commit, or a move into this tier)."""

    def placed_many(self, blocks: Sequence[tuple[object, "BlockMeta"]]) -> None:
        """`placed` for the (location, meta) of several blocks (one commit), in order."""
        for location, meta in blocks:
            self.placed(location, meta)

    def busy(self) -> None:
        """Clients are reading (an acquire), or the store adopts what the tiers kept: background work that
        competes for memory or the GIL may wait."""

    def locate(self, location) -> list:
        """The page extents of a location (for `check`)."""
        return location

    def check(self, locations: Iterable) -> list[str]:
        """Problems found comparing the free pages with the live `locations` (placed blocks, and
        allocations held by promotions in flight). Empty = clean."""
        problems = self.pages.check([self.locate(loc) for loc in locations])
        if self.used_bytes > self.capacity_bytes:
            problems.append(f"{self.name} tier over budget")
        return problems

    def check_records(self, placed: dict) -> list[str]:
        """A persistent tier compares its index with the blocks the store places here (key -> location)."""
        return []

    # -- bytes ------------------------------------------------------------------------
    def segments(self, location) -> list[np.ndarray]:
        raise NotImplementedError(f"the {self.name} tier is not host memory")

    def write_from(self, alloc, src: Sequence[np.ndarray], meta: BlockMeta):
        raise NotImplementedError

    def read_into(self, location, out: Sequence[np.ndarray]) -> bool:
        raise NotImplementedError

    def read_blocks(self, location) -> bool:
        return False

    def runs(self, locations: Sequence) -> list[list[int]]:
        """The positions of `locations` grouped for `read_many` (a reader task a group): each alone here."""
        return [[i] for i in range(len(locations))]

    def read_many(self, reads: Sequence[tuple[object, Sequence[np.ndarray]]]) -> list[bool | None]:
        """`read_into` of each (location, out): True, False (the bytes do not verify) or None (the read
        failed: an OSError, logged)."""
        out: list[bool | None] = []
        for location, dst in reads:
            try:
                out.append(self.read_into(location, dst))
            except OSError as exc:
                log.error("%s tier: read of a block failed: %s", self.name, exc)
                out.append(None)
        return out

    @property
    def verifying(self) -> bool:
        """Some blocks kept across a restart have not been verified yet (`verify`)."""
        return False

    def verify(self, location, key: Key) -> bool:
        """Whether a kept block's bytes match their recorded checksum (True for any other block)."""
        return True

    def failed_writes(self) -> list[Key]:
        """Blocks whose write failed after `write_from` since the last call; `lost(location)` then says
        whether the block's current location is the one whose bytes are gone."""
        return []

    def failed_checks(self) -> list[Key]:
        """Kept blocks found altered in the background that the tier still holds (listed until the store
        discards them; `lost` as above)."""
        return []

    def lost(self, location) -> bool:
        return False

    def stored_encoded(self, location) -> int:
        """The stored size of a block held encoded, which a reader may decode itself with `read_encoded`
        (the disk tier; the remote tier's come through kvstore/sharing.py); 0 here."""
        return 0

    def read_encoded(self, location, blob: np.ndarray) -> bool:
        raise NotImplementedError(f"the {self.name} tier holds no encoded blocks")

    def durable(self, location) -> bool:
        """The block would survive a crash now (persistent tiers: its write is committed)."""
        return self.persistent

    # -- persistence ---------------------------------------------------------------------
    def recover(self) -> tuple[list[tuple[str, dict]], list[RecoveredBlock]]:
        """(namespaces, blocks) found at open; only persistent tiers have any. A tier that reads its
        records in the background (`scanning`) gives its blocks through `scanned` instead."""
        return [], []

    def encoders_behind(self, nbytes: int = 0) -> bool:
        """A tier that encodes blocks (`write_from(..., codec=)`) off the caller's thread: whether a block
        of `nbytes` handed to it now would wait for its encoders."""
        return False

    @property
    def scanning(self) -> bool:
        """The tier still reads its records in the background: it takes no block until `scanned`
        has handed them over."""
        return False

    @property
    def num_kept_records(self) -> int:
        """How many block records the tier found at open (before any is checked); 0 for a tier that
        keeps none. Cheap: the store uses it to decide whether to recover before it serves."""
        return 0

    @property
    def peekable(self) -> bool:
        """While it scans: whether it reads a record on its own (`peek`)."""
        return False

    def peek(self, key: Key) -> tuple | None:
        """While the tier scans (`scanning`): `key`'s record, read on its own and judged as the scan judges
        one, as `Recovered.normal`'s fields (key, parent hash, size, location, estimate, stamp); None where
        it has none or an unusable one, or reads its records only in the scan (this default)."""
        return None

    def adopted_early(self, key: Key, location: object) -> None:
        """The store adopted `key`'s block at `location`, as `peek` gave it, while the tier scans."""

    def peeks(self) -> ContextManager[None]:
        """Around a request's `peek`s (and `adopted_early`s): a tier that reads its records from a store
        of its own may read them all in one read transaction (this default: nothing)."""
        return nullcontext()

    def scanned(self, wait: bool = False) -> list[RecoveredBlock] | None:
        """The blocks a background read of the records found, once (None while it runs, unless `wait`);
        [] for a tier that has none to give."""
        return []

    def persist_namespace(self, ns_id: str, fields: dict) -> None:
        pass

    def prewarm(self, nbytes: int) -> None:
        """Blocks of `nbytes` are coming (a namespace was registered): prepare buffers for them."""

    def flush(self) -> None:
        """Block until every write taken so far is durable."""

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes, "page_bytes": self.page_bytes}
