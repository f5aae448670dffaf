"""tools/bench/policy_sim.py follows the store's eviction rules: same hits per request as the real replay."""

from __future__ import annotations

import pytest

from eviction.base import policy_names
from tools.bench.policy_sim import load, main, simulate
from tools.replay import replay


@pytest.mark.parametrize("trace,capacity", [("gen:agentic", 120), ("gen:mixed", 200), ("gen:scan", 90)])
def test_simulator_matches_the_store_request_by_request(trace, capacity):
    reqs = load(trace, limit=500)
    for policy in policy_names():
        via_store: list[int] = []
        replay(reqs, policy, capacity, hits_out=via_store)
        via_sim: list[int] = []
        res = simulate(reqs, policy, capacity, hits_out=via_sim)
        assert via_sim == via_store, f"{policy} on {trace} at {capacity} blocks: the simulator diverged"
        assert 0 < res["hit_blocks"] < res["blocks"]  # the capacity makes the policies evict


def test_smaller_blocks_and_the_cli(capsys):
    reqs = load("gen:tenants", limit=120)
    via_store: list[int] = []
    replay(reqs, "attention", 300, block_tokens=128, hits_out=via_store)
    via_sim: list[int] = []
    simulate(reqs, "attention", 300, block_tokens=128, hits_out=via_sim)
    assert via_sim == via_store
    assert main(["gen:tenants", "--policy", "lru", "--capacity-blocks", "50", "--limit", "50"]) == 0
    assert "gen:tenants" in capsys.readouterr().out


def test_a_policy_naming_a_pinned_victim_is_an_error():
    from eviction.lru import LRUPolicy

    class Bad(LRUPolicy):
        def victims(self, n_bytes, evictable):
            return list(self._order)[:1] or None  # ignores evictable: may name a parent

    with pytest.raises(RuntimeError, match="not evictable"):
        simulate(load("gen:agentic", limit=200), lambda clock: Bad(clock=clock), 20)
