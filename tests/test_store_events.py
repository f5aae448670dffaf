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
from kvstore.keys import key_ns
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
