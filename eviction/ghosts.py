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
import threading
from typing import Hashable

import numpy as np

MIN_FREE = 2048  # free log positions after a compaction at least (it costs ~0.1 ms however small)
MAPPED_FROM = 64 << 10  # an array of this many bytes or more is a mapping of its own (`_mapped`)
# A compaction of more live ghosts than MOVE_STEP moves them MOVE_STEP at a time, every MOVE_EVERY puts
# (`Ghosts._compact`): ~256 a put, so all have moved after 1/128 of the puts the new log has room for.
MOVE_STEP = 16_384
MOVE_EVERY = 64
# The moves write the new table's slots at random, and a first write to each of its pages (64 MB for 2^22
# ghosts) made the first step 25-33 ms: first its pages are faulted in, FAULT_STEP bytes a put.
FAULT_STEP = 1 << 20

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

    __slots__ = ("width", "_record", "_val", "_find_in", "_head", "_tail", "_n", "_old", "_puts")

    def __init__(self, width: int = 1) -> None:
        if width < 1:
            raise ValueError("width must be at least 1")
        self.width = width
        self._record = struct.Struct(f"{width}d")
        self._old: list | None = None  # a compaction's arrays while their ghosts move (`_migrate`)
        self._puts = 0  # puts since the last step of a migration
        self._layout(MIN_FREE, np.zeros(0, np.int64), np.zeros((0, width)))

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: Hashable) -> bool:
        h = hash(key)
        return self._probe(h)[1] != 0 or (self._old is not None and self._probe_old(h) >= 0)

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (and of the arrays a compaction is moving its ghosts out of)."""
        slots, fp, live, _ = self._find_in
        moving = 0 if self._old is None else sum(a.nbytes for a in self._old[:3]) + self._old[4].nbytes
        return slots.nbytes + fp.nbytes + live.nbytes + self._val.nbytes + moving

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
        if self._old is not None:  # (a ghost not moved yet: in the arrays being compacted)
            q = self._probe_old(h)
            if q >= 0:
                live_o, val_o = self._old[2], self._old[4]
                live_o[q] = 0
                self._n -= 1
                return val_o[q] if self.width == 1 else self._record.unpack_from(val_o, q * self._record.size)
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
        elif self._old is not None and (q := self._probe_old(h)) >= 0:  # remembered, not moved yet: kept there
            self._write(self._old[4], q, value)
            self._moved_put(limit)
            return
        else:  # not remembered: the newest, in the first free slot of its probe
            pos = self._tail
            if pos == len(live):
                self._compact()
                i, _ = self._probe(h)
                pos = self._tail
                slots, fp, live, _ = self._find_in
        try:  # the value first: a wrong width raises before anything changed (`_write`, inline)
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
        if self._old is not None:
            self._n = n
            self._moved_put(limit)
            return
        if limit is not None and n > limit:  # (`trim`, inline: a full table forgets one ghost a put)
            head = self._head
            while n > limit:
                if live[head]:
                    live[head] = 0
                    n -= 1
                head += 1
            self._head = head
        self._n = n

    def _write(self, val: memoryview, pos: int, value: float | tuple) -> None:
        try:
            if self.width == 1:
                val[pos] = value  # type: ignore[assignment]
            else:
                record = self._record
                record.pack_into(val, pos * record.size, *value)  # type: ignore[misc]
        except (struct.error, TypeError) as exc:
            raise ValueError(f"a ghost of this table is {self.width} floats: {exc}") from None

    def trim(self, limit: float) -> None:
        """Forget the oldest ghosts until at most `limit` are left."""
        live, head, n = self._find_in[2], self._head, self._n
        while n > limit:
            old = self._old
            if old is not None and head == old[6]:  # the oldest is one a compaction kept and has not moved
                if self._forget_unmoved():
                    n -= 1
                    head += 1  # (the place kept for it stays empty)
                continue
            if live[head]:
                live[head] = 0
                n -= 1
            head += 1
        self._head, self._n = head, n

    # -- compaction: the live ghosts into fresh arrays, moved a step at a time when they are many ----------
    def _moved_put(self, limit: float | None) -> None:
        """The rest of a put while a compaction's ghosts move: `trim(limit)`, and a step of the move
        every MOVE_EVERY puts, once the new table's pages are in (FAULT_STEP bytes of them a put)."""
        if limit is not None and self._n > limit:
            self.trim(limit)
        old = self._old
        if old is None:  # (the trim forgot the last kept ghosts not moved)
            return
        slots = self._find_in[0]
        if old[8] < slots.nbytes:
            old[8] = _fault_in(slots, old[8], FAULT_STEP)
            return
        self._puts += 1
        if self._puts >= MOVE_EVERY:
            self._puts = 0
            self._migrate(MOVE_STEP)

    def _probe_old(self, h: int) -> int:
        """The position, in the arrays being compacted, of the live ghost with fingerprint `h` not moved
        yet; -1 if none."""
        return self._probe(h, self._old[:4])[1] - 1  # type: ignore[index]

    def _migrate(self, count: int) -> None:
        """Move the next `count` live ghosts the compaction kept, oldest first, to the next places in the
        new arrays, and into the new table; the old arrays go once all have moved. The old log is scanned
        as they move (from `old[5]`), so a compaction makes no list of them."""
        old = self._old
        assert old is not None
        _, fp_o, live_o, _, val_o, q, moved, end, _ = old
        live_a = np.frombuffer(live_o, np.uint8)
        qs, q = _live_from(live_a, q, end, count)
        got = len(qs)
        if got:
            ps = np.arange(moved, moved + got, dtype=np.int64)
            slots, fp, live, mask = self._find_in
            w = self.width
            fps = np.frombuffer(fp_o, np.int64)[qs]
            np.frombuffer(fp, np.int64)[ps] = fps
            np.frombuffer(self._val, np.float64).reshape(-1, w)[ps] = \
                np.frombuffer(val_o, np.float64).reshape(-1, w)[qs]
            np.frombuffer(live, np.uint8)[ps] = 1
            live_a[qs] = 0  # (moved: the old table no longer answers for them)
            _place(np.frombuffer(slots, np.int32), fps & mask, ps, mask)
        old[5], old[6] = q, moved + got
        if q == end:
            self._moved_all()

    def _forget_unmoved(self) -> bool:
        """Forget the oldest ghost the compaction kept and has not moved (`trim` meets it): its place in
        the new arrays is passed over. False if none is left (the old arrays go)."""
        old = self._old
        live_o, end = old[2], old[7]
        qs, q = _live_from(np.frombuffer(live_o, np.uint8), old[5], end, 1)  # (past those popped before they moved)
        if not len(qs):
            self._moved_all()
            return False
        live_o[int(qs[0])] = 0
        old[5], old[6] = q, old[6] + 1
        if q == end:
            self._moved_all()
        return True

    def _moved_all(self) -> None:
        """Every kept ghost has moved (or was forgotten): the old arrays are unmapped off the loop (~70 ms
        for 300 MB)."""
        old, self._old = self._old, None
        threading.Thread(target=_unmap, args=(old[:3] + old[4:5],), name="kvstore-ghosts-unmap",
                         daemon=True).start()

    def _probe(self, h: int, find_in: tuple | list | None = None) -> tuple[int, int]:
        """(slot, its entry) of the live ghost with fingerprint `h`; else (the first free slot of its
        probe, 0). In `find_in` (a table, its log's fingerprints and live bytes, its mask) if given, else
        in the current arrays."""
        slots, fp, live, mask = self._find_in if find_in is None else find_in
        i = h & mask
        while s := slots[i]:
            if fp[s - 1] == h and live[s - 1]:
                return i, s
            i = (i + 1) & mask
        return i, 0

    def _compact(self) -> None:
        """The live ghosts, in order, at the start of a log of 1.5 times as many positions (at least
        MIN_FREE more). Past MOVE_STEP of them they are not moved at once (a table of 2^22 ghosts took
        0.5 s, with the daemon's loop stopped): their places are kept at the start of the new log and
        they move MOVE_STEP at a time, every MOVE_EVERY puts (`_migrate`), while the old arrays answer
        for those not moved yet. They have all moved long before the new log's free positions are used.
        Nothing here is as long as the log: listing the kept ghosts' positions (two arrays of 8 B a ghost,
        on fresh pages) held the loop 110-380 ms at 2^22; `_migrate` finds them in the old log as they move."""
        if self._old is not None:  # (the last compaction's ghosts, all moved first)
            self._migrate(self._old[7] - self._old[5])
        _, fp, live, _ = self._find_in
        head, tail = self._head, self._tail
        kept = np.frombuffer(live, np.bool_)[head:tail]  # (live bytes are 0 or 1)
        n = int(np.count_nonzero(kept))
        if n <= MOVE_STEP:
            fps = np.frombuffer(fp, np.int64)[head:tail][kept]
            vals = np.frombuffer(self._val, np.float64).reshape(-1, self.width)[head:tail][kept]
            self._layout(n + max(n // 2, MIN_FREE), fps, vals)
            return
        # The old arrays, where the next to move is (from `head`), how many have their places, the old log's
        # end, and how many bytes of the new table are faulted in (`_moved_put`).
        old = [*self._find_in, self._val, head, 0, tail, 0]
        self._layout(n + max(n // 2, MIN_FREE), np.zeros(0, np.int64), np.zeros((0, self.width)))
        self._tail = self._n = n  # (positions 0..n-1: the kept ghosts' places, filled as they move)
        self._old, self._puts = old, 0

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
        _place(np.frombuffer(slots, np.int32), fps & mask, np.arange(n), mask)
        self._find_in = (slots, fp, live, mask)  # what a lookup reads, in one attribute
        self._val = val
        self._head, self._tail, self._n = 0, n, n


def _place(table: np.ndarray, want: np.ndarray, positions: np.ndarray, mask: int) -> None:
    """Log `positions` into `table` (a slot holds a position + 1), each ghost from its home slot `want`:
    linear probing, all at once. In each round every ghost still waiting asks for its next slot, and one
    of those asking for a free slot gets it (of two writes to one slot, the last stays)."""
    want = want.copy()
    waiting = np.arange(len(positions))
    while len(waiting):
        at = want[waiting]
        free = table[at] == 0
        table[at[free]] = positions[waiting[free]] + 1
        waiting = waiting[table[at] != positions[waiting] + 1]
        want[waiting] = (want[waiting] + 1) & mask


def _live_from(live: np.ndarray, q: int, end: int, count: int) -> tuple[np.ndarray, int]:
    """The positions of the next `count` live ghosts from `q` on (fewer where `end` comes first), and where
    the scan stopped: past the last one found, or at `end`."""
    parts, got = [], 0
    while got < count and q < end:
        stop = min(q + max(2 * (count - got), 4096), end)  # (two thirds of a log's positions are live, or more)
        idx = np.flatnonzero(live[q:stop])
        if len(idx) > count - got:
            idx = idx[: count - got]
            stop = q + int(idx[-1]) + 1
        parts.append(idx + q)
        got += len(idx)
        q = stop
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), q


def _fault_in(view: memoryview, start: int, step: int) -> int:
    """Write every page of `view`'s bytes from `start` on, `step` bytes of them, with the byte it holds
    (faulting each in, changing none); where it stopped."""
    pages = np.frombuffer(view, np.uint8)[start : start + step : mmap.PAGESIZE]
    pages |= 0
    return min(start + step, view.nbytes)


def _unmap(views: list) -> None:
    """Unmap the mappings under `views` (in a thread of its own: munmap does not hold the GIL); a view on
    the heap, or one still exported, is only dropped."""
    for view in views:
        base = view.obj
        try:
            view.release()
            if isinstance(base, mmap.mmap):
                base.close()
        except BufferError:
            pass


def _mapped(count: int, fmt: str) -> memoryview:
    """`count` zeroed items of struct format `fmt` in an anonymous mapping (unmapped with the last view);
    under MAPPED_FROM bytes on the heap: a policy starts seven small tables (its own and its half-life
    experts' six), and a mapping each would be 28 of the process's 65,530 (vm.max_map_count) a policy."""
    size = max(1, count) * struct.calcsize(fmt)
    return memoryview(mmap.mmap(-1, size) if size >= MAPPED_FROM else bytearray(size)).cast(fmt)
