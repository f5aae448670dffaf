"""What a restart's recovery (kvstore/recovery.py) keeps of each persistent tier while it adopts the tier's
records: the rows (tiers/recovered.py) and, per row, a state byte, its parent's row and its children's rows,
in arrays; the children grouped in a thread of their own (`Links`)."""

from __future__ import annotations

import gc
import threading
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from kvstore.tiers.base import Tier
from kvstore.tiers.recovered import Recovered

SORTING, PENDING, GONE = 0, 1, 2  # a record's state: not sorted yet; waiting for adoption; adopted or let go


@dataclass
class TierRecovery:
    """One tier's recovery in progress, stage by stage (`STAGES`). Its records are the rows of columns
    (tiers/recovered.py), and what the stages keep of a row is a byte and two ints in arrays: what waits
    for adoption is most of a restart's memory (10^7 disk records), and as objects a record was ~600 B
    that stayed with the daemon once freed."""

    tier: Tier
    kept_records: int = 0  # the block records the tier found at open
    stage: str = "scan"
    started: float = field(default_factory=time.monotonic)
    rows: Recovered = field(default_factory=Recovered)  # the records read (none while the tier scans)
    state: bytearray = field(default_factory=bytearray)  # per row: SORTING, PENDING or GONE
    parent_row: array = field(default_factory=lambda: array("q"))  # its parent's row, or -1
    kids: array | None = None  # the rows that have a parent row, grouped by it (once all are sorted)
    kids_at: array | None = None  # row p's children: kids[kids_at[p] : kids_at[p + 1]]
    links: Links | None = None  # kids and kids_at being made, once every row is sorted
    linking: np.ndarray | None = None  # then the rows with children not waiting for adoption (`_link_gone`)
    outside: dict = field(default_factory=dict)  # a parent key no row holds -> the row (or a list) waiting for it
    pos: int = 0  # the next row to sort (index stage), or of `orphan_rows` to free (orphans stage)
    sorted: int = 0  # rows sorted (in order, or first where a request named them)
    waiting: int = 0  # rows PENDING (orphans stage: orphans not freed yet)
    frontier: list = field(default_factory=list)  # PENDING rows whose parent was indexed
    copies: list = field(default_factory=list)  # rows of keys indexed in a faster tier
    stale: list = field(default_factory=list)  # rows a newer record replaced: pages freed once it is durable
    orphan_rows: np.ndarray | None = None
    adopted: int = 0
    early: dict = field(default_factory=dict)  # while the tier scans: key -> location of a block adopted so
    adopted_early: int = 0
    num_copies: int = 0
    orphans: int = 0
    dropped: int = 0

    def load(self, rows: Recovered) -> None:
        """The tier's records are read: they are sorted next."""
        self.rows = rows
        self.state = bytearray(len(rows))
        self.parent_row = array("q", bytes(8 * len(rows)))
        np.frombuffer(self.parent_row, np.int64)[:] = -1
        self.stage = "index"

    def children(self, row: int) -> array | tuple:
        """The rows whose parent is `row` (none before all rows are sorted)."""
        if self.kids is None:
            return ()
        at = self.kids_at
        return self.kids[at[row] : at[row + 1]]  # type: ignore[index]


class Links:
    """The rows that have a parent row, grouped by it (kids, and where each row's run starts: kids_at), and
    whether a row has any, made in a thread of its own: NumPy's sort of 10^7 rows takes seconds and lets
    the event loop run meanwhile. Every row is sorted (`parent_row` no longer changes)."""

    def __init__(self, parent_row: array) -> None:
        self._parent_row = parent_row
        self._made: tuple | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="kvstore-recovery-links", daemon=True).start()

    def _run(self) -> None:
        try:
            pr = np.frombuffer(self._parent_row, np.int64)
            inside = np.flatnonzero(pr >= 0)
            kids = inside[np.argsort(pr[inside], kind="stable")]
            counts = np.bincount(pr[inside], minlength=len(pr))
            kids_at = np.zeros(len(pr) + 1, np.int64)
            np.cumsum(counts, out=kids_at[1:])
            # (arrays of ints, not NumPy's: a row's run is read ~10x faster)
            self._made = (array("q", kids.astype(np.int64).tobytes()), array("q", kids_at.tobytes()), counts > 0)
        except BaseException as exc:  # handed to the loop with the result
            self._error = exc
        finally:
            self._done.set()

    def result(self, wait: bool) -> tuple | None:
        """(kids, kids_at, has_kids) once made (None before, unless `wait`); re-raises the thread's error."""
        if not (self._done.wait() if wait else self._done.is_set()):
            return None
        if self._error is not None:
            raise self._error
        return self._made


def rows_of(blocks: Recovered | list | None) -> Recovered:
    """A tier's records as columns (a tier gives a list of `RecoveredBlock`s where it has few)."""
    return blocks if isinstance(blocks, Recovered) else Recovered.of(blocks or [])


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Recovery makes several objects per block and frees none: the cyclic collector, left on, would
    walk every object made so far again and again (a full collection every few thousand blocks, so
    recovery time grows with the square of the blocks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
