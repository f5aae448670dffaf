"""One contract suite over every eviction policy, plus store-level scenarios with each.

Policies: lru, lfu, arc, s3fifo, attention (registered) and belady (offline,
built here with a known future). Time is an injected clock; nothing sleeps.
"""

from __future__ import annotations

import random

import pytest

from kvstore.eviction.attention import AttentionParams, AttentionPolicy
from kvstore.eviction.base import BlockInfo, make_policy, policy_names
from kvstore.eviction.belady import BeladyPolicy
from kvstore.keys import Namespace, block_key

POLICIES = ["lru", "lfu", "arc", "s3fifo", "attention", "belady"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(name: str, clock: FakeClock, future: dict | None = None):
    if name == "belady":
        return BeladyPolicy(future or {}, now=lambda: int(clock.now), clock=clock)
    return make_policy(name, clock=clock)


def test_registry_has_every_online_policy_and_not_belady():
    names = policy_names()
    for name in ("lru", "lfu", "arc", "s3fifo", "attention"):
        assert name in names
    assert "belady" not in names


class Model:
    """A dict model of the tree the policy has been told about."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def children(self, key) -> int:
        return sum(1 for p in self.parent.values() if p == key)

    def leaves(self) -> list:
        return [k for k in self.parent if self.children(k) == 0]

    def chain(self, key) -> list:
        out = []
        while key is not None:
            out.append(key)
            key = self.parent[key]
        return out[::-1]


def info(key, parent, depth, nbytes=100) -> BlockInfo:
    return BlockInfo(key, parent, depth, nbytes, 16)


@pytest.mark.parametrize("name", POLICIES)
def test_empty_policy_names_nothing(name):
    p = build(name, FakeClock())
    assert len(p) == 0
    assert p.victims(100, lambda k: True) is None


@pytest.mark.parametrize("name", POLICIES)
def test_none_when_nothing_is_evictable(name):
    p = build(name, FakeClock())
    for i in range(5):
        p.on_insert(info(i, None, 0))
    assert p.victims(100, lambda k: False) is None
    assert len(p) == 5  # victims changed nothing


@pytest.mark.parametrize("name", POLICIES)
def test_victims_cover_the_request_when_possible(name):
    p = build(name, FakeClock())
    for i in range(10):
        p.on_insert(info(i, None, 0, nbytes=100))
    got = p.victims(350, lambda k: True)
    assert got is not None and len(set(got)) == len(got)
    assert 100 * len(got) >= 350
    allowed = {1, 3, 5}
    got = p.victims(1000, lambda k: k in allowed)
    assert got is not None and set(got) <= allowed


@pytest.mark.parametrize("name", POLICIES)
def test_only_leaves_offered_by_the_predicate_are_named(name):
    p = build(name, FakeClock())
    model = Model()
    for key, parent, depth in [("a", None, 0), ("b", "a", 1), ("c", "b", 2), ("d", "a", 1)]:
        p.on_insert(info(key, parent, depth))
        model.parent[key] = parent
    p.on_access(["a", "b", "c"])
    leaves = set(model.leaves())
    got = p.victims(10_000, lambda k: k in leaves)
    assert got and set(got) <= leaves == {"c", "d"}


@pytest.mark.parametrize("name", POLICIES)
def test_on_remove_forgets(name):
    p = build(name, FakeClock())
    p.on_insert(info("a", None, 0))
    p.on_insert(info("b", "a", 1))
    p.on_remove("b")
    assert "b" not in p and "a" in p and len(p) == 1
    assert p.victims(100, lambda k: True) == ["a"]  # a is a leaf again
    p.on_remove("a")
    assert len(p) == 0 and p.victims(100, lambda k: True) is None
    p.on_remove("zzz")  # unknown keys are ignored


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_against_a_model(name, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    future = {k: sorted(rng.sample(range(400), 5)) for k in range(60)}
    p = build(name, clock, future)
    model = Model()
    pinned: set = set()
    next_key = 0
    for step in range(400):
        clock.now = step
        op = rng.random()
        if op < 0.4 and next_key < 60:
            parent = rng.choice([None, *model.parent]) if model.parent else None
            depth = len(model.chain(parent)) if parent is not None else 0
            p.on_insert(info(next_key, parent, depth, nbytes=rng.choice([100, 200])))
            model.parent[next_key] = parent
            next_key += 1
        elif op < 0.65 and model.parent:
            p.on_access(model.chain(rng.choice(list(model.parent))))
        elif op < 0.75 and model.parent:
            pinned ^= {rng.choice(list(model.parent))}
        elif op < 0.8:
            p.on_feedback(rng.choice([*model.parent, "unknown"]), rng.random())
        elif model.parent:
            leaves = set(model.leaves()) - pinned
            got = p.victims(rng.choice([1, 250, 500]), lambda k: k in leaves)
            if not leaves:
                assert got is None
            else:
                assert got and set(got) <= leaves and len(set(got)) == len(got)
                victim = got[0]
                p.on_remove(victim)
                del model.parent[victim]
                pinned.discard(victim)
        assert len(p) == len(model.parent)
        for key in model.parent:
            assert key in p


def test_lfu_keeps_the_most_hit_leaf():
    p = build("lfu", FakeClock())
    for k in "abc":
        p.on_insert(info(k, None, 0))
    p.on_access(["a"]); p.on_access(["a"]); p.on_access(["c"])
    assert p.victims(100, lambda k: True) == ["b"]


def test_belady_evicts_the_furthest_next_use():
    clock = FakeClock()
    p = build("belady", clock, {"a": [0, 5], "b": [0, 2], "c": [0]})
    for k in "abc":
        p.on_insert(info(k, None, 0))
    assert p.victims(100, lambda k: True) == ["c"]  # never used again
    assert p.victims(200, lambda k: k != "c") == ["a", "b"]


def test_attention_values_are_monotone_along_chains():
    clock = FakeClock()
    p = AttentionPolicy(clock=clock)
    chain = [f"k{i}" for i in range(12)]
    for i, k in enumerate(chain):
        p.on_insert(BlockInfo(k, chain[i - 1] if i else None, i, 100, 512))
    branch = ["k0", "k1", "x2", "x3"]
    p.on_insert(BlockInfo("x2", "k1", 2, 100, 512))
    p.on_insert(BlockInfo("x3", "x2", 3, 100, 512))
    for t in range(1, 50):
        clock.now = t * 7.0
        p.on_access(chain[: 1 + t % 12])
        if t % 5 == 0:
            p.on_access(branch)
            p.on_feedback("x3", 1.0)
        for seq in (chain, branch):
            values = [p.value(k) for k in seq]
            assert all(a >= b for a, b in zip(values, values[1:])), values
    # Removing leaves keeps the rule: a parent that becomes a leaf is worth at least what its children were.
    for seq in (branch[2:], chain[1:]):
        for k in reversed(seq):
            before = p.value(k)
            parent = p._leaves.parent_of(k)
            p.on_remove(k)
            assert p.value(parent) >= before


def test_attention_hits_and_attention_raise_value():
    clock = FakeClock()
    p = AttentionPolicy(clock=clock, params=AttentionParams(gate=False))
    for k in "abc":
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
    p.on_access(["b"])
    assert p.victims(100, lambda k: True) in (["a"], ["c"])
    p.on_feedback("a", 1.0)
    p.on_feedback("c", 0.0)
    assert p.victims(100, lambda k: True) == ["c"]


def _gate_after(signal) -> float:
    """Feed 6000 blocks whose reuse is decided by `reused(i)`; return the learned gate."""
    rng = random.Random(3)
    clock = FakeClock()
    p = AttentionPolicy(clock=clock)
    for i in range(6000):
        reused = rng.random() < 0.3
        p.on_insert(BlockInfo(i, None, 0, 100, 16, attention=signal(reused, rng)))
        if reused:
            p.on_access([i])
    return p.gate.value()


def test_attention_gate_opens_for_a_predictive_signal_and_stays_shut_for_noise():
    assert _gate_after(lambda reused, rng: 0.9 if reused else 0.1) > 0.9
    assert _gate_after(lambda reused, rng: rng.random()) < 0.1
    assert _gate_after(lambda reused, rng: 0.1 if reused else 0.9) == 0.0  # anti-predictive: neutral
    p = AttentionPolicy(clock=FakeClock())
    p.on_insert(BlockInfo("x", None, 0, 100, 16, attention=1.0))
    assert p.gate.value() == 0.0  # too few samples: neutral


def test_attention_gate_counts_reuse_after_eviction():
    """A block evicted before its reuse still counts: re-admission from the ghost table is a re-reference."""
    rng = random.Random(5)
    p = AttentionPolicy(clock=FakeClock(), params=AttentionParams(ghost_factor=100.0))
    for i in range(100):  # resident blocks: the ghost table holds ghost_factor x resident entries
        p.on_insert(BlockInfo(("anchor", i), None, 0, 100, 16))
    for i in range(6000):
        reused = rng.random() < 0.3
        p.on_insert(BlockInfo(i, None, 0, 100, 16, attention=0.9 if reused else 0.1))
        p.on_remove(i)  # evicted at once: never hit while resident
        if reused:
            p.on_insert(BlockInfo(i, None, 0, 100, 16))
            p.on_remove(i)
    assert p.gate.value() > 0.9


# -- store-level scenarios -------------------------------------------------------------------
BLOCK = 4096


@pytest.fixture
def make_store(store_factory):
    def _make(name: str, capacity_blocks: int, future: dict | None = None):
        clock = FakeClock()
        store = store_factory(capacity_blocks * BLOCK, BLOCK, prefault=False, policy="lru" if name == "belady" else name,
                              clock=clock)
        ns = Namespace("test", "bf16", 1, 1, 1, 16, BLOCK)
        if name == "belady":
            store.placement.policies["host"] = BeladyPolicy(
                {block_key(ns.id, k): v for k, v in (future or {}).items()}, now=lambda: int(clock.now), clock=clock
            )
        return store, store.register_namespace(ns), clock

    return _make


def h(*parts) -> bytes:
    return ("/".join(map(str, parts))).encode().ljust(16, b"\0")[:16]


def put_chain(store, ns, hashes, owner="w") -> int:
    parents = [None] + hashes[:-1]
    entries = store.reserve(ns, list(zip(hashes, parents)), owner)
    ok = 0
    while ok < len(entries) and entries[ok] is not None:
        ok += 1
    if ok:
        store.commit(ns, hashes[:ok], owner)
    return ok


def no_orphans(store) -> bool:
    return all(e.parent is None or e.parent in store.index.entries for e in store.iter_entries())


@pytest.mark.parametrize("name", POLICIES)
def test_store_pinned_blocks_survive_pressure(name, make_store):
    store, ns, clock = make_store(name, 8)
    hot = [h("hot", i) for i in range(3)]
    assert put_chain(store, ns, hot) == 3
    store.pin(ns, hot, "reader")
    for r in range(10):
        clock.now = r + 1
        put_chain(store, ns, [h("cold", r, i) for i in range(4)])
        assert store.check() == [] and no_orphans(store)
        assert store.lookup(ns, hot).hits == 3
    store.release(ns, hot, "reader")
    assert store.check() == []


@pytest.mark.parametrize("name", POLICIES)
def test_store_uncommitted_blocks_are_never_evicted(name, make_store):
    store, ns, clock = make_store(name, 6)
    pending = [h("pending", i) for i in range(3)]
    entries = store.reserve(ns, list(zip(pending, [None] + pending[:-1])), "writer")
    assert all(e is not None for e in entries)
    for r in range(6):
        clock.now = r + 1
        put_chain(store, ns, [h("other", r, i) for i in range(2)])
        assert all(block_key(ns, k) in store.index.entries for k in pending)
        assert store.check() == []
    store.commit(ns, pending, "writer")
    assert store.lookup(ns, pending).hits == 3
    assert store.check() == [] and no_orphans(store)


@pytest.mark.parametrize("name", POLICIES)
def test_store_full_of_pins_refuses_instead_of_evicting(name, make_store):
    store, ns, _ = make_store(name, 4)
    chain = [h("p", i) for i in range(4)]
    assert put_chain(store, ns, chain) == 4
    store.pin(ns, chain, "reader")
    assert put_chain(store, ns, [h("q", 0)]) == 0  # no room: refused, nothing pinned evicted
    assert store.shared.counters["put_capacity_rejects"] >= 1
    assert store.lookup(ns, chain).hits == 4
    store.release(ns, chain, "reader")
    assert put_chain(store, ns, [h("q", 0)]) == 1
    assert store.check() == [] and no_orphans(store)


@pytest.mark.parametrize("name", POLICIES)
def test_store_random_workload_stays_consistent(name, make_store):
    rng = random.Random(7)
    convs = [[h("c", c, i) for i in range(rng.randint(2, 9))] for c in range(12)]
    plan = [rng.randrange(len(convs)) for _ in range(150)]
    future = {}
    for pos, c in enumerate(plan):
        for k in convs[c]:
            future.setdefault(k, []).append(pos)
    store, ns, clock = make_store(name, 24, future)
    hits = 0
    for pos, c in enumerate(plan):
        clock.now = pos
        chain = convs[c]
        n = store.lookup(ns, chain).hits
        hits += n
        if n:
            store.pin(ns, chain[:n], "engine")
            store.release(ns, chain[:n], "engine")
        rest = chain[n:]
        if rest:
            parents = [chain[n - 1] if n else None] + rest[:-1]
            entries = store.reserve(ns, list(zip(rest, parents)), "engine")
            ok = 0
            while ok < len(entries) and entries[ok] is not None:
                ok += 1
            if ok:
                store.commit(ns, rest[:ok], "engine", attention=[rng.random() for _ in range(ok)])
        if pos % 10 == 0:
            assert store.check() == [] and no_orphans(store)
    assert store.check() == [] and no_orphans(store)
    assert hits > 0
    assert store.host.used_bytes <= store.host.capacity_bytes


@pytest.mark.parametrize("name", ["lfu", "arc", "s3fifo", "attention", "belady"])
def test_victims_stop_after_exposing_a_parent(name):
    """Only current leaves may be named; once a victim's parent would become a leaf, the answer ends."""
    clock = FakeClock()
    p = build(name, clock, {"d": [5], "e": [6]})  # a, b, c are never used again
    for key, parent, depth in [("a", None, 0), ("b", "a", 1), ("c", "b", 2), ("d", None, 0), ("e", None, 0)]:
        p.on_insert(info(key, parent, depth))
    clock.now = 1
    p.on_access(["d"]); p.on_access(["e"]); p.on_access(["d"]); p.on_access(["e"])
    leaves = {"c", "d", "e"}
    got = p.victims(300, lambda k: k in leaves)
    assert got is not None and set(got) <= leaves
    if "c" in got:
        assert got[-1] == "c"  # nothing named after the victim that exposes b
    if name in ("lfu", "attention", "belady"):
        assert got == ["c"]


@pytest.mark.parametrize("ghost_factor, first_victim", [(4.0, "y"), (0.0, "x")])
def test_lfu_resumes_an_evicted_blocks_count_from_its_ghost(ghost_factor, first_victim):
    """x is hit twice, evicted, and comes back: with the ghost table it resumes count 4 and
    outranks y, a newer block with count 1; without (ghost_factor 0) it starts over at 1 and,
    older than y, goes first."""
    from kvstore.eviction.lfu import LFUPolicy

    p = LFUPolicy(clock=lambda: 0.0, ghost_factor=ghost_factor)
    p.on_insert(BlockInfo("x", None, 0, 1))
    p.on_access(["x"])
    p.on_access(["x"])
    p.on_insert(BlockInfo("keep", None, 0, 1))  # one resident block, so a ghost table of 4x has room
    p.on_remove("x")
    p.on_insert(BlockInfo("x", None, 0, 1))
    p.on_insert(BlockInfo("y", None, 0, 1))
    p.on_access(["keep"])
    assert p.victims(1, lambda k: True) == [first_victim]
    with pytest.raises(ValueError):
        LFUPolicy(ghost_factor=-1)


@pytest.mark.parametrize("name", ["lfu", "arc", "s3fifo", "attention"])
def test_victims_the_store_did_not_take_are_named_again(name):
    """`LeafQueues.pick` keeps its victims' heap entries aside until the next call: the ones the
    store did not remove must come back, in the same order, and removed ones must not."""
    clock = FakeClock()
    p = build(name, clock, {})
    for i in range(6):
        clock.now = i
        p.on_insert(info(f"k{i}", None, 0))
    first = p.victims(300, lambda k: True)
    assert first is not None and len(first) == 3
    assert p.victims(300, lambda k: True) == first  # nothing taken: the same answer
    p.on_remove(first[0])
    again = p.victims(300, lambda k: True)
    assert again[:2] == first[1:] and first[0] not in again


@pytest.mark.parametrize("from_heaps", [0, 10**9], ids=["leaves found in the heaps", "in every record"])
def test_leaf_queues_rekey_reorders_every_leaf_at_once(from_heaps, monkeypatch):
    from kvstore.eviction import leaves
    from kvstore.eviction.leaves import LeafQueues

    monkeypatch.setattr(leaves, "REKEY_FROM_HEAPS", from_heaps)
    q = LeafQueues()
    for i, (key, parent) in enumerate([("a", None), ("b", "a"), ("c", None), ("d", None)]):
        q.add(key, parent, 100, "v", i)
    assert q.pick("v", 300, lambda k: True) == ["b"]  # b (1) exposes a: the answer ends there
    q.rekey({"a": 9, "b": 8, "c": 2, "d": 1})
    assert q.pick("v", 300, lambda k: True) == ["d", "c", "b"]  # a is internal: never named
    assert q.get("a").prio == 9


@pytest.mark.parametrize("name", ["lru", "lfu", "arc", "s3fifo", "attention", "attention, every key sampled"])
def test_insert_many_is_inserts_at_one_clock_reading(name):
    """The store hands a policy the blocks of one commit in one call (`on_insert_many`); that must be
    one `on_insert` each with the clock standing still, whatever the policy does with the clock."""
    rng = random.Random(5)
    clocks = (FakeClock(), FakeClock())
    if name.startswith("attention"):  # every key followed by the experts: their lead moves, the tier is re-keyed
        params = AttentionParams(sample_bits=0 if "every" in name else AttentionParams().sample_bits)
        one, many = (AttentionPolicy(c, params) for c in clocks)
    else:
        one, many = (make_policy(name, clock=c) for c in clocks)
    model, next_key, hot = Model(), 0, []
    for step in range(700):
        for c in clocks:
            c.now = step * 3.0
        if step == 350:
            hot = []  # the hot set moves: a long memory stops paying
        if rng.random() < 0.5 or not model.parent:
            parent = rng.choice(model.leaves()) if model.parent and rng.random() < 0.5 else None
            depth = len(model.chain(parent)) if parent is not None else 0
            chain = []
            for _ in range(rng.randint(1, 6)):
                chain.append(info(next_key, parent, depth, nbytes=rng.choice([100, 200])))
                model.parent[next_key] = parent
                parent, depth, next_key = next_key, depth + 1, next_key + 1
            for block in chain:
                one.on_insert(block)
            many.on_insert_many(chain)
            if len(hot) < 8:
                hot.append(parent)
        else:
            key = rng.choice(hot) if hot and rng.random() < 0.7 and hot[-1] in model.parent else None
            key = key if key in model.parent else rng.choice(list(model.parent))
            for p in (one, many):
                p.on_access(model.chain(key))
        while len(model.parent) > 60:
            leaves = set(model.leaves())
            got = one.victims(150, lambda k: k in leaves)
            assert got and many.victims(150, lambda k: k in leaves) == got
            for victim in got:
                one.on_remove(victim)
                many.on_remove(victim)
                del model.parent[victim]
                hot = [k for k in hot if k != victim]
    keys = list(model.parent)
    assert one.describe(keys) == many.describe(keys) and len(one) == len(many) == len(keys)
    if name == "attention, every key sampled":
        assert one.rekeys == many.rekeys > 0  # the batch path followed the same switches


def test_a_burst_clock_reads_once_between_hold_and_release():
    from kvstore.entry import BurstClock
    readings = iter(range(100))
    clock = BurstClock(lambda: float(next(readings)))
    assert clock() == 0.0 and clock() == 1.0  # not held: every call reads
    clock.hold()
    clock.hold()  # (nested)
    assert clock() == 2.0 and clock() == 2.0
    clock.release()
    assert clock() == 2.0  # still held by the outer hold
    clock.release()
    assert clock() == 3.0 and clock() == 4.0


def test_the_demotions_of_one_reserve_share_one_clock_reading(tmp_path):
    """A reserve that demotes many blocks into the disk tier reads the policies' clock once for them (so
    the default policy keeps one count of a first insert for all of them, not one a few blocks)."""
    import uuid

    from kvstore.store import TieredStore
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.host import HostArena

    calls = [0]

    def clock() -> float:
        calls[0] += 1
        return calls[0] / 1000  # a new millisecond at every reading

    block = 4096
    ns = Namespace("burst", "bf16", 1, 1, 64, 16, block)
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 64 * block, block)
    store = TieredStore([host, DiskTier(str(tmp_path / "disk"), 256 * block, page_bytes=block)], policy="attention", clock=clock)
    try:
        store.register_namespace(ns)
        first = [(bytes([1, i]) + bytes(14), None) for i in range(64)]
        store.reserve(ns.id, first, "w")
        store.commit(ns.id, [h for h, _ in first], "w")
        second = [(bytes([2, i]) + bytes(14), None) for i in range(64)]
        before = calls[0]
        got = store.reserve(ns.id, second, "w")  # the 64 blocks of `first` go to disk to make room
        assert all(e is not None for e in got)
        assert store.stats()["tiers"]["disk"]["blocks"] == 64
        assert calls[0] - before <= 2
        disk_policy = store.placement.policies["disk"]
        assert len({id(disk_policy._leaves.tracked[block_key(ns.id, h)].freq) for h, _ in first}) == 1
        store.commit(ns.id, [h for h, _ in second], "w")
        assert store.check() == []
    finally:
        store.close()
        host.close()


def test_attention_describes_a_block_from_its_subtree_not_from_the_whole_tier(make_store):
    """`kvstore inspect` runs on the daemon's loop: the default policy's value of a block (the best of its
    subtree) is read from the store's tree (`tree_children`), walking the asked blocks' subtrees only. It
    says what the walk over every tracked block says, after hits that lifted values unevenly."""
    store, ns, clock = make_store("attention", 64)
    chains = [[h("c", c, i) for i in range(6)] for c in range(6)]
    for chain in chains:  # each chain's head, then later its tail: a tail's value is above its head's own
        assert put_chain(store, ns, chain[:3]) == 3
        clock.now += 300.0
    for chain in chains:
        assert all(store.reserve(ns, list(zip(chain[3:], chain[2:5])), "w"))
        store.commit(ns, chain[3:], "w")
        clock.now += 300.0
    store.pin(ns, chains[2][:4], "r")  # hits lift the hit blocks' values, and their ancestors'
    store.release(ns, chains[2][:4], "r")
    policy = store.placement.policies["host"]
    keys = [block_key(ns, hs[i]) for hs in chains for i in (0, 3, 5)]
    walked: list = []
    tree = policy.tree_children
    assert tree is not None, "the store hands its policies its tree"
    policy.tree_children = lambda key: walked.append(key) or tree(key)
    policy.describe(keys[:3])
    assert walked and set(walked) <= {block_key(ns, x) for x in chains[0]}, "only the asked subtree is walked"
    policy.tree_children = tree
    from_tree = policy.describe(keys)
    policy.tree_children = None  # (a policy on its own: it walks every block it tracks)
    assert from_tree == policy.describe(keys)
    assert all(d is not None and d.startswith("log2 V ") for d in from_tree)
    assert len(set(from_tree)) > 3, "values differ between the blocks (the comparison can fail)"


def test_lru_describes_a_blocks_place_counting_from_the_newest_and_no_further_than_its_bound(monkeypatch):
    """`kvstore inspect` on an LRU tier: a block's place in the order, oldest first, counted from the
    newest end over DESCRIBE_MOST blocks at most (not a pass over the whole tier); an older one says so."""
    from kvstore.eviction import lru

    monkeypatch.setattr(lru, "DESCRIBE_MOST", 5)
    policy = lru.LRUPolicy()
    keys = [("k", i) for i in range(10)]
    for key in keys:
        policy.on_insert(info(key, None, 0))
    policy.on_access([keys[2]])  # now the newest
    assert policy.describe([keys[2], keys[9], keys[6], keys[5], ("k", 99)]) == [
        "lru 10/10", "lru 9/10", "lru 6/10", "lru, older than the newest 5", None]
