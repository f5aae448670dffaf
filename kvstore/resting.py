"""Blocks at rest: the plain chain blocks of the disk tier kept as rows of bytes, not as objects.

At production size nearly every block sits in the disk tier inside a chain: committed, unpinned, one
child below it in the same tier, not read since it arrived, its policy record holding nothing of its
own (the default policy's F and C are objects it shares with the blocks of its burst and its shape).
As objects such a block is an index `Entry`, its key, its location, a policy record and a slot in two
tables: ~385 B. At rest it is one row of `ROW` (its key, its parent's and its child's, its depth,
location and time) in a chunk of rows, two references (its policy's shared F and C) and a slot of a
hash table: ~130 B (docs/benchmarks.md, "Blocks at rest").

Rules:
- A block rests only in that state (`Resting.sweep`: the index's side in `_restable`, the policy's in
  its `rest`) and wakes as it was: its `Entry` and its policy record equal to those it had, so every
  decision of the policy is the one it would have made (tests/test_resting.py replays both).
- Whatever reads or changes a block finds it through `BlockIndex.get`, which wakes it first, and a
  policy wakes a parent it touches (`LeafQueues.find`): a block is never changed at rest. A lookup reads
  a row without waking it (`holds`); so do the KV events' resync and listings (`peek`).
- Resting and waking change no tally (the block is held in its tier all along) and report nothing to
  the listeners.
- The sweep looks at the blocks that entered the tier (demoted, committed, adopted: with their parents,
  which may have just gained their one child there) and at the ones woken since, a slice per turn of
  the daemon's loop; a block that is not in that state when its turn comes is passed over (it is looked
  at again if it wakes, enters the tier again or gains a child there).

A policy without `rest` (every one but the default) keeps its blocks as objects: nothing rests then.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

from kvstore.entry import _DEPTHS, CHILD, Entry, Key
from kvstore.eviction.base import EvictionPolicy
from kvstore.tiers.disk_slot import DiskSlot, plain

if TYPE_CHECKING:
    from kvstore.placement import Placement

# key, parent key, child key, depth, the location's offset, length and checksum (tiers/disk_slot.py), the
# block's last access (`Entry.last_access`), flags (ALIVE, HAS_PARENT)
ROW = struct.Struct("<24s24s24sIQIQdB")
KEY_BYTES = 24  # a store key: a namespace's tag and a block hash (kvstore/keys.py)
ALIVE, HAS_PARENT = 1, 2
CHUNK_BITS = 12  # rows per chunk: 2^12 (430 KB): the rows grow a chunk at a time, nothing is copied
# The hash table is 2^12 tables, each grown on its own (~2,500 rows at 10^7: a few ms, not seconds), each at
# its own load (GROW_AT, 0.35-0.5 by the table's number): tables grown at one load would all grow within a
# few thousand rests of each other, each time the rows double (at 10^7 rows one sweep's slice held the loop
# 127 ms).
SHARD_BITS = 12
GROW_AT = (0.35, 0.5)
MIN_SLOTS = 8
COMPACT_ABOVE = 4  # a table is made again at its size once it takes 4x what its entries need
DICT_SLOT_BYTES = 40  # what a dictionary's entry needs (24 B of entry, its index, the load factor)
_MASK64 = (1 << 64) - 1
_CHUNK_MASK = (1 << CHUNK_BITS) - 1
_SHARD_MASK = (1 << SHARD_BITS) - 1


class RestingRows:
    """Rows of `ROW` in chunks, two object references a row, and a hash table from key to row (linear
    probing, at most half full, deletion by backward shift: no tombstones). The table is keyed by the
    key's Python hash: only this process reads it."""

    def __init__(self) -> None:
        self._chunks: list[bytearray] = []
        self._refs: list[object] = []  # per row: the policy's two shared objects (2 r, 2 r + 1)
        self._free = array("q")  # rows given back, reused first
        self._high = 0  # rows ever handed out
        self.count = 0
        self._tables = [array("i", bytes(4 * MIN_SLOTS)) for _ in range(1 << SHARD_BITS)]  # row + 1, 0: empty
        self._used = [0] * (1 << SHARD_BITS)
        lo, hi = GROW_AT
        self._grow_at = [lo + (hi - lo) * ((s * 0x9E3779B1) & 0xFFFF) / 0xFFFF for s in range(1 << SHARD_BITS)]

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """The bytes of its rows, references and tables."""
        return (len(self._chunks) * (ROW.size << CHUNK_BITS) + 8 * len(self._refs) + self._free.itemsize
                * len(self._free) + sum(4 * len(t) for t in self._tables))

    def _key_at(self, row: int) -> bytes:
        o = (row & _CHUNK_MASK) * ROW.size
        return bytes(self._chunks[row >> CHUNK_BITS][o : o + KEY_BYTES])

    def find(self, key: Key) -> int:
        """`key`'s row, or -1."""
        h = hash(key)
        table = self._tables[h & _SHARD_MASK]
        mask = len(table) - 1
        i = (h >> SHARD_BITS) & mask
        chunks, size = self._chunks, ROW.size
        while r := table[i]:
            r -= 1
            o = (r & _CHUNK_MASK) * size
            if chunks[r >> CHUNK_BITS][o : o + KEY_BYTES] == key:
                return r
            i = (i + 1) & mask
        return -1

    def add(self, key: Key, parent: Key | None, child: Key, depth: int, location: int, last_access: float,
            refs: tuple[object, object]) -> int:
        """A row for `key` (not held yet); its row number."""
        if len(key) != KEY_BYTES or (parent is not None and len(parent) != KEY_BYTES) or len(child) != KEY_BYTES:
            raise ValueError("a resting block's keys are store keys of 24 bytes")
        if self._free:
            row = self._free.pop()
        else:
            row = self._high
            if row >> CHUNK_BITS == len(self._chunks):
                self._chunks.append(bytearray(ROW.size << CHUNK_BITS))
                self._refs.extend([None] * (2 << CHUNK_BITS))
            self._high += 1
        ROW.pack_into(self._chunks[row >> CHUNK_BITS], (row & _CHUNK_MASK) * ROW.size, key, parent or b"", child,
                      depth, location >> 96, (location >> 64) & 0xFFFFFFFF, location & _MASK64, last_access,
                      ALIVE | (HAS_PARENT if parent is not None else 0))
        self._refs[2 * row], self._refs[2 * row + 1] = refs
        self._insert(hash(key), row)
        self.count += 1
        return row

    def read(self, row: int) -> tuple:
        """(key, parent or None, child, depth, location, last_access, refs) of a live row."""
        key, parent, child, depth, offset, length, checksum, last_access, flags = ROW.unpack_from(
            self._chunks[row >> CHUNK_BITS], (row & _CHUNK_MASK) * ROW.size)
        location = ((offset << 32 | length) << 64) | checksum
        return (key, parent if flags & HAS_PARENT else None, child, depth, location, last_access,
                (self._refs[2 * row], self._refs[2 * row + 1]))

    def take(self, row: int) -> tuple:
        """`read(row)`, and the row goes."""
        out = self.read(row)
        self._delete(hash(out[0]), row)
        self._chunks[row >> CHUNK_BITS][(row & _CHUNK_MASK) * ROW.size + ROW.size - 1] = 0  # (not ALIVE)
        self._refs[2 * row] = self._refs[2 * row + 1] = None
        self._free.append(row)
        self.count -= 1
        return out

    def rows(self) -> Iterator[int]:
        """The live rows, in row order (a row added or taken meanwhile may or may not be seen)."""
        size, last = ROW.size, ROW.size - 1
        for row in range(self._high):
            if self._chunks[row >> CHUNK_BITS][(row & _CHUNK_MASK) * size + last] & ALIVE:
                yield row

    # -- the table ------------------------------------------------------------------------------------
    def _insert(self, h: int, row: int) -> None:
        s = h & _SHARD_MASK
        table = self._tables[s]
        if self._used[s] + 1 > self._grow_at[s] * len(table):
            table = self._tables[s] = self._grown(table)
        mask = len(table) - 1
        i = (h >> SHARD_BITS) & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = row + 1
        self._used[s] += 1

    def _grown(self, table: array) -> array:
        new = array("i", bytes(8 * len(table)))
        mask = len(new) - 1
        for r in table:
            if r:
                i = (hash(self._key_at(r - 1)) >> SHARD_BITS) & mask
                while new[i]:
                    i = (i + 1) & mask
                new[i] = r
        return new

    def _delete(self, h: int, row: int) -> None:
        s = h & _SHARD_MASK
        table = self._tables[s]
        mask = len(table) - 1
        i = (h >> SHARD_BITS) & mask
        while table[i] != row + 1:
            i = (i + 1) & mask
        j = i
        while True:  # backward shift: move back each entry of the run that may no longer be found past the gap
            j = (j + 1) & mask
            r = table[j]
            if not r:
                break
            home = (hash(self._key_at(r - 1)) >> SHARD_BITS) & mask
            if (home <= i < j) or (j < home <= i) or (i < j < home):
                table[i] = r
                i = j
        table[i] = 0
        self._used[s] -= 1


def _never(key: Key) -> bool:
    return False


class Resting:
    """Puts the plain blocks of `tier` to rest and wakes them (module docstring). The index and the
    tier's policy call it through their hooks (`BlockIndex.wake`, `LeafQueues.wake`); placement notes
    the blocks that enter the tier (`arrived`)."""

    def __init__(self, placement: Placement, tier: str = "disk", busy: Callable[[Key], bool] | None = None) -> None:
        """`busy(key)`: a part holds `key`'s entry across awaits (a compaction), so it does not rest."""
        self.index, self.policy, self.tier = placement.index, placement.policies[tier], tier
        self.rows = RestingRows()
        self.arrived: deque[Key] = deque()  # blocks to look at: entered the tier, or woken
        self.later: deque[Key] = deque()  # blocks whose write was pending: looked at again at the next poll
        self.on = type(self.policy).rest is not EvictionPolicy.rest
        self.rested = self.woken = 0
        self.busy = busy or _never
        self._one_child = CHILD[tier]
        if self.on:
            self.index.wake = self.wake
            self.index.resting = self
            self.policy.wake_hook(self._wake_record, self.holds)
            placement.rest_tier, placement.arrived = tier, self.arrived

    def __len__(self) -> int:
        return self.rows.count

    def stats(self) -> dict:
        return {"blocks": self.rows.count, "bytes": self.rows.nbytes, "rested": self.rested, "woken": self.woken,
                "to_look_at": len(self.arrived) + len(self.later)}

    def requeue(self) -> None:
        """The blocks whose write was still pending at their turn are looked at again (kvstore/background.py
        calls it every REST_POLL_S)."""
        self.arrived.extend(self.later)
        self.later.clear()

    # -- to rest --------------------------------------------------------------------------------------
    def sweep(self, budget: int) -> int:
        """Look at up to `budget` of the blocks noted; put those in the state to rest; how many rested."""
        if not self.on:
            self.arrived.clear()
            return 0
        arrived, entries, rest, add, busy = self.arrived, self.index.entries, self.policy.rest, self.rows.add, self.busy
        done = 0
        for _ in range(min(budget, len(arrived))):
            key = arrived.popleft()
            e = entries.get(key)
            if e is None or not self._restable(e) or busy(key):
                continue
            location = plain(e.location)
            if location is None:  # (its write still pending: looked at again at the next poll)
                if type(e.location) is DiskSlot and e.location.job is not None:
                    self.later.append(key)
                continue
            refs = rest(key, e.parent)
            if refs is None:
                continue
            del entries[key]
            add(key, e.parent, e.child_keys, e.depth, location, e.last_access, refs)
            done += 1
        self.rested += done
        if done:
            self._compact()
        return done

    def _compact(self) -> None:
        """The index's table (and the policy's) made again at its size where it holds a small share of what
        it held: CPython never shrinks a dictionary, and a table of 10^7 blocks woken (a check) and put to
        rest again would keep ~0.7 GB of empty slots."""
        index = self.index
        if sys.getsizeof(index.entries) > COMPACT_ABOVE * (len(index.entries) + 1024) * DICT_SLOT_BYTES:
            index.entries = dict(index.entries)
        self.policy.compact()

    def _restable(self, e: Entry) -> bool:
        """The index's side of the state to rest: committed, in the tier, unpinned, nothing rare (no
        estimate, copies, tokens or hits), one child, in the same tier (and, `sweep`, a location that is
        a plain int or has one: tiers/disk_slot.py `plain`)."""
        return (e.tier == self.tier and e.last_access is not None and not e.pins and e.rare is None
                and e.tier_children == self._one_child and type(e.child_keys) is bytes)

    # -- waking ---------------------------------------------------------------------------------------
    def holds(self, key: Key) -> bool:
        """`key` rests here (a committed block of the tier), read without waking it."""
        return self.rows.count > 0 and self.rows.find(key) >= 0

    def wake(self, key: Key) -> Entry | None:
        """`key`'s entry, woken (its policy record too), or None where it does not rest here."""
        if not self.rows.count:
            return None
        row = self.rows.find(key)
        return None if row < 0 else self._wake_row(key, row)

    def _wake_row(self, key: Key, row: int) -> Entry:
        """`key`'s entry and policy record again, from its `row`, which goes."""
        _, parent, child, depth, location, last_access, refs = self.rows.take(row)
        entries = self.index.entries
        if parent is not None and (pe := entries.get(parent)) is not None:
            parent = pe.key  # (the key objects the index holds already)
        if (ce := entries.get(child)) is not None:
            child = ce.key
        e = entries[key] = self._made(key, parent, child, _DEPTHS.setdefault(depth, depth), location, last_access)
        self.policy.restore(key, parent, refs)
        self.arrived.append(key)  # (it may rest again, if nothing changes it)
        self.woken += 1
        return e

    def _made(self, key: Key, parent: Key | None, child: Key, depth: int, location: int,
              last_access: float) -> Entry:
        """The entry of a resting block, from its row's fields."""
        return Entry(key, parent, depth, self.tier, location, tier_children=self._one_child, child_keys=child,
                     last_access=last_access)

    def _wake_record(self, key: Key) -> object | None:
        return None if self.wake(key) is None else True

    def keys(self) -> list[Key]:
        """The keys of the resting blocks."""
        key_at = self.rows._key_at
        return [key_at(row) for row in self.rows.rows()]

    def wake_all(self) -> int:
        """Wake every resting block (a check, `iter_entries`: what walks every entry); how many."""
        rows = list(self.rows.rows())
        key_at = self.rows._key_at
        for row in rows:
            self._wake_row(key_at(row), row)
        return len(rows)

    def peek(self, key: Key) -> Entry | None:
        """An entry equal to the one `key` would wake as, not held by the index (the KV events' resync,
        listings): None where it does not rest here."""
        row = self.rows.find(key) if self.rows.count else -1
        return None if row < 0 else self._entry(row)

    def _entry(self, row: int) -> Entry:
        return self._made(*self.rows.read(row)[:6])

    def root_keys(self) -> list[Key]:
        """The keys of the resting blocks without a parent."""
        read = self.rows.read
        return [row[0] for row in map(read, list(self.rows.rows())) if row[1] is None]

    def peek_all(self) -> Iterator[Entry]:
        """`peek` of every resting block."""
        return map(self._entry, self.rows.rows())
