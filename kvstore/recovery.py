"""Restart recovery: rebuild the block index from the tiers that persist, while the store serves.

Each persistent tier, fastest first, reports its namespaces (re-registered at
once, anchors first) and its block records: at once (`Tier.recover`) or, for a
tier that reads them in the background (`Tier.scanned`: the host arena's
placement index and the disk's, millions of records each), once they are
read. The daemon adopts them in steps while it serves (`Recovery.step`, a
bounded number of records a call), unless there are only a few thousand;
`finish` does it in one go (those few, a store built without a loop, tools,
tests, `check`). Meanwhile a request adopts the records of the keys it names
before it looks at them (`adopt_now`): a block whose record is read is a hit
at once, and so is one whose record a tier still scanning reads on its own
(`Tier.peek`: `_adopt_early`; such a block's row is settled when the scan's
rows come). A tier's free pages are known once its records are read, before
they are adopted, so the store takes new blocks meanwhile (before then, the
tier takes none: a put into it is refused, a demotion into it dropped, and a
page a block gives back stays taken).

Rules, either way:
- Blocks are adopted parents first, from the roots and from blocks already
  indexed, so a record whose parent is missing (an orphan, e.g. a block whose
  ancestors lived only in host RAM before a kill -9) is never adopted and its
  pages are freed; so is a record that does not match its namespace (a block
  of an anchored namespace hangs under its anchor namespace's block, so an
  attachment whose block is gone is an orphan too), and one that would sit in
  a faster tier than its parent.
- Adopted blocks enter their tier's policy in the order they reached the tier
  (within each step).
- A key already indexed in a faster tier keeps its record in a slower tier
  that keeps copies (disk) as its copy (`Entry.copies`, inclusive tiers), as
  if it had been promoted out of it.
- The store changes while a tier's records are adopted. A record whose key was
  written into the same tier again meanwhile (the newer record replaced it in
  the tier's index) only gives its pages back, and only once the newer record
  is durable; any other record that is not adopted is released (its pages and
  its index record). A slower shared tier, such as a remote store, is not ours
  to free.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import ExitStack
from itertools import compress
from typing import Callable, Iterable

import numpy as np

from kvstore.entry import RANK, Entry, Key
from kvstore.errors import NamespaceError
from kvstore.index import BlockIndex
from kvstore.keys import ROOT_HASH, Namespace, block_key, key_ns
from kvstore.placement import Placement
from kvstore.recovery_rows import GONE, PENDING, SORTING, Links, TierRecovery, no_cyclic_gc, rows_of
from kvstore.tiers.base import Tier
from kvstore.tiers.recovered import Recovered

log = logging.getLogger(__name__)

STAGES = ("scan", "index", "adopt", "copies", "orphans")
EARLY_WALK_BLOCKS = 4096  # the most records a request's block and its ancestors read one by one (`_adopt_early`)




class Recovery:
    """Adopts what the persistent tiers of `placement`'s chain kept, fastest tier first; `register` is the
    store's namespace registration. The constructor registers the namespaces; the blocks are adopted by
    `step` or `finish`."""

    def __init__(self, index: BlockIndex, placement: Placement, register: Callable[[Namespace], str]) -> None:
        self.index, self.placement = index, placement
        self._pending: deque[TierRecovery] = deque()
        self.num_records = 0  # the block records the tiers reported at open
        for tier in placement.chain:
            if not tier.persistent:
                continue
            kept = tier.num_kept_records  # (before `recover` hands them over)
            self.num_records += kept
            namespaces, blocks = tier.recover()
            _register(tier, namespaces, register)
            r = TierRecovery(tier, kept)
            if not tier.scanning:
                self._load(r, blocks)
            self._pending.append(r)

    @property
    def active(self) -> bool:
        return bool(self._pending)

    @property
    def scanning(self) -> bool:
        """The tier being recovered still reads its records, or links them in a thread (a step has
        nothing to adopt yet)."""
        return bool(self._pending) and (self._pending[0].stage == "scan" or self._pending[0].links is not None)

    def step(self, budget: int = 1000) -> bool:
        """Work through up to `budget` records of each tier being recovered; True while work is left.

        The tiers go on together (the disk's scan and sort while the host arena's blocks are adopted),
        but a tier adopts only once every faster one has sorted its records (a key held by both is the
        faster tier's block, and the slower record its copy), and it ends (frees what it could not
        adopt) only once the faster ones have ended: a record whose parent a faster tier has yet to
        adopt is not an orphan."""
        for r in list(self._pending):
            self._release_stale(r)
            if not self._advance(r, budget, first=r is self._pending[0]):
                self._pending.remove(r)
        return bool(self._pending)

    def finish(self) -> None:
        """Everything left, now (waiting for the scans)."""
        with no_cyclic_gc():
            while self._pending:
                r = self._pending[0]
                if r.stage == "scan":
                    self._load(r, r.tier.scanned(wait=True))
                while self._advance(r, None):
                    pass
                if r.stale:
                    r.tier.flush()  # the newer records are durable now
                    self._release_stale(r)
                self._pending.popleft()

    def adopt_now(self, keys: list[Key]) -> None:
        """Adopt the records of `keys` (and of their ancestors) not adopted yet, fastest tier first: those
        read already, and, from a tier still reading them, those it can read one by one (`_adopt_early`,
        each such tier's reads in one `Tier.peeks`)."""
        with ExitStack() as peeks:
            for r in self._pending:
                if r.stage == "scan" and r.tier.peekable:
                    peeks.enter_context(r.tier.peeks())
            self._adopt_now(keys)

    def _adopt_now(self, keys: list[Key]) -> None:
        for r in self._pending:
            if r.stage == "scan":
                if r.tier.peekable and self._may_adopt(r, True, early=True):
                    self._adopt_early(r, keys)
                continue
            if not self._may_adopt(r, on_demand=True):
                return
            if r.stage == "orphans" or r.sorted == len(r.rows) and not r.waiting:
                continue
            adopted: list[tuple[float, Entry]] = []
            faster, finder = self._faster(r), r.rows.finder()
            found = finder.find_many(np.fromiter(map(hash, keys), np.int64, len(keys)))
            for key, row in zip(keys, found.tolist()):
                if row >= 0 and r.rows.keys[row] != key:
                    row = finder.find(key)
                chain: list[int] = []
                seen: set[int] = set()  # (a record naming itself, or a cycle, as its ancestor ends the walk)
                while row >= 0 and row not in seen:
                    if r.state[row] == SORTING:  # (its tier is sorting its rows: this one first)
                        self._sort(r, (row,))
                    if r.state[row] != PENDING:
                        break
                    chain.append(row)
                    seen.add(row)
                    row = r.parent_row[row]
                for k in reversed(chain):
                    if not self._adopt_one(r, k, adopted, faster):
                        break
            self._enter_policy(adopted)

    def _may_adopt(self, r: TierRecovery, on_demand: bool = False, early: bool = False) -> bool:
        """`r` has sorted its records and so has every faster tier being recovered. `on_demand`: a
        request's rows may be adopted while `r` and the faster tiers still sort the others, or while a
        faster one that reads a record on its own still reads them (whether a key is theirs is asked of
        each first: `_waits_faster`); `early`: while `r` still reads them."""
        for other in self._pending:
            if other is r:
                return (other.stage not in ("scan", "index") or on_demand and other.stage == "index"
                        or early and other.stage == "scan")
            if other.stage == "scan" and not (on_demand and other.tier.peekable) \
                    or other.stage == "index" and not on_demand:
                return False
        return False

    def _waits_faster(self, faster: list[TierRecovery], key: Key) -> bool:
        """`key` has a record waiting for adoption in one of the `faster` tiers (its row sorted first in
        one still sorting, its record read on its own in one still reading them): the block is theirs, and
        a slower tier's record of it at most its copy."""
        for other in faster:
            if other.stage == "scan":
                if other.tier.peek(key) is not None:
                    return True
            elif other.stage == "index" or other.waiting and other.stage != "orphans":
                row = other.rows.finder().find(key)
                if row >= 0 and other.state[row] == SORTING:
                    self._sort(other, (row,))
                if row >= 0 and other.state[row] == PENDING:
                    return True
        return False

    def _adopt_early(self, r: TierRecovery, keys: list[Key]) -> None:
        """While `r`'s tier still reads its records: adopt the blocks of `keys` from their records read
        one by one (`Tier.peek`), each with its ancestors not indexed yet, parents first, by the rules of
        the rows (a chain that does not reach a root or an indexed block is not adopted). A block adopted
        so is noted in `r.early` until the scan's rows come (`_settle_early`, `_early_row`); one given
        back meanwhile is not adopted again before then."""
        tier, index, name = r.tier, self.index, r.tier.name
        known = self.placement.shared.namespaces
        faster = self._faster(r)
        adopted: list[tuple[float, Entry]] = []
        for key in keys:
            chain: list[tuple] = []  # the records to adopt, the request's block first
            k: Key | None = key
            seen: set = set()
            while k is not None and not index.holds(k):  # (a block at rest is indexed: not woken here)
                # (not one given back meanwhile, a cycle of parents, a chain past the walk's bound, or a
                # block a faster tier holds)
                if k in r.early or k in seen or len(chain) >= EARLY_WALK_BLOCKS \
                        or self._waits_faster(faster, k) or (record := tier.peek(k)) is None:
                    chain = []
                    break
                got, h, size, location, estimate, stamp = record  # (`Recovered.normal`'s fields: judged already)
                ns_id = key_ns(k)
                ns = known.get(ns_id)
                if got != k or ns is None or size != ns.block_bytes:
                    chain = []
                    break
                seen.add(k)
                chain.append((k, location, None if estimate != estimate else estimate, stamp))
                k = None if h == ROOT_HASH else block_key(ns.anchor or ns_id, h)
            parent = index.get(k) if k is not None else None
            if not chain or k is not None and (parent is None or RANK[parent.tier] > RANK[name]):
                continue
            for k, location, estimate, stamp in reversed(chain):
                parent = index.adopt(k, parent, name, location, estimate)
                tier.adopted_early(k, location)  # (the arena verifies it before its first read)
                adopted.append((stamp, parent))
                self.placement.adopted(parent)
                r.early[k] = location
                r.adopted += 1
                r.adopted_early += 1
        self._enter_policy(adopted)

    def _load(self, r: TierRecovery, blocks: Recovered | list | None) -> None:
        """`r`'s tier has read its records: they are sorted next."""
        r.load(rows_of(blocks))
        if r.early:
            self._settle_early(r)

    def _settle_early(self, r: TierRecovery) -> None:
        """The scan's rows have come, and some blocks were adopted before (`_adopt_early`): one whose
        record the scan did not keep (one it found unusable, or claiming pages another record holds)
        leaves the index with what hangs under it, its pages untouched: they are not its own. The rows
        of the others are done with as they are sorted (`_early_row`)."""
        keys, finder = list(r.early), r.rows.finder()
        found = finder.find_many(np.fromiter(map(hash, keys), np.int64, len(keys)))
        name = r.tier.name
        # (in one go, before the tier hands out a page: the keys compared in one array operation)
        for key in compress(keys, ~r.rows.keys.match(found, keys)):
            if finder.find(key) < 0 and (location := r.early.pop(key, None)) is not None:  # (not forgotten yet)
                if (e := self._holds(key, name, location)) is not None:
                    self._forget(r, e, location)

    def _early_row(self, r: TierRecovery, row: int, key: Key) -> bool:
        """Sorting `row`, of `key`: if its block was adopted before the scan ended, the row is done with
        (True). A block given back meanwhile kept its pages (a tier frees none while it scans): they are
        freed now."""
        location, at, name = r.early.pop(key), r.rows.locations[row], r.tier.name
        e = self._holds(key, name, location)
        if at != location and r.tier.locate(at) != r.tier.locate(location):  # (never: one record a key)
            if e is not None:
                self._forget(r, e, location)
            return False
        if e is None:
            r.tier.free(at)  # (its record's deletion was queued when it went)
        return True

    def _holds(self, key: Key, name: str, location: object) -> Entry | None:
        """`key`'s entry if the index holds its block at `location` (that very object) in tier `name`,
        there or as its copy."""
        e = self.index.get(key)
        if e is not None and (e.location if e.tier == name else (e.copies or {}).get(name)) is location:
            return e
        return None

    def _forget(self, r: TierRecovery, e: Entry, location: object) -> None:
        """`e`, adopted early from `r`'s tier at `location`, is not the block of the scan's row of its key:
        it leaves the index (a block in a faster tier only its copy there), with its subtree, whatever
        their pins; the pages of what was adopted early are not freed."""
        name, index, placement = r.tier.name, self.index, self.placement
        placement.counters[f"{name}_early_blocks_forgotten"] += 1
        if e.tier != name:
            index.drop_copy(e, name)
            return
        for x in index.deepest_first(index.subtree(e.key)):
            index.ghost(x)
            if x is e or x.tier == name and r.early.get(x.key) is x.location:
                r.early.pop(x.key, None)
                placement.policies[name].on_remove(x.key)
                index.remove(x)
            else:
                placement.drop(x)

    def stats(self) -> dict:
        """Per tier being recovered: its stage, the records it kept, those read and waiting, the blocks adopted
        so far (of them, those adopted before the tier's records were read), seconds since it began."""
        return {r.tier.name: {"stage": r.stage, "kept_records": r.kept_records,
                              "waiting_records": len(r.rows) - r.sorted + r.waiting,
                              "adopted_blocks": r.adopted, "adopted_early_blocks": r.adopted_early,
                              "elapsed_s": round(time.monotonic() - r.started, 3)}
                for r in self._pending}

    # -- the stages ---------------------------------------------------------------------------
    def _advance(self, r: TierRecovery, budget: int | None, first: bool = True) -> bool:
        """Run `r`'s current stage for up to `budget` records (None: all); False once `r` is done. Only
        the `first` tier being recovered gets past adopting (see `step`)."""
        if r.stage == "scan":
            blocks = r.tier.scanned()
            if blocks is not None:
                self._load(r, blocks)
            return True
        if r.stage == "index":  # (sorting its rows, linking them in a thread (`Links`), then `_link_gone`)
            if r.links is None and r.linking is None and self._index(r, budget):
                r.links = Links(r.parent_row)
            if r.links is not None and self._linked(r, wait=budget is None):
                r.links, r.pos = None, 0
            if r.linking is not None and self._link_gone(r, budget):
                r.linking, r.pos, r.stage = None, 0, "adopt"
            return True
        if r.stage == "adopt":
            if not self._may_adopt(r):
                return True
            adopted: list[tuple[float, Entry]] = []
            n, faster = 0, self._faster(r)
            while r.frontier and (budget is None or n < budget):
                self._adopt_one(r, r.frontier.pop(), adopted, faster)
                n += 1
            self._enter_policy(adopted)
            if not r.frontier and first:
                r.copies.sort(key=r.rows.stamps.__getitem__)  # the copies index is oldest first
                r.copies.reverse()
                r.stage = "copies"
            return True
        if r.stage == "copies":
            self._take_copies(r, budget)
            if not r.copies:  # what still waits is unreachable from a root: an orphan, let go
                state = np.frombuffer(r.state, np.uint8)
                r.orphan_rows = np.flatnonzero(state == PENDING)
                state[r.orphan_rows] = GONE
                r.kids = r.kids_at = None
                r.outside, r.frontier, r.pos, r.stage = {}, [], 0, "orphans"
            return True
        rows = r.orphan_rows
        assert rows is not None
        end = len(rows) if budget is None else min(len(rows), r.pos + budget)
        for row in rows[r.pos : end].tolist():
            self._release(r, row)
            r.orphans += 1
            r.waiting -= 1
        r.pos = end
        if end < len(rows):
            return True
        self._done(r)
        return False

    def _index(self, r: TierRecovery, budget: int | None) -> bool:
        """Sort the next rows (those a request sorted already are skipped). True once all are."""
        end = len(r.rows) if budget is None else min(len(r.rows), r.pos + budget)
        self._sort(r, range(r.pos, end))
        r.pos = end
        return r.pos >= len(r.rows)

    def _sort(self, r: TierRecovery, which: Iterable[int]) -> None:
        """Sort rows `which` not sorted yet: adoptable (PENDING: in `frontier`, or waiting for their
        parent), copies, or released."""
        tier, index, rows = r.tier, self.index, r.rows
        known = self.placement.shared.namespaces
        keeps_copies = tier.name in index.copies
        keys, nbytes, state, early = rows.keys, rows.nbytes, r.state, r.early
        waits: list[int] = []
        parents: list[Key] = []
        for row in which:
            if state[row] != SORTING:
                continue
            r.sorted += 1
            key = keys[row]
            state[row] = GONE
            if early and key in early and self._early_row(r, row, key):
                continue
            ns_id = key_ns(key)
            ns = known.get(ns_id)
            if ns is None or nbytes[row] != ns.block_bytes:
                self._release(r, row)
                r.dropped += 1
                continue
            e = index.get(key)
            if e is not None:
                if keeps_copies and RANK[e.tier] < RANK[tier.name] and tier.name not in (e.copies or ()):
                    r.copies.append(row)
                else:
                    self._release(r, row)
                continue
            state[row] = PENDING
            r.waiting += 1
            h = rows.parent_hash(row)
            parent = None if h is None else block_key(ns.anchor or ns_id, h)
            if parent is None or index.get(parent) is not None:
                r.frontier.append(row)
            else:
                waits.append(row)
                parents.append(parent)
        if waits:
            self._wait(r, waits, parents)

    def _wait(self, r: TierRecovery, waits: list[int], parents: list[Key]) -> None:
        """Rows `waits` wait for their `parents` (not indexed): a parent that is a record of this tier by
        its row (`parent_row`), any other by its key (`outside`)."""
        finder = r.rows.finder()
        found = finder.find_many(np.fromiter(map(hash, parents), np.int64, len(parents))).tolist()
        keys, inside, at = r.rows.keys, [], []
        for row, parent, p in zip(waits, parents, found):
            if p >= 0 and keys[p] != parent:
                p = finder.find(parent)
            if p >= 0:
                inside.append(row)
                at.append(p)
                continue
            kids = r.outside.get(parent)
            if kids is None:
                r.outside[parent] = row
            elif type(kids) is list:
                kids.append(row)
            else:
                r.outside[parent] = [kids, row]
        if inside:
            np.frombuffer(r.parent_row, np.int64)[inside] = at

    def _linked(self, r: TierRecovery, wait: bool) -> bool:
        """Once `r.links` are made (`wait`: waiting for them): each row's children; the rows with children
        that are not waiting for adoption are looked at next (`_link_gone`). Whether they were made."""
        made = r.links.result(wait)  # type: ignore[union-attr]
        if made is None:
            return False
        r.kids, r.kids_at, has_kids = made
        gone = np.flatnonzero(np.frombuffer(r.state, np.uint8) == GONE)
        r.linking = gone[has_kids[gone]]
        return True

    def _link_gone(self, r: TierRecovery, budget: int | None) -> bool:
        """The children of rows not adopted here whose key is indexed (a faster tier's block, one written
        meanwhile or adopted on demand, as whole chains are) are free to go: up to `budget` such rows
        looked at (the blocks requests adopted while the tier was read may be most of a restart's first
        minute). True once all are."""
        rows = r.linking
        end = len(rows) if budget is None else min(len(rows), r.pos + budget)
        keys, get = r.rows.keys, self.index.get
        for p in rows[r.pos : end].tolist():
            if get(keys[p]) is not None:
                r.frontier.extend(r.children(p))
        r.pos = end
        return end >= len(rows)

    def _adopt_one(self, r: TierRecovery, row: int, adopted: list[tuple[float, Entry]],
                   faster: list[TierRecovery]) -> bool:
        """Adopt the record of `row` if it still can be (its parent indexed, no faster than it); False
        when it cannot now. `faster`: the tiers being recovered before `r` (`_faster`)."""
        if r.state[row] != PENDING:
            return False  # adopted already (on demand), or let go
        rows, tier, index = r.rows, r.tier, self.index
        key, p = rows.keys[row], r.parent_row[row]
        parent_key = rows.keys[p] if p >= 0 else self._parent_key(rows, row)  # (a row's key: the parent's itself)
        parent = index.get(parent_key) if parent_key is not None else None
        if parent_key is not None and (parent is None or RANK[parent.tier] > RANK[tier.name]):
            return False  # it stays PENDING: an orphan unless its parent comes back
        r.state[row] = GONE
        r.waiting -= 1
        e = index.get(key)
        if e is not None or faster and self._waits_faster(faster, key):
            # Indexed meanwhile (written again, or adopted from a faster tier), or about to be adopted from
            # a faster tier: this record is its copy where this tier keeps copies (checked when copies are
            # taken, after the faster tiers), else it goes.
            if tier.name in index.copies and (e is None or RANK[e.tier] < RANK[tier.name]):
                r.copies.append(row)
            else:
                self._release(r, row)
            if e is not None:
                self._indexed(key, r, row)
            return False
        e = index.adopt(key, parent, tier.name, rows.locations[row], rows.estimate(row))
        adopted.append((rows.stamps[row], e))
        self.placement.adopted(e)
        self._indexed(key, r, row)
        r.adopted += 1
        return True

    def _parent_key(self, rows: Recovered, row: int) -> Key | None:
        """The key of `row`'s parent (None: a root); its namespace is registered (`_index` checked)."""
        h = rows.parent_hash(row)
        if h is None:
            return None
        ns_id = key_ns(rows.keys[row])
        return block_key(self.placement.shared.namespaces[ns_id].anchor or ns_id, h)

    def _faster(self, r: TierRecovery) -> list[TierRecovery]:
        out = []
        for other in self._pending:
            if other is r:
                return out
            out.append(other)
        return out

    def _indexed(self, key: Key, r: TierRecovery, row: int) -> None:
        """`key` is in the index (its record `row` of `r`): the records waiting for it as their parent, in
        any tier, may be adopted."""
        for other in self._pending:
            if other.outside:
                kids = other.outside.pop(key, None)
                if type(kids) is list:
                    other.frontier.extend(kids)
                elif kids is not None:
                    other.frontier.append(kids)
            if other.kids is not None:
                at = row if other is r else other.rows.finder().find(key)
                if at >= 0:
                    other.frontier.extend(other.children(at))

    def _enter_policy(self, adopted: list[tuple[float, Entry]]) -> None:
        if adopted:
            adopted.sort(key=lambda t: t[0])  # (stable: equal stamps keep their order)
            self.placement.insert_in_policy([e for _, e in adopted])

    def _take_copies(self, r: TierRecovery, budget: int | None) -> None:
        """Records of blocks indexed in a faster tier become their copies, oldest first."""
        tier, index, rows, n = r.tier, self.index, r.rows, 0
        while r.copies and (budget is None or n < budget):
            row = r.copies.pop()
            n += 1
            e = index.get(rows.keys[row])
            if e is not None and RANK[e.tier] < RANK[tier.name] and tier.name not in (e.copies or ()):
                index.add_copy(e, tier.name, rows.locations[row])
                r.num_copies += 1
            else:
                self._release(r, row)

    # -- records not adopted ----------------------------------------------------------------
    def _release(self, r: TierRecovery, row: int) -> None:
        """Give back the pages of a record that is not adopted, and its index record, unless a newer
        record of the same key lives in the tier now: then only the pages, once that one is durable."""
        key, location = r.rows.keys[row], r.rows.locations[row]
        if self._newer(r.tier, key, location) is None:
            r.tier.free(location, key)
        else:
            r.stale.append(row)
            self._release_stale(r)

    def _newer(self, tier: Tier, key: Key, location: object) -> object | None:
        """The location of the record that replaced `key`'s at `location` in `tier` (None: none did)."""
        e = self.index.get(key)
        if e is None:
            return None
        newer = e.location if e.tier == tier.name else (e.copies or {}).get(tier.name)
        return newer if newer is not None and newer != location else None  # (a row's location is made anew)

    def _release_stale(self, r: TierRecovery) -> None:
        if not r.stale:
            return
        waiting = []
        keys, locations = r.rows.keys, r.rows.locations
        for row in r.stale:
            newer = self._newer(r.tier, keys[row], locations[row])
            if newer is not None and not r.tier.durable(newer):
                waiting.append(row)
            else:  # the newer record is durable (or gone, its deletion queued): no record points here
                r.tier.free(locations[row])
        r.stale = waiting

    def _done(self, r: TierRecovery) -> None:
        counters, name = self.placement.counters, r.tier.name
        counters[f"{name}_blocks_recovered"] = r.adopted
        if r.adopted_early:
            counters[f"{name}_blocks_recovered_early"] = r.adopted_early
        counters[f"{name}_copies_recovered"] = r.num_copies
        if r.orphans:
            counters[f"{name}_orphans_dropped"] += r.orphans
        if r.dropped:
            counters[f"{name}_records_dropped"] += r.dropped
        log.info("%s tier: recovered %d blocks and %d copies of blocks in faster tiers, dropped %d orphans in "
                 "%.2f s; %s", name, r.adopted, r.num_copies, r.orphans, time.monotonic() - r.started,
                 r.tier.stats())


def _register(tier: Tier, namespaces: list, register: Callable[[Namespace], str]) -> None:
    """Re-register a tier's namespaces, anchors before the namespaces anchored to them."""
    for ns_id, fields in sorted(namespaces, key=lambda item: bool(isinstance(item[1], dict) and item[1].get("anchor"))):
        try:
            ns = Namespace.from_dict(fields)
            if ns.id != ns_id:
                raise ValueError("namespace id does not match its fields")
            register(ns)
        except (ValueError, TypeError, NamespaceError) as exc:
            log.warning("%s tier: namespace %r not restored: %s", tier.name, ns_id, exc)
