"""The store reports every change of the tiers holding a committed block (kvstore/block_events.py).

The stateful store test (tests/test_store_stateful.py: random puts, commits,
aborts, reads that promote, owners dying, restarts) runs with a recording sink
and admin clears added; after every step the sink's view must be exactly what
the store holds, block by block and tier by tier (copies included), and every
call must keep the stored/removed alternation.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, rule

from kvstore.block_events import held_tiers
from kvstore.keys import key_hash, key_ns
from tests.test_store_stateful import StoreMachine


class RecordingSink:
    """The store's sink, held to kvstore/block_events.py's invariant at every call."""

    def __init__(self) -> None:
        self.held: set = set()

    def stored(self, entry, tier):
        assert entry.committed and (entry.key, tier) not in self.held, (entry.key, tier)
        self.held.add((entry.key, tier))

    def removed(self, entry, tier):
        assert (entry.key, tier) in self.held, (entry.key, tier)
        self.held.remove((entry.key, tier))

    def cleared(self, ns_ids):
        self.held = {(k, t) for k, t in self.held if key_ns(k) not in set(ns_ids)}


class EventsMachine(StoreMachine):
    """The stateful store test, with a sink whose view must equal the store after every step, and clears."""

    def _open(self) -> None:
        super()._open()
        self.sink = RecordingSink()
        self.store.add_listener(self.sink)
        self.store.report_all()  # what a restart recovered, as the daemon reports it at start

    @rule()
    def clear(self):
        self.store.clear()

    @invariant()
    def events_match_the_store(self):
        expected = {(e.key, t) for e in self.store.index.entries.values() if e.committed for t in held_tiers(e)}
        assert self.sink.held == expected


@pytest.mark.parametrize("chain_name,policy", [("host+disk", "lru"), ("gpu+host+disk", "attention")])
def test_store_reports_every_tier_change(tmp_path, chain_name, policy):
    machine = type(f"EventsMachine_{chain_name}_{policy}", (EventsMachine,),
                   {"chain": chain_name, "policy": policy, "base": str(tmp_path)})
    runner = machine.TestCase
    runner.settings = settings(max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", 25)),
                               stateful_step_count=50, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    runner().runTest()


def test_a_clear_a_step_at_a_time_serves_between_steps_and_ends_with_what_the_store_holds(store_factory):
    """The admin plane's clear (kvstore/clearing.py `clear_in_steps`): other work runs between its steps;
    leaves go first, so a pinned block keeps its ancestors (its chain's tail goes) and a block with a
    reserved child keeps its chain; blocks committed meanwhile stay; and a sink held to the events'
    invariant at every call ends with exactly what the store holds."""
    import asyncio

    from kvstore.clearing import clear_in_steps
    from tests.helpers import chain_hashes, namespace

    store = store_factory(256 * 4096, 4096, prefault=False, policy="attention")
    sink = RecordingSink()
    store.add_listener(sink)
    ns = store.register_namespace(namespace(block_bytes=4096))

    def put(hs: list) -> None:
        store.reserve(ns, [(h, hs[i - 1] if i else None) for i, h in enumerate(hs)], "w")
        store.commit(ns, hs, "w")

    chains = [chain_hashes(c, 8) for c in range(20)]
    for hs in chains:
        put(hs)
    store.pin(ns, [chains[3][5]], "reader", prefix=False)
    extra = chain_hashes(99, 1)[0]
    store.reserve(ns, [(extra, chains[4][7])], "writer")  # (never committed)
    later = [chain_hashes(100 + i, 3) for i in range(5)]
    turns: list = []

    async def meanwhile() -> None:
        for hs in later:
            turns.append(len(store.index.entries))
            put(hs)
            await asyncio.sleep(0)

    async def run() -> int:
        task = asyncio.ensure_future(meanwhile())
        removed = await clear_in_steps(store, step=7)
        await task
        return removed

    removed = asyncio.run(run())
    assert len(turns) == 5 and min(turns) < 161 and turns[-1] > 40, "other work ran while the clear went on"
    keep = chains[3][:6] + chains[4] + [h for hs in later for h in hs]
    assert sorted(key_hash(e.key) for e in store.index.entries.values() if e.committed) == sorted(keep)
    assert removed == 20 * 8 - 6 - 8
    assert sink.held == {(e.key, t) for e in store.index.entries.values() if e.committed for t in held_tiers(e)}
    assert store.check() == []


def test_a_removal_a_step_at_a_time_takes_a_whole_subtree_or_none_and_serves_between_steps(store_factory):
    """`kvstore evict` of a root under which most of the cache sits (a prefix every prompt shares): the
    admin plane removes it a step of blocks per turn (kvstore/clearing.py `remove_steps`), children first,
    each reported as it goes; a subtree with a pinned block stays whole; other work runs between steps."""
    import asyncio

    from kvstore.clearing import remove_steps, run_in_steps
    from tests.helpers import chain_hashes, namespace

    store = store_factory(512 * 4096, 4096, prefault=False, policy="attention")
    sink = RecordingSink()
    store.add_listener(sink)
    ns = store.register_namespace(namespace(block_bytes=4096))
    shared = chain_hashes(1, 4)  # a shared prefix, and 30 branches of 6 under it
    store.reserve(ns, [(h, shared[i - 1] if i else None) for i, h in enumerate(shared)], "w")
    store.commit(ns, shared, "w")
    for b in range(30):
        hs = chain_hashes(10 + b, 6)
        store.reserve(ns, [(h, hs[i - 1] if i else shared[-1]) for i, h in enumerate(hs)], "w")
        store.commit(ns, hs, "w")
    other = chain_hashes(2, 5)
    store.reserve(ns, [(h, other[i - 1] if i else None) for i, h in enumerate(other)], "w")
    store.commit(ns, other, "w")
    store.pin(ns, [other[4]], "reader", prefix=False)
    turns: list = []

    async def meanwhile() -> None:
        for _ in range(40):
            turns.append(len(store.index.entries))
            await asyncio.sleep(0)

    async def run() -> int:
        task = asyncio.ensure_future(meanwhile())
        removed = await run_in_steps(remove_steps(store, ns, [shared[0], other[0]], step=10))
        await task
        return removed

    assert asyncio.run(run()) == 4 + 30 * 6
    assert turns[0] == 4 + 180 + 5 and any(5 < n < turns[0] for n in turns), "other work ran meanwhile"
    assert sorted(key_hash(e.key) for e in store.index.entries.values()) == sorted(other), "the pinned chain stays"
    assert sink.held == {(e.key, t) for e in store.index.entries.values() if e.committed for t in held_tiers(e)}
    assert store.check() == []
