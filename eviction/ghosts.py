"""Ghosts: what a policy remembers of keys that left its tier, oldest first, in flat arrays.

A policy's history holds many more keys than its tier: the default policy keeps
up to 16 x its resident blocks (eviction/attention.py; LFU 4 x). As an
OrderedDict of keys a ghost cost ~120 B of table and node, and it kept the
key's tuple and hash bytes alive (~110 B) long after the block was gone: a tier
written through 20 times over held ~5.9 KB a resident block, most of it
history. The half-life experts' miniature caches (eviction/halflife.py) keep
their ghosts here too, one float each: as OrderedDicts they held ~1.1 KB a
resident block of a tier written through 12 times.

However large its tier, a table holds at most `MAX_GHOSTS` (a policy's
`max_ghosts`, below).

Here a ghost is the key's fingerprint (its 64-bit `hash`) and `width` floats,
appended to a log in the order they are remembered, with an open-addressing
table (linear probing, at most half full) from fingerprint to log position. A
ghost taken back (`pop`) or forgotten (`trim`, from the log's oldest end) is
only marked dead: its table slot stays until the log is full, and then the log
is rewritten with its live ghosts, in order, plus half as many free positions,
and the table rebuilt (both vectorised, amortised over the puts that filled
it; at least MIN_FREE of them, so a small table does not pay NumPy's per-call
cost every few puts). A position is 8 * width + 1 B (int64 fingerprint,
float64 values, a live byte) plus 8-16 B of table (int32 slots): a ghost costs
1-1.5 positions, about 50-85 B for the default policy's (4 floats).

Two keys with the same fingerprint share one ghost. With 64-bit hashes the odds
are about (ghosts held) / 2^64 per key remembered or looked up, and the cost is
one block's history credit, never a wrong byte: a policy ranks, it does not
index.
"""

from __future__ import annotations

import math
import mmap
import struct
from typing import Hashable

import numpy as np

MIN_FREE = 2048  # free log positions after a compaction at least (it costs ~0.1 ms however small)
MAPPED_FROM = 64 << 10  # an array of this many bytes or more is a mapping of its own (`_mapped`)

# The most ghosts a table holds whatever its tier's size: 16 x a tier of 10^7 blocks would be 1.6 x 10^8
# ghosts, ~10 GB of history for one tier. 2^22 ghosts are ~250 MB (50-85 B each, above) and cover the last
# 4 million evictions; the table of a tier under 262,144 blocks (at 16 x) never reaches it.
MAX_GHOSTS = 1 << 22


def ghost_cap(factor: float, most: float | None = None) -> float:
    """The cap on a history of `factor` x resident keys: `most` (MAX_GHOSTS if None); none
    (math.inf) for an infinite factor, which means "remember everything" (for evaluation)."""
    if most is not None and not most >= 0:
        raise ValueError(f"a history's cap must be >= 0, got {most}")
    return math.inf if factor == math.inf else MAX_GHOSTS if most is None else most


class Ghosts:
    """Fingerprints with `width` floats each, oldest first. `pop` gives a float when `width` is 1,
    else a tuple of `width` floats, exactly as put."""

    __slots__ = ("width", "_record", "_val", "_find_in", "_head", "_tail", "_n")

    def __init__(self, width: int = 1) -> None:
        if width < 1:
            raise ValueError("width must be at least 1")
        self.width = width
        self._record = struct.Struct(f"{width}d")
        self._layout(MIN_FREE, np.zeros(0, np.int64), np.zeros((0, width)))

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: Hashable) -> bool:
        return self._probe(hash(key))[1] != 0

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays."""
        slots, fp, live, _ = self._find_in
        return slots.nbytes + fp.nbytes + live.nbytes + self._val.nbytes

    def pop(self, key: Hashable, default: object = None) -> object:
        """What was remembered of `key`, forgotten now; `default` if nothing was."""
        h = hash(key)
        slots, fp, live, mask = self._find_in
        i = h & mask
        while s := slots[i]:  # (`_probe`, inline: a policy asks on every insert, and nearly always in vain)
            if fp[s - 1] == h and live[s - 1]:
                live[s - 1] = 0
                self._n -= 1
                if self.width == 1:
                    return self._val[s - 1]
                return self._record.unpack_from(self._val, (s - 1) * self._record.size)
            i = (i + 1) & mask
        return default

    def put(self, key: Hashable, value: float | tuple, limit: float | None = None) -> None:
        """Remember `value` for `key` as the newest ghost (a key already remembered keeps its place and
        takes the new value, as an OrderedDict's item would); then `trim(limit)` if given. A value of
        another width is a ValueError, and nothing changes."""
        h = hash(key)
        slots, fp, live, mask = self._find_in
        i = h & mask
        while s := slots[i]:  # (`_probe`, inline: the experts' miniatures remember an eviction a reference)
            if fp[s - 1] == h and live[s - 1]:
                break
            i = (i + 1) & mask
        if s:
            pos = s - 1
        else:  # not remembered: the newest, in the first free slot of its probe
            pos = self._tail
            if pos == len(live):
                self._compact()
                i, _ = self._probe(h)
                pos = self._tail
                slots, fp, live, _ = self._find_in
        try:  # the value first: a wrong width raises before anything changed
            if self.width == 1:
                self._val[pos] = value
            else:
                record = self._record
                record.pack_into(self._val, pos * record.size, *value)  # type: ignore[misc]
        except (struct.error, TypeError) as exc:
            raise ValueError(f"a ghost of this table is {self.width} floats: {exc}") from None
        n = self._n
        if not s:  # (a new ghost)
            self._tail = pos + 1
            slots[i] = pos + 1
            fp[pos] = h
            live[pos] = 1
            n += 1
        if limit is not None and n > limit:  # (`trim`, inline: a full table forgets one ghost a put)
            head = self._head
            while n > limit:
                if live[head]:
                    live[head] = 0
                    n -= 1
                head += 1
            self._head = head
        self._n = n

    def trim(self, limit: float) -> None:
        """Forget the oldest ghosts until at most `limit` are left."""
        live, head, n = self._find_in[2], self._head, self._n
        while n > limit:
            if live[head]:
                live[head] = 0
                n -= 1
            head += 1
        self._head, self._n = head, n

    def _probe(self, h: int) -> tuple[int, int]:
        """(slot, its entry) of the live ghost with fingerprint `h`; else (the first free slot of its
        probe, 0)."""
        slots, fp, live, mask = self._find_in
        i = h & mask
        while s := slots[i]:
            if fp[s - 1] == h and live[s - 1]:
                return i, s
            i = (i + 1) & mask
        return i, 0

    def _compact(self) -> None:
        """The live ghosts, in order, at the start of a log of 1.5 times as many positions (at least
        MIN_FREE more)."""
        _, fp, live, _ = self._find_in
        head, tail = self._head, self._tail
        kept = np.frombuffer(live, np.uint8)[head:tail].astype(bool)
        fps = np.frombuffer(fp, np.int64)[head:tail][kept]
        vals = np.frombuffer(self._val, np.float64).reshape(-1, self.width)[head:tail][kept]
        self._layout(len(fps) + max(len(fps) // 2, MIN_FREE), fps, vals)

    def _layout(self, positions: int, fps: np.ndarray, vals: np.ndarray) -> None:
        """Fresh arrays of `positions` holding the ghosts `fps`/`vals` first, and their table. Each large
        one is an anonymous mapping of its own: given back to the kernel as soon as a compaction drops it
        (freed heap memory of this size is not, and a churned daemon's RSS kept every generation's)."""
        n, w = len(fps), self.width
        size = 1 << (2 * positions - 1).bit_length()  # table slots: a power of two, at least twice the positions
        mask = size - 1
        slots, fp, live, val = _mapped(size, "i"), _mapped(positions, "q"), _mapped(positions, "B"), \
            _mapped(positions * w, "d")
        np.frombuffer(fp, np.int64)[:n] = fps
        np.frombuffer(val, np.float64)[:n * w] = vals.reshape(-1)
        np.frombuffer(live, np.uint8)[:n] = 1
        table = np.frombuffer(slots, np.int32)
        want = fps & mask  # linear probing, all at once: in each round every ghost still waiting asks
        waiting = np.arange(n)  # for its next slot, and one of those asking for a free slot gets it
        while len(waiting):
            at = want[waiting]
            free = table[at] == 0
            table[at[free]] = waiting[free] + 1  # (of two asking for one slot, one write is the last)
            waiting = waiting[table[at] != waiting + 1]
            want[waiting] = (want[waiting] + 1) & mask
        del table
        self._find_in = (slots, fp, live, mask)  # what a lookup reads, in one attribute
        self._val = val
        self._head, self._tail, self._n = 0, n, n


def _mapped(count: int, fmt: str) -> memoryview:
    """`count` zeroed items of struct format `fmt` in an anonymous mapping (unmapped with the last view);
    under MAPPED_FROM bytes on the heap: a policy starts seven small tables (its own and its half-life
    experts' six), and a mapping each would be 28 of the process's 65,530 (vm.max_map_count) a policy."""
    size = max(1, count) * struct.calcsize(fmt)
    return memoryview(mmap.mmap(-1, size) if size >= MAPPED_FROM else bytearray(size)).cast(fmt)
