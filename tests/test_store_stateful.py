"""Hypothesis stateful test of TieredStore against a dict model.

Invariants checked after every step: capacity never exceeded, pinned and
uncommitted blocks never evicted, get-after-put returns identical bytes unless
the block was evicted, only leaves evicted (no orphans), refcounts never
negative, and `check()` clean.
"""

import os
import uuid

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eviction.base import policy_names
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from tiers.host import HostArena

PAGE = 4096
BLOCK = 6000  # two pages, the second partly used
NUM_PAGES = 12
OWNERS = (1, 2, 3)


def child_hash(parent: bytes | None, token: int) -> bytes:
    return xxhash.xxh3_128_digest((parent or b"root") + token.to_bytes(4, "little"))


class StoreMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.arena = HostArena(f"/dev/shm/kvtest-{uuid.uuid4().hex}", NUM_PAGES * PAGE, PAGE, prefault=False)
        self.store = TieredStore(self.arena, policy=self.policy)
        self.ns = self.store.register_namespace(Namespace("m", "f32", 1, 1, 1, 16, BLOCK))
        self.committed: dict[bytes, bytes] = {}  # model: hash -> payload of committed blocks
        self.reserved: dict[bytes, tuple[int, bytes]] = {}  # hash -> (owner, payload written so far)
        self.pins: dict[int, list[bytes]] = {o: [] for o in OWNERS}
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        self.arena.close()

    # -- helpers ---------------------------------------------------------------
    def present(self, h: bytes) -> bool:
        e = self.store.entries.get((self.ns, h))
        return e is not None

    def parents(self) -> list:
        return [None] + sorted(self.committed)

    # -- rules -------------------------------------------------------------------
    @rule(data=st.data(), owner=st.sampled_from(OWNERS), token=st.integers(0, 5), commit=st.booleans())
    def put(self, data, owner, token, commit):
        parent = data.draw(st.sampled_from(self.parents()))
        h = child_hash(parent, token)
        [entry] = self.store.reserve(self.ns, [(h, parent)], owner)
        if entry is None:
            return
        payload = self.rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        self.arena.write(entry.location, payload)
        assert h not in self.committed and h not in self.reserved
        if commit:
            self.store.commit(self.ns, [h], owner)
            self.committed[h] = payload
        else:
            self.reserved[h] = (owner, payload)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish_reserved(self, data, commit):
        h = data.draw(st.sampled_from(sorted(self.reserved)))
        owner, payload = self.reserved[h]
        try:
            if commit:
                self.store.commit(self.ns, [h], owner)
            else:
                self.store.abort(self.ns, [h], owner)
        except KVStoreError:
            # commit: its parent is still uncommitted; abort: a child was reserved under it.
            assert self.reserved  # nothing changed; the model stays as it is
            return
        del self.reserved[h]
        if commit:
            self.committed[h] = payload

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def acquire_and_read(self, data, owner):
        h = data.draw(st.sampled_from(sorted(self.committed)))
        [entry] = self.store.acquire(self.ns, [h], owner, prefix=True)
        assert entry is not None
        assert self.arena.read(entry.location) == self.committed[h]
        self.pins[owner].append(h)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def release(self, data):
        owner = data.draw(st.sampled_from([o for o in OWNERS if self.pins[o]]))
        h = self.pins[owner].pop()
        self.store.release(self.ns, [h], owner)

    @rule(owner=st.sampled_from(OWNERS))
    def owner_dies(self, owner):
        self.store.release_owner(owner)
        self.pins[owner] = []
        for h in [h for h, (o, _) in self.reserved.items() if o == owner]:
            del self.reserved[h]

    @rule(owner=st.sampled_from(OWNERS))
    def release_unpinned_fails_and_changes_nothing(self, owner):
        before = self.store.stats()
        with pytest.raises(KVStoreError):
            self.store.release(self.ns, [b"\x01" * 16], owner)
        assert self.store.stats() == before

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def model_agrees(self):
        assert self.store.check() == []
        assert self.arena.used_bytes <= self.arena.capacity_bytes
        pinned = {h for hs in self.pins.values() for h in hs}
        for h in list(self.committed):
            if not self.present(h):
                assert h not in pinned, "a pinned block was evicted"
                del self.committed[h]  # evicted
        for h in self.reserved:
            assert self.present(h), "an uncommitted block was evicted"
            assert not self.store.entries[(self.ns, h)].committed
        assert self.store.lookup(self.ns, []).hits == 0
        for h, payload in self.committed.items():
            e = self.store.entries[(self.ns, h)]
            assert e.committed and self.arena.read(e.location) == payload
        store_committed = {k[1] for k, e in self.store.entries.items() if e.committed}
        assert store_committed == set(self.committed)


@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "belady"])
def test_store_against_model(policy):
    machine = type(f"StoreMachine_{policy}", (StoreMachine,), {"policy": policy})
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", "150")),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    runner().runTest()


def test_check_catches_a_broken_children_index_and_remove_walks_it():
    arena = HostArena(f"/dev/shm/kvtest-{uuid.uuid4().hex}", NUM_PAGES * PAGE, PAGE, prefault=False)
    try:
        store = TieredStore(arena, policy="lru")
        ns = store.register_namespace(Namespace("m", "f32", 1, 1, 1, 16, BLOCK))
        a = child_hash(None, 1)
        b, c = child_hash(a, 2), child_hash(a, 3)  # a has two children: the set form of the index
        d = child_hash(b, 4)
        blocks = [(a, None), (b, a), (c, a), (d, b)]
        assert all(store.reserve(ns, blocks, 1))
        store.commit(ns, [a, b, c, d], 1)
        assert store.check() == []
        root = store.entries[(ns, a)]
        assert root.kids == {(ns, b), (ns, c)}
        root.kids = (ns, b)  # forget c
        assert any("children index" in p for p in store.check())
        root.kids = {(ns, b), (ns, c)}
        assert store.remove(ns, [b]) == 2  # b and d, not its sibling c
        assert root.kids == (ns, c) and store.check() == []
        assert store.remove(ns, [a]) == 2 and not store.entries and store.check() == []
    finally:
        arena.close()
