"""Blocks in flight, and waiting for them to commit (prefill/decode disaggregation).

A block is *in flight* while it is reserved and not yet committed, or while a
producer has *announced* it (`expect`: a prefill engine's scheduler says which
blocks its workers are about to save, before the forward pass that computes
them). A consumer may `wait` for in-flight blocks of its namespace to commit:

* waiting is event driven: one asyncio future per waited key, set whenever
  that key changes (the index reports reserve, commit and drop to this
  object, a listener of the store: kvstore/block_events.py; announce and
  withdraw come here directly) and replaced on the next wait; nothing polls;
* a wait never reads or pins anything: it answers how many leading blocks are
  committed now (`ready`) and which of them it had to wait for; the reader then
  pins them with `acquire` as for any hit. Nothing is ever served before commit;
* it ends early, for the first block not committed, when that block stops being
  in flight without committing: its reservation was aborted, its producer's
  connection died (`release_owner`, the lease) or the announcement was withdrawn
  (reason "aborted"); when a block is neither stored nor in flight (reason
  "absent", unless `appear`: then it waits for the block to show up, for a
  producer that has not scheduled the request yet); at the timeout; or when
  the daemon drains (reason "shutdown").

Announcements belong to a connection like reservations do, and go with it.
Everything here runs on the daemon's event loop thread.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from typing import Sequence

from kvstore.entry import Entry, Key, Owner
from kvstore.index import BlockIndex
from kvstore.keys import ns_tag
from kvstore.wire import WaitResult  # noqa: F401  (also this module's name for it)

MAX_WAIT_S = 600.0


class InflightWaits:
    """Futures per waited key and the producers' announcements, over the block index."""

    def __init__(self, index: BlockIndex, counters: Counter) -> None:
        self.index, self.counters = index, counters
        self._futures: dict[Key, asyncio.Future] = {}
        self._expected: dict[Key, set[Owner]] = defaultdict(set)
        self._expected_by_owner: dict[Owner, set[Key]] = defaultdict(set)
        self.closed = False  # the daemon is draining: every wait answers now

    def close(self) -> None:
        """End every wait (the daemon drains; a wait must not hold it up)."""
        self.closed = True
        for key in list(self._futures):
            self._notify(key)

    # -- what the index reports (listener methods) --------------------------------------
    def reserved(self, entry: Entry) -> None:
        if self._futures:
            self._notify(entry.key)

    def committed(self, entries: Sequence[Entry]) -> None:
        """A committed block needs no announcement any more (whoever announced it)."""
        if not self._expected and not self._futures:
            return
        for e in entries:
            owners = self._expected.pop(e.key, None)
            for owner in owners or ():
                mine = self._expected_by_owner.get(owner)
                if mine is not None:
                    mine.discard(e.key)
                    if not mine:
                        del self._expected_by_owner[owner]
            self._notify(e.key)

    def dropped(self, entry: Entry) -> None:
        if self._futures:
            self._notify(entry.key)  # an aborted or lost reservation ends its waits

    def _notify(self, key: Key) -> None:
        fut = self._futures.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def num_waited_keys(self) -> int:
        return len(self._futures)

    # -- announcements ---------------------------------------------------------------------
    def expect(self, keys: Sequence[Key], owner: Owner) -> None:
        for key in keys:
            if self.index.committed(key):
                continue
            self._expected[key].add(owner)
            self._expected_by_owner[owner].add(key)
            self._notify(key)

    def withdraw(self, keys: Sequence[Key], owner: Owner) -> None:
        mine = self._expected_by_owner.get(owner)
        for key in keys:
            if mine is None or key not in mine:
                continue
            mine.discard(key)
            self._drop_expectation(key, owner)
        if mine is not None and not mine:
            del self._expected_by_owner[owner]

    def withdraw_owner(self, owner: Owner) -> None:
        for key in self._expected_by_owner.pop(owner, ()):
            self._drop_expectation(key, owner)

    def _drop_expectation(self, key: Key, owner: Owner) -> None:
        owners = self._expected.get(key)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._expected[key]
        self._notify(key)

    def num_expected(self) -> int:
        return len(self._expected)

    # -- in flight and waiting ---------------------------------------------------------------
    def in_flight(self, key: Key) -> bool:
        e = self.index.get(key)
        return (e is not None and not e.committed) or key in self._expected

    def count_in_flight(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are committed or in flight (no pins, no policy events)."""
        n, tag = 0, ns_tag(ns_id)
        for h in hashes:
            key = tag + h
            if self.index.get(key) is None and key not in self._expected:
                break
            n += 1
        return n

    async def wait(self, ns_id: str, hashes: Sequence[bytes], timeout_s: float, appear: bool = False) -> WaitResult:
        """Wait until the leading `hashes` are committed (see the module docstring for when it stops)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(timeout_s, 0.0), MAX_WAIT_S)
        tag = ns_tag(ns_id)
        pending = [i for i, h in enumerate(hashes) if not self.index.committed(tag + h)]

        def result(ready: int, reason: str) -> WaitResult:
            self.counters[f"waits_{reason}"] += 1  # how waits end: done, absent, aborted, timeout, shutdown
            return WaitResult(ready, tuple(i for i in pending if i < ready), reason)

        for i, h in enumerate(hashes):
            key = tag + h
            seen_in_flight = False
            while not self.index.committed(key):
                if self.closed:
                    return result(i, "shutdown")
                if self.in_flight(key):
                    seen_in_flight = True
                elif seen_in_flight:
                    return result(i, "aborted")
                elif not appear:
                    return result(i, "absent")
                left = deadline - loop.time()
                if left <= 0:
                    return result(i, "timeout")
                self.counters["inflight_waits"] += 1
                try:
                    await asyncio.wait_for(asyncio.shield(self._future(key)), left)
                except asyncio.TimeoutError:
                    return result(i, "timeout")
        return result(len(hashes), "done")

    def _future(self, key: Key) -> asyncio.Future:
        fut = self._futures.get(key)
        if fut is None or fut.done():
            fut = self._futures[key] = asyncio.get_running_loop().create_future()
        return fut
