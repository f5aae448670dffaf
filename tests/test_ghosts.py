"""The policies' history (eviction/ghosts.py) against an OrderedDict, its memory, and the default
policy's ghosts of blocks that had an attention estimate."""

import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.eviction.attention import AttentionParams, AttentionPolicy
from kvstore.eviction.base import BlockInfo
from kvstore.eviction.ghosts import Ghosts
from kvstore.eviction.leaves import GhostTable

OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 300), st.floats(allow_nan=False)),
    st.tuples(st.just("pop"), st.integers(0, 300), st.just(0.0)),
    st.tuples(st.just("trim"), st.integers(0, 200), st.just(0.0)),
    st.tuples(st.just("put40"), st.integers(0, 300), st.floats(allow_nan=False)),  # put, then at most 40
), max_size=600)


def _as_an_ordered_dict(ops) -> None:
    g, model = Ghosts(), OrderedDict()
    for op, key, value in ops:
        if op == "put":
            g.put(key, value)
            model[key] = value
        elif op == "put40":
            g.put(key, value, 40)
            model[key] = value
            while len(model) > 40:
                model.popitem(last=False)
        elif op == "pop":
            assert g.pop(key, "none") == model.pop(key, "none")
        else:
            g.trim(key)
            while len(model) > key:
                model.popitem(last=False)
        assert len(g) == len(model)
    assert all(k in g for k in model) and not any(k in g for k in range(301) if k not in model)
    for key, value in list(model.items()):  # and the order: trimming one at a time drops the oldest
        g.trim(len(model) - 1)
        model.popitem(last=False)
        assert key not in g and len(g) == len(model)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_ghosts_behave_as_an_ordered_dict_with_oldest_first_trimming(ops):
    _as_an_ordered_dict(ops)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_compactions_that_move_their_ghosts_a_step_at_a_time_behave_the_same(ops):
    """A compaction of many ghosts keeps their places and moves them a step at a time while puts, pops
    and trims go on (eviction/ghosts.py `_migrate`): the same OrderedDict, with tiny steps so that nearly
    every operation meets a move under way."""
    import kvstore.eviction.ghosts as ghosts

    saved = ghosts.MIN_FREE, ghosts.MOVE_STEP, ghosts.MOVE_EVERY
    ghosts.MIN_FREE, ghosts.MOVE_STEP, ghosts.MOVE_EVERY = 4, 3, 2
    try:
        _as_an_ordered_dict(ops)
    finally:
        ghosts.MIN_FREE, ghosts.MOVE_STEP, ghosts.MOVE_EVERY = saved


def test_a_large_compaction_moves_its_ghosts_in_steps_and_each_comes_back(monkeypatch):
    """The moving path on its own scale: ghosts past MOVE_STEP at a compaction are moved by later puts,
    the old arrays answer meanwhile, and every ghost comes back with its value, oldest trimmed first."""
    import kvstore.eviction.ghosts as ghosts

    monkeypatch.setattr(ghosts, "MIN_FREE", 64)
    monkeypatch.setattr(ghosts, "MOVE_STEP", 100)
    monkeypatch.setattr(ghosts, "MOVE_EVERY", 4)
    g, model, moving = Ghosts(2), OrderedDict(), 0
    for i in range(20_000):
        g.put(i, (float(i), -float(i)), 3_000)
        model[i] = (float(i), -float(i))
        while len(model) > 3_000:
            model.popitem(last=False)
        moving += g._old is not None
        if i % 7 == 0 and i - 1_500 in model:  # a ghost returns (some before they moved, some after)
            assert g.pop(i - 1_500) == model.pop(i - 1_500)
    assert moving > 1_000, "compactions moved their ghosts over many puts"
    assert len(g) == len(model) and all(g.pop(k) == v for k, v in model.items()) and len(g) == 0


@pytest.mark.parametrize("returned", ["all but the newest three", "every one"])
def test_trims_that_reach_ghosts_not_moved_yet_forget_them_where_they_are(monkeypatch, returned):
    """A compaction lists none of its ghosts: they are found in its old log as they move, and a trim
    that reaches the oldest not moved yet forgets it there (passing over those returned meanwhile, and
    letting the old arrays go once none is left): the order stays an OrderedDict's."""
    import kvstore.eviction.ghosts as ghosts

    monkeypatch.setattr(ghosts, "MIN_FREE", 64)
    monkeypatch.setattr(ghosts, "MOVE_STEP", 100)
    monkeypatch.setattr(ghosts, "MOVE_EVERY", 10**9)  # (no puts move them: only trims and compactions)
    g, model, i = Ghosts(), OrderedDict(), 0
    while g._old is None:
        g.put(i, float(i))
        model[i] = float(i)
        i += 1
    kept = list(model)  # (none has moved yet: all are in the old log)
    for k in kept[:-3] if returned == "all but the newest three" else kept:
        assert g.pop(k) == model.pop(k)
    for k in range(i, i + 50):  # new ghosts after the kept ones
        g.put(k, float(k))
        model[k] = float(k)
    while model:
        key = next(iter(model))
        g.trim(len(model) - 1)
        model.popitem(last=False)
        assert key not in g and len(g) == len(model) and all(k in g for k in model)
    assert g._old is None


def test_a_wide_ghost_comes_back_exactly_and_a_wrong_width_changes_nothing():
    g = Ghosts(4)
    values = (0.1, -1e-300, math.inf, -0.0)
    g.put(("ns", b"k"), values)
    with pytest.raises(ValueError):
        g.put(("ns", b"other"), (1.0, 2.0))
    assert len(g) == 1 and ("ns", b"other") not in g
    back = g.pop(("ns", b"k"))
    assert back == values and math.copysign(1.0, back[3]) < 0 and g.pop(("ns", b"k")) is None


def test_a_churned_history_holds_its_limit_in_bounded_bytes():
    """100x the limit remembered, a tenth taken back: the table keeps the newest `limit` and stays
    within 2 positions of ~(8 * width + 17) B per ghost."""
    g = Ghosts(4)
    limit = 20_000
    for i in range(100 * limit // 10):
        g.put(i, (float(i), 0.0, 0.0, 0.0))
        if i % 10 == 0:
            g.pop(i - 5)
        g.trim(limit)
    assert len(g) == limit
    newest = 100 * limit // 10 - 1
    assert g.pop(newest) == (float(newest), 0.0, 0.0, 0.0) and newest - 3 * limit not in g
    assert g.nbytes <= 2 * limit * (8 * 4 + 17) + 16 * limit  # ring up to 1.5x, table up to 4 slots a position


def test_the_ghost_table_bounds_by_resident_keys():
    t = GhostTable(2.0)
    for i in range(50):
        t.remember(i, float(i), resident=10)
    assert len(t) == 20 and 29 not in t and 30 in t and t.pop(49) == 49.0


def test_a_history_is_capped_whatever_the_size_of_its_tier():
    """16 x the resident blocks, and never more than `max_ghosts`: the policy's table and, for the keys
    they follow, the half-life experts' miniatures (1 in 8 of it). The newest ghosts are the ones kept."""
    def churn(params):
        p = AttentionPolicy(clock=lambda: 0.0, params=params)
        for i in range(100):
            p.on_insert(BlockInfo(("anchor", i), None, 0, 100, 16))  # 100 resident blocks
        for i in range(4000):
            p.on_insert(BlockInfo(("ns", i), None, 0, 100, 16))
            p.on_remove(("ns", i))
        return p

    p = churn(AttentionParams())
    assert len(p._ghost) == 1600 == 16 * 100
    capped = churn(AttentionParams(max_ghosts=64))
    assert len(capped._ghost) == 64 and ("ns", 3999) in capped._ghost and ("ns", 3999 - 64) not in capped._ghost
    full = max(len(m.ghost) for m in p.experts.minis + p.experts.early)
    assert full > 8 and all(len(m.ghost) <= 64 / 8 for m in capped.experts.minis + capped.experts.early)
    assert GhostTable(math.inf).most == math.inf  # "remember everything" (evaluation) is not capped
    with pytest.raises(ValueError):
        AttentionParams(max_ghosts=-1)


def _info(key, parent=None, attention=None):
    return BlockInfo(key, parent, 0, 4096, 16, attention=attention)


@pytest.mark.parametrize("estimate", [0.0, 0.75])
def test_an_evicted_block_with_an_estimate_counts_for_the_gate_once_it_returns(estimate):
    """The ghost of a block that had an estimate and no hit keeps A and that it was waiting: its
    return is the re-reference the gate counts (on A's side), once; a block without one counts nothing."""
    t = [0.0]
    p = AttentionPolicy(clock=lambda: t[0])
    p.on_insert(_info("a", attention=estimate))
    p.on_insert(_info("b"))
    p.on_insert(_info("stays"))  # the history holds 16 x the resident blocks
    side = estimate >= 0.5
    before = list(p.gate.hit)
    for key in ("a", "b"):
        p.on_remove(key)
    t[0] += 1.0
    p.on_insert(_info("a"))
    p.on_insert(_info("b"))
    after = list(p.gate.hit)
    assert after[side] == before[side] + 1 and after[not side] == before[not side]
    p.on_remove("a")  # not waiting any more (it came back with no new estimate): nothing more to count
    p.on_insert(_info("a"))
    assert list(p.gate.hit) == after


def test_stats_show_what_each_tiers_policy_remembers(store_factory):
    """A tier written through: its policy's history (ghosts and the bytes of their arrays, the experts'
    miniatures' included) is in the tier's stats, as the policy counts it; LRU keeps no such table."""
    from kvstore.keys import Namespace

    store = store_factory(64 * 4096, 4096, prefault=False, policy="attention")
    ns = store.register_namespace(Namespace("history", "bf16", 1, 1, 1, 16, 4096))
    for i in range(0, 1024, 16):
        hashes = [f"b{j}".encode().ljust(16, b"\0") for j in range(i, i + 16)]
        assert store.reserve(ns, list(zip(hashes, [None] + hashes[:-1])), "w")[-1] is not None
        store.commit(ns, hashes, "w")
    row = store.stats()["tiers"]["host"]
    policy = store.placement.policies["host"]
    assert row["evictions"] >= 1024 - 64
    assert (row["policy_history_ghosts"], row["policy_history_bytes"]) == policy.history()
    assert 16 * 64 >= len(policy._ghost) > 0 and row["policy_history_ghosts"] > len(policy._ghost)  # + miniatures'
    assert row["policy_history_bytes"] >= 8 * row["policy_history_ghosts"]
    lru = store_factory(64 * 4096, 4096, prefault=False, policy="lru")
    assert "policy_history_ghosts" not in lru.stats()["tiers"]["host"]
