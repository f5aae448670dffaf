"""The block records a persistent tier found at open, as columns: `Recovered`, one row a record.

A disk tier of 10^7 blocks hands 10^7 records to a restart's recovery (kvstore/recovery.py), which
adopts them over minutes while the daemon serves. As a Python object each (a `RecoveredBlock`, its
parent's hash, its time, a slot in a table of records waiting and one in a table of children waiting)
they held ~600 B a record at their peak, and once freed among the blocks adopted meanwhile most of that
memory stayed with the daemon (a restarted daemon of 10^7 blocks was at 10.3 GB where the one stopped
had 4.1). Here a record is a row of flat arrays, outside Python's small-object heap: its key, its
parent's hash, size, location, estimate and time, and the 64-bit hash of its key that the recovery finds
rows by. A key of another length and a location that is not a plain int (tiers/disk_slot.py: a host
block's extents, a disk block stored encoded) are kept as objects, by row. Reading a row's key or
location makes it (`keys[row]`, `locations[row]`): the objects the block index keeps are made when a
block is adopted, and those of a block put to rest go again at once (kvstore/resting.py), so a restart
leaves no scattered objects of its records behind (the keys and ints of 10^7 records, ~120 B a record,
kept a restarted daemon at ~270 B a block where the one stopped had ~183).
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator, Sequence

import numpy as np

from kvstore.keys import HASH_BYTES, ROOT_HASH, TAG_BYTES, Key
from kvstore.tiers.base import RecoveredBlock

_NO_ESTIMATE = float("nan")  # a record without an attention estimate (`estimate` gives None for it)
KEY_BYTES = TAG_BYTES + HASH_BYTES  # a store key (kvstore/keys.py)
_MASK64 = (1 << 64) - 1


class Keys:
    """The records' keys: KEY_BYTES a row in one column, a key of another length by its row."""

    __slots__ = ("col", "odd")

    def __init__(self) -> None:
        self.col = bytearray()
        self.odd: dict[int, bytes] = {}

    def append(self, key: bytes) -> None:
        if len(key) == KEY_BYTES:
            self.col += key
        else:
            self.odd[len(self.col) // KEY_BYTES] = key
            self.col += bytes(KEY_BYTES)

    def __getitem__(self, row: int) -> Key:
        if self.odd and row in self.odd:
            return self.odd[row]
        return bytes(self.col[row * KEY_BYTES : (row + 1) * KEY_BYTES])

    def __len__(self) -> int:
        return len(self.col) // KEY_BYTES

    def __iter__(self) -> Iterator[Key]:
        return map(self.__getitem__, range(len(self)))

    def match(self, rows: np.ndarray, keys: list[Key]) -> np.ndarray:
        """Whether each row of `rows` (-1: none) holds the key at its place in `keys`, as a bool array (one
        array comparison where they are all column keys: 130,000 compared one by one held the loop 0.13 s)."""
        rows = np.asarray(rows, np.int64)
        if self.odd or any(len(k) != KEY_BYTES for k in keys):
            return _match_each(self, rows, keys)
        col = np.frombuffer(self.col, np.uint8).reshape(-1, KEY_BYTES)
        want = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, KEY_BYTES)
        return (rows >= 0) & (col[np.maximum(rows, 0)] == want).all(axis=1) if len(col) else rows >= 0

    def take(self, rows: np.ndarray, at: dict[int, int]) -> "Keys":
        """The keys of `rows`, in that order; `at`: old row -> new row, for the odd keys."""
        out = Keys()
        out.col = bytearray(np.frombuffer(self.col, np.uint8).reshape(-1, KEY_BYTES)[rows].tobytes())
        out.odd = {at[old]: k for old, k in self.odd.items() if old in at}
        return out


def _match_each(column: "Keys | KeyList", rows: np.ndarray, keys: list[Key]) -> np.ndarray:
    """`match`, a key at a time."""
    return np.array([r >= 0 and column[r] == k for r, k in zip(np.asarray(rows).tolist(), keys)], bool)


class KeyList(list):
    """The records' keys as the objects the tier keys its own records by (the host arena's records table):
    the block index then keeps those very objects, one key object a block."""

    odd: dict[int, bytes] = {}  # (none: read only)

    def match(self, rows: np.ndarray, keys: list[Key]) -> np.ndarray:
        return _match_each(self, rows, keys)

    def take(self, rows: np.ndarray, at: dict[int, int]) -> "KeyList":
        return KeyList(self[i] for i in rows.tolist())


class Locations:
    """The records' locations: a plain-int disk location (tiers/disk_slot.py, `(offset << 32 | length) << 64
    | checksum`) as three columns, any other location (an object) by its row."""

    __slots__ = ("offsets", "lengths", "checksums", "odd")

    def __init__(self) -> None:
        self.offsets, self.lengths, self.checksums = array("Q"), array("I"), array("Q")
        self.odd: dict[int, object] = {}

    def append(self, location: object) -> None:
        if type(location) is int and 0 <= location < 1 << 160:
            self.offsets.append(location >> 96)
            self.lengths.append((location >> 64) & 0xFFFFFFFF)
            self.checksums.append(location & _MASK64)
        else:
            self.odd[len(self.offsets)] = location
            self.offsets.append(0)
            self.lengths.append(0)
            self.checksums.append(0)

    def __getitem__(self, row: int) -> object:
        if self.odd and row in self.odd:
            return self.odd[row]
        return (self.offsets[row] << 32 | self.lengths[row]) << 64 | self.checksums[row]

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self) -> Iterator[object]:
        return map(self.__getitem__, range(len(self)))

    def take(self, rows: np.ndarray, at: dict[int, int]) -> "Locations":
        out = Locations()
        for name in ("offsets", "lengths", "checksums"):
            col = getattr(self, name)
            setattr(out, name, array(col.typecode, np.frombuffer(col, col.typecode)[rows].tobytes()))
        out.odd = {at[old]: loc for old, loc in self.odd.items() if old in at}
        return out


class Recovered:
    """Block records, a row each, in the order a tier found them. `append` takes a record's fields and
    checks their types (a TypeError or ValueError for one that is not a record: the scan's bad record);
    `row(i)` gives one back as a `RecoveredBlock`, and iterating gives them all (tests, tools); `keys[i]` and
    `locations[i]` a row's key and location."""

    __slots__ = ("keys", "locations", "parents", "nbytes", "attention", "stamps", "fps", "_odd_parents", "_finder")

    def __init__(self, key_objects: bool = False) -> None:
        """`key_objects`: the keys kept as the objects appended (`KeyList`), not as a column."""
        self.keys: Keys | KeyList = KeyList() if key_objects else Keys()
        self.locations = Locations()  # the tier's location of each
        self.parents = bytearray()  # HASH_BYTES a row: the parent's hash, ROOT_HASH for a root
        self.nbytes = array("q")
        self.attention = array("d")  # NaN: none
        self.stamps = array("d")  # when the block reached the tier (wall clock), 0.0 where unknown
        self.fps = array("q")  # hash(key): what `find` looks keys up by
        self._odd_parents: dict[int, bytes] = {}  # row -> a parent hash of another length (its bytes zero)
        self._finder: RowFinder | None = None

    def finder(self) -> "RowFinder":
        """The rows by key (made at the first call, a scan's in its own thread; made again where rows
        were appended since)."""
        if self._finder is None or self._finder.rows != len(self.keys):
            self._finder = RowFinder(self)
        return self._finder

    @classmethod
    def of(cls, blocks: Iterable[RecoveredBlock]) -> "Recovered":
        out = cls()
        for b in blocks:
            out.append(b)
        return out

    @staticmethod
    def normal(record: tuple | RecoveredBlock) -> tuple:
        """`record`, (key, parent hash, size, location, attention estimate, stamp) as a `RecoveredBlock`'s
        fields, as `append` stores it (no estimate: NaN); a TypeError or ValueError for a field of the
        wrong type or range (a scan's bad record)."""
        key, parent, nbytes, location, attention, stamp = record
        if type(key) is not bytes:
            raise TypeError("a key that is no bytes")
        if type(nbytes) is not int or not 0 <= nbytes < 1 << 62:
            raise ValueError("a size that is no int of 0 to 2^62")
        if not isinstance(stamp, (int, float)) or not (attention is None or isinstance(attention, (int, float))):
            raise TypeError("a time or an attention estimate that is no number")
        estimate, stamp = _NO_ESTIMATE if attention is None else float(attention), float(stamp)
        if parent is None or parent == b"":
            parent = ROOT_HASH
        elif type(parent) is not bytes:
            raise TypeError("a parent hash that is no bytes")
        return key, parent, nbytes, location, estimate, stamp

    def append(self, record: tuple | RecoveredBlock) -> None:
        """One more record (`normal`); nothing is added where it raises."""
        key, parent, nbytes, location, estimate, stamp = self.normal(record)
        row = len(self.keys)
        if len(parent) == HASH_BYTES:
            self.parents += parent
        else:
            self._odd_parents[row] = parent
            self.parents += bytes(HASH_BYTES)
        self.nbytes.append(nbytes)
        self.attention.append(estimate)
        self.stamps.append(stamp)
        self.fps.append(hash(key))
        self.keys.append(key)
        self.locations.append(location)

    def __len__(self) -> int:
        return len(self.keys)

    def parent_hash(self, row: int) -> bytes | bytearray | None:
        """The parent hash of `row`'s record, None for a root; a slice of the column (a key is made of
        it: `tag + h`), `parent` as bytes."""
        if self._odd_parents and row in self._odd_parents:
            return self._odd_parents[row]
        h = self.parents[row * HASH_BYTES : (row + 1) * HASH_BYTES]
        return None if h == ROOT_HASH else h

    def parent(self, row: int) -> bytes | None:
        h = self.parent_hash(row)
        return None if h is None else bytes(h)

    def estimate(self, row: int) -> float | None:
        a = self.attention[row]
        return None if a != a else a

    def row(self, row: int) -> RecoveredBlock:
        return RecoveredBlock(self.keys[row], self.parent(row), self.nbytes[row], self.locations[row],
                              self.estimate(row), self.stamps[row])

    def __iter__(self) -> Iterator[RecoveredBlock]:
        return map(self.row, range(len(self.keys)))

    def take(self, rows: Sequence[int] | np.ndarray) -> "Recovered":
        """The records of `rows`, in that order."""
        out = Recovered()
        rows = np.asarray(rows, dtype=np.int64)
        parents = np.frombuffer(self.parents, np.uint8).reshape(-1, HASH_BYTES)
        out.parents = bytearray(parents[rows].tobytes())
        for name in ("nbytes", "attention", "stamps", "fps"):
            col = getattr(self, name)
            setattr(out, name, array(col.typecode, np.frombuffer(col, col.typecode)[rows].tobytes()))
        at = ({int(old): new for new, old in enumerate(rows.tolist())}
              if self._odd_parents or self.keys.odd or self.locations.odd else {})
        out.keys, out.locations = self.keys.take(rows, at), self.locations.take(rows, at)
        if self._odd_parents:
            out._odd_parents = {at[old]: h for old, h in self._odd_parents.items() if old in at}
        return out


class RowFinder:
    """The rows of `Recovered` records by key: their key hashes sorted once (NumPy's sort, which lets the
    event loop run: it is made in the scan's thread), then a binary search per key, checked against the
    row's key (two keys of one 64-bit hash: the lower row is found, the other is not)."""

    __slots__ = ("_keys", "_sorted", "_order", "rows")

    def __init__(self, records: Recovered) -> None:
        fps = np.frombuffer(records.fps, np.int64) if len(records) else np.zeros(0, np.int64)
        self._order = np.argsort(fps, kind="stable")
        self._sorted = fps[self._order]
        self._keys = records.keys
        self.rows = len(records)

    def find(self, key: Key) -> int:
        """The row of `key`; -1 if no record has it."""
        h = hash(key)
        i = int(np.searchsorted(self._sorted, h))
        sorted_, order, keys = self._sorted, self._order, self._keys
        while i < len(sorted_) and sorted_[i] == h:
            row = int(order[i])
            if keys[row] == key:
                return row
            i += 1
        return -1

    def find_many(self, hashes: np.ndarray) -> np.ndarray:
        """For each of `hashes`, the row of the first record with that key hash, -1 where none (the
        caller checks the key)."""
        if not len(self._sorted):
            return np.full(len(hashes), -1, np.int64)
        # (in the hashes' order: NumPy's search starts each from the last one's place, and a search of
        # 130,000 hashes in 10^7 in their own order held the event loop 0.33 s)
        order = np.argsort(hashes)
        at = np.empty(len(hashes), np.int64)
        at[order] = np.minimum(np.searchsorted(self._sorted, hashes[order]), len(self._sorted) - 1)
        return np.where(self._sorted[at] == hashes, self._order[at], -1)
