"""The Hypothesis store model (tests/test_store_stateful.py) run over a [host, disk] TieredStore, every policy.

Same rules and invariants, with a disk tier under a 3-block host tier: reads
promote, evictions demote, and a `restart` rule closes the store (persisting
the host tier) and reopens it on the same folder. The model's payloads are
compared with the bytes wherever a block lives (host pages, a staging buffer,
or its disk slot read back with O_DIRECT and checksum-verified).
"""

import asyncio
import os
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from eviction.base import policy_names
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from tests.test_store_stateful import BLOCK, PAGE, StoreMachine, child_hash
from kvstore.store import TieredStore
from tiers.disk import DiskTier
from tiers.host import HostArena

HOST_PAGES = 6  # three blocks: demotions start early in every example
DISK_BLOCKS = 8
NS = Namespace("m", "f32", 1, 1, 1, 16, BLOCK)


class DiskStoreMachine(StoreMachine):
    folder: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.arena.close()
        self.folder = os.path.join(self.base, uuid.uuid4().hex)
        self._open()
        self.restarts = 0

    def _open(self) -> None:
        self.arena = HostArena(f"/dev/shm/kvtest-{uuid.uuid4().hex}", HOST_PAGES * PAGE, PAGE, prefault=False)
        disk = DiskTier(self.folder, DISK_BLOCKS * 2 * PAGE, page_bytes=PAGE, staging_bytes=4 * 2 * PAGE)
        self.store = TieredStore([self.arena, disk], policy=self.policy)
        self.ns = self.store.register_namespace(NS)

    def teardown(self) -> None:
        self.store.close(persist=False)
        self.arena.close()

    def bytes_of(self, h: bytes) -> bytes:
        e = self.store.entries[(self.ns, h)]
        if e.tier == "host":
            return self.arena.read(e.location)
        slot = e.location
        if slot.pending:
            return slot.job.view().tobytes()
        out = np.empty(e.nbytes, dtype=np.uint8)
        assert self.store.disk.read_block(slot.extents, e.nbytes, slot.known_checksum(), [out]), "checksum"
        return out.tobytes()

    @rule(owner=st.sampled_from((1, 2, 3)), tokens=st.lists(st.integers(6, 40), min_size=1, max_size=4, unique=True))
    def put_committed_children(self, owner, tokens):
        """Commit several blocks under one random present block (or as roots): pressure on both tiers."""
        parent = sorted(self.committed)[tokens[0] % len(self.committed)] if self.committed and tokens[0] % 3 else None
        for token in tokens:
            h = child_hash(parent, token)
            if self.present(h):
                continue
            [entry] = self.store.reserve(self.ns, [(h, parent)], owner)
            if entry is None:
                continue
            payload = self.rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
            self.arena.write(entry.location, payload)
            self.store.commit(self.ns, [h], owner)
            self.committed[h] = payload

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), owner=st.sampled_from((1, 2, 3)))
    def acquire_and_read(self, data, owner):
        h = data.draw(st.sampled_from(sorted(self.committed)))
        [entry] = self.store.acquire(self.ns, [h], owner, prefix=True)
        assert entry is not None
        parent = self.store.entries.get(entry.parent) if entry.parent is not None else None
        parent_on_disk = parent is not None and parent.tier == "disk"
        [entry] = asyncio.run(self.store.prepare_read([entry], owner))
        if entry is None:  # promotion refused: the tree rule, or a host tier full of pins/reservations
            return
        assert entry.tier == "host" and not parent_on_disk
        assert self.arena.read(entry.location) == self.committed[h]
        self.pins[owner].append(h)

    @rule(owner=st.sampled_from((1, 2, 3)))
    def release_unpinned_fails_and_changes_nothing(self, owner):
        before = self.store.stats()
        with pytest.raises(KVStoreError):
            self.store.release(self.ns, [b"\x01" * 16], owner)
        after = self.store.stats()
        assert after["counters"] == before["counters"] and after["blocks"] == before["blocks"]

    @rule(dice=st.integers(0, 7))
    def restart(self, dice):
        if dice:  # restarts are rarer than the other rules
            return
        before = {h for h in self.committed if self.present(h)}
        self.store.close()
        self.arena.close()
        self._open()
        self.restarts += 1
        self.pins = {o: [] for o in self.pins}
        self.reserved = {}
        after = {k[1] for k in self.store.entries}
        assert after <= before, "a restart brought back a block that was not committed"
        self.committed = {h: p for h, p in self.committed.items() if h in after}

    @invariant()
    def model_agrees(self):
        assert self.store.check() == []
        assert self.arena.used_bytes <= self.arena.capacity_bytes
        assert self.store.disk.used_bytes <= self.store.disk.capacity_bytes
        pinned = {h for hs in self.pins.values() for h in hs}
        for h in list(self.committed):
            if not self.present(h):
                assert h not in pinned, "a pinned block was evicted"
                del self.committed[h]
        for h in self.reserved:
            assert self.present(h) and not self.store.entries[(self.ns, h)].committed
        for h, payload in self.committed.items():
            assert self.bytes_of(h) == payload
        assert {k[1] for k, e in self.store.entries.items() if e.committed} == set(self.committed)


@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "belady"])
def test_disk_store_against_model(tmp_path, policy):
    machine = type(f"DiskStoreMachine_{policy}", (DiskStoreMachine,), {"policy": policy, "base": str(tmp_path)})
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", "60" if policy == "lru" else "15")),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    runner().runTest()
