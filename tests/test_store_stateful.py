"""Hypothesis stateful test of TieredStore against a dict model, over every chain of tiers and every policy.

One model, run over the chains `[host]`, `[host, disk]`, `[gpu, host]` and
`[gpu, host, disk]`, where `gpu` is the GPU tier's pool on the torch CPU device
(the emulated tier: the same pages and torch copies as on CUDA) and `disk` the
real disk tier (O_DIRECT data file, LMDB index) under tiny host and GPU
budgets, so demotions start early in every example. Writers put into the GPU
pool or the host arena; readers read from either (a GPU reader also reads the
arena), so reads promote disk -> host -> gpu and evictions demote
gpu -> host -> disk. A `restart` rule closes the store (persisting the tiers
above the disk) and reopens it on the same folder. In the chains marked
`(kept)` the host arena is persistent: a restart re-adopts it, and a `crash`
rule lets the arena go as a killed daemon would (records not yet written are
lost, deletions not yet committed bring their blocks back) before reopening.

Invariants checked after every step: capacity never exceeded in any tier,
pinned and uncommitted blocks never evicted, get-after-put returns identical
bytes unless the block was evicted (read wherever the block lives), only
leaves of their tier demoted, the tree rule across every pair of tiers,
refcounts never negative, and `check()` clean. A mutant store that demotes
non-leaves breaks the tree rule across gpu/host, and the model catches it.

With `compress` (`[compression] disk = true`, the namespace opted into `k4v2`,
`exact_when_busy = false`: which blocks are encoded must not depend on the
encoders' timing, or hypothesis could not replay a run) the disk tier stores
blocks encoded: a block read back after it went through
the disk is the codec's image of what the model held (decode(encode(x)), never
anything else), and from then on the model holds that image.
"""

import asyncio
import itertools
import os
import uuid

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvstore.placement
from kvstore.codec import BlockLayout, Budget, decode, encode, from_float32
from kvstore.compression import Compression, decode_into
from kvstore.config import CompressionConfig
from kvstore.eviction.base import policy_names
from kvstore.entry import RANK, is_leaf_in
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, block_key, key_hash
from kvstore.store import TieredStore
from kvstore.tiers.host import HostArena, remove_stale_arena

PAGE = 4096
BLOCK = 6000  # two pages, the second partly used
OWNERS = (1, 2, 3)
NS = Namespace("m", "f32", 1, 1, 1, 16, BLOCK)
# compressed runs: a block of one layer, one KV head, 24 tokens of 64 bf16 channels (6144 B, two pages; 1378 B
# encoded at k4v2, one page)
LOSSY_NS = Namespace("m", "bfloat16", 1, 1, 64, 24, 6144, layout="cuda/LBHNC", codec="k4v2")
LOSSY_LAYOUT = BlockLayout(1, 1, 24, 64)
BLOCK_TOKENS_LOSSY = 24 * 2 * 64  # elements
POLICIES = [p for p in policy_names() if p != "belady"]
# What a kept host arena's hasher thread changes in the background (tiers/host_index.py: it checksums and
# verifies blocks once the store has been quiet for QUIET_S): these move between two reads of stats.
HASHER_STATS = ("adopted_unchecked", "unverified_blocks", "verified_blocks", "corrupt_blocks", "unchecked_records",
                "checksums_written")
# chain -> pages per tier: small enough that every example demotes
CHAINS = {
    "host": {"host": 12},
    "host+disk": {"host": 6, "disk": 16},
    "gpu+host": {"gpu": 6, "host": 8},
    "gpu+host+disk": {"gpu": 4, "host": 6, "disk": 16},
    "host(kept)": {"host": 12},
    "host(kept)+disk": {"host": 6, "disk": 16},
    "gpu+host(kept)+disk": {"gpu": 4, "host": 6, "disk": 16},
    "gpu x2+host+disk": {"gpu": 4, "gpu_pools": 2, "host": 6, "disk": 16},  # two devices' pools
}


def child_hash(parent: bytes | None, token: int) -> bytes:
    return xxhash.xxh3_128_digest((parent or b"root") + token.to_bytes(4, "little"))


def lossy(payload: bytes) -> bytes:
    return decode(encode(np.frombuffer(payload, np.uint8), LOSSY_LAYOUT, Budget.uniform(LOSSY_LAYOUT, 4, 2))).tobytes()


def make_tiers(pages: dict[str, int], folder: str, kept_arena: str | None = None) -> list:
    tiers = []
    if "gpu" in pages:
        from kvstore.tiers.gpu import GpuPool, GpuTier

        n = pages.get("gpu_pools", 1)
        tiers.append(GpuTier([GpuPool("cpu", pages["gpu"] // n * PAGE, PAGE) for _ in range(n)]))
    path = kept_arena or f"/dev/shm/kvtest-{uuid.uuid4().hex}"
    tiers.append(HostArena(path, pages["host"] * PAGE, PAGE, prefault=False, persistent=kept_arena is not None))
    if "disk" in pages:
        from kvstore.tiers.disk import DiskTier

        tiers.append(DiskTier(folder, pages["disk"] * PAGE, page_bytes=PAGE, staging_bytes=4 * 2 * PAGE,
                              decoder=decode_into))
    return tiers


class StoreMachine(RuleBasedStateMachine):
    chain = "host"
    policy = "lru"
    base = "/tmp"
    watch_demotions = True  # "only leaves demoted", checked at each demotion
    compress = False  # the disk tier stores the namespace's blocks encoded

    def __init__(self) -> None:
        super().__init__()
        self.folder = os.path.join(self.base, uuid.uuid4().hex)
        self.kept_arena = f"/dev/shm/kvtest-{uuid.uuid4().hex}" if "(kept)" in self.chain else None
        self._open()
        self.committed: dict[bytes, bytes] = {}  # model: hash -> payload of committed blocks
        self.last_committed: dict[bytes, bytes] = {}  # hash -> payload of its last commit (what a crash may bring back)
        self.reserved: dict[bytes, tuple[int, bytes]] = {}  # hash -> (owner, payload written so far)
        self.pins: dict[int, list[bytes]] = {o: [] for o in OWNERS}
        self.rng = np.random.default_rng(0)
        self.demoted_non_leaves: list = []

    def _open(self) -> None:
        ticks = itertools.count()
        clock = lambda: float(next(ticks))  # noqa: E731  (deterministic: the policies' decay must not see real time)
        self.store = TieredStore(make_tiers(CHAINS[self.chain], self.folder, self.kept_arena), policy=self.policy,
                                 clock=clock, wall_clock=clock,
                                 compression=Compression(CompressionConfig(disk=self.compress, exact_when_busy=False)))
        self.ns = self.store.register_namespace(LOSSY_NS if self.compress else NS)
        self.writable = [t.name for t in self.store.chain if t.client_readable]
        if not self.watch_demotions:
            return
        placement = self.store.placement
        demote = placement.demote

        def demote_leaves_only(entry):  # "only leaves demoted", seen at the moment of each demotion
            if not is_leaf_in(entry, entry.tier):
                self.demoted_non_leaves.append(entry.key)
            demote(entry)

        placement.demote = demote_leaves_only

    def teardown(self) -> None:
        self.store.close(persist=False)
        if self.kept_arena is not None:
            remove_stale_arena(self.kept_arena)

    # -- helpers ---------------------------------------------------------------
    def present(self, h: bytes) -> bool:
        return block_key(self.ns, h) in self.store.index.entries

    def parents(self) -> list:
        return [None] + sorted(self.committed)

    def write(self, entry, payload: bytes) -> None:
        self.store.tiers[entry.tier].write(entry.location, payload)

    def bytes_of(self, h: bytes) -> bytes:
        """The block's bytes wherever it lives, through the tier interface (disk: verified)."""
        e = self.store.index.entries[block_key(self.ns, h)]
        tier = self.store.tiers[e.tier]
        out = np.empty(e.nbytes, dtype=np.uint8)
        tier.read_blocks(e.location)
        assert tier.read_into(e.location, [out]), "checksum"
        return out.tobytes()

    def matches(self, h: bytes, got: bytes) -> bool:
        """`got` is the model's block, or (compressing) the codec's image of it, which the model then holds."""
        if got == self.committed[h]:
            return True
        if self.compress and got == lossy(self.committed[h]):
            self.committed[h] = self.last_committed[h] = got
            return True
        return False

    def new_payload(self) -> bytes:
        if self.compress:  # values, not random bit patterns (NaNs): the codec quantizes them
            return from_float32(self.rng.standard_normal(BLOCK_TOKENS_LOSSY, np.float32), "bfloat16").tobytes()
        return self.rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()

    def _put(self, owner, parent, token, tier, commit) -> None:
        h = child_hash(parent, token)
        if self.present(h):
            return
        if h in self.committed:  # evicted earlier in this step (a batch of puts): the model forgets it
            assert h not in {p for hs in self.pins.values() for p in hs}, "a pinned block was evicted"
            del self.committed[h]
        [entry] = self.store.reserve(self.ns, [(h, parent)], owner, tier=tier)
        if entry is None:
            return
        assert entry.tier == tier
        payload = self.new_payload()
        self.write(entry, payload)
        assert h not in self.committed and h not in self.reserved
        if commit:
            self.store.commit(self.ns, [h], owner)
            self.committed[h] = self.last_committed[h] = payload
        else:
            self.reserved[h] = (owner, payload)

    # -- rules -------------------------------------------------------------------
    @rule(data=st.data(), owner=st.sampled_from(OWNERS), token=st.integers(0, 5), commit=st.booleans())
    def put(self, data, owner, token, commit):
        parent = data.draw(st.sampled_from(self.parents()))
        self._put(owner, parent, token, data.draw(st.sampled_from(self.writable)), commit)

    @rule(data=st.data(), owner=st.sampled_from(OWNERS),
          tokens=st.lists(st.integers(6, 40), min_size=1, max_size=4, unique=True))
    def put_committed_children(self, data, owner, tokens):
        """Commit several blocks under one random present block (or as roots): pressure on every tier."""
        parent = sorted(self.committed)[tokens[0] % len(self.committed)] if self.committed and tokens[0] % 3 else None
        tier = data.draw(st.sampled_from(self.writable))
        for token in tokens:
            self._put(owner, parent, token, tier, commit=True)

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
            self.committed[h] = self.last_committed[h] = payload

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def acquire_and_read(self, data, owner):
        h = data.draw(st.sampled_from(sorted(self.committed)))
        reader = data.draw(st.sampled_from(self.writable))
        [entry] = self.store.pin(self.ns, [h], owner, prefix=True)
        assert entry is not None
        was = entry.tier
        parent = self.store.index.entries.get(entry.parent) if entry.parent is not None else None
        parent_slow = parent is not None and RANK[parent.tier] > RANK["host"]
        [entry] = asyncio.run(self.store.prepare_read([entry], owner, tier=reader))
        if entry is None:
            # Refused: a block faster than the reader reads (gpu for a host reader), or a promotion
            # refused by the tree rule or by a host tier full of pins and reservations.
            assert RANK[was] < RANK[reader] or RANK[was] > RANK["host"]
            return
        assert RANK[reader] <= RANK[entry.tier] <= RANK["host"], "served from a tier the reader cannot read"
        assert not (RANK[was] > RANK["host"] and parent_slow), "promoted ahead of its parent"
        assert self.matches(h, self.bytes_of(h))
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
        after = self.store.stats()
        if self.store.disk is None:
            assert without_hasher(after) == without_hasher(before)
        else:  # the disk tier's own I/O counters move on in the background
            assert after["counters"] == before["counters"] and after["blocks"] == before["blocks"]

    @precondition(lambda self: any(t.persistent for t in self.store.chain))
    @rule(dice=st.integers(0, 7))
    def restart(self, dice):
        if dice:  # restarts are rarer than the other rules
            return
        before = {h for h in self.committed if self.present(h)}
        self.store.close()
        self._open()
        self.pins = {o: [] for o in self.pins}
        self.reserved = {}
        after = {key_hash(k) for k in self.store.index.entries}
        assert after <= before, "a restart brought back a block that was not committed"
        self.committed = {h: p for h, p in self.committed.items() if h in after}

    @precondition(lambda self: self.kept_arena is not None)
    @rule(dice=st.integers(0, 5))
    def crash(self, dice):
        """The daemon is killed: the arena is let go as is (the other tiers close; the disk's own
        crash behaviour is tests/test_disk_crash.py's), then re-adopted."""
        if dice:
            return
        for tier in self.store.chain:
            if tier.name == "host":
                tier.abandon()
            else:
                tier.close()
        self.store.promoter.shutdown()
        self._open()
        self.pins = {o: [] for o in self.pins}
        self.reserved = {}
        after = {key_hash(k) for k in self.store.index.entries}
        assert after <= set(self.last_committed), "a crash brought back a block that was never committed"
        # Back: what was committed, or removed just before the kill (its deletion not yet committed).
        self.committed = {h: self.last_committed[h] for h in after}

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def model_agrees(self):
        problems = self.store.check()
        assert not problems, problems
        for tier in self.store.chain:
            assert tier.used_bytes <= tier.capacity_bytes, f"{tier.name} over capacity"
        assert not self.demoted_non_leaves, "a block with children in its tier or a faster one was demoted"
        assert all(e.pins >= 0 for e in self.store.index.entries.values())
        pinned = {h for hs in self.pins.values() for h in hs}
        for h in list(self.committed):
            if not self.present(h):
                assert h not in pinned, "a pinned block was evicted"
                del self.committed[h]  # evicted
        for h in self.reserved:
            assert self.present(h), "an uncommitted block was evicted"
            assert not self.store.index.entries[block_key(self.ns, h)].committed
        assert self.store.lookup(self.ns, []).hits == 0
        for h, payload in self.committed.items():
            assert self.store.index.entries[block_key(self.ns, h)].committed and self.matches(h, self.bytes_of(h))
        store_committed = {key_hash(k) for k, e in self.store.index.entries.items() if e.committed}
        assert store_committed == set(self.committed)


def without_hasher(stats: dict) -> dict:
    """`stats` without what the host arena's hasher thread changes on its own (HASHER_STATS)."""
    tiers = {name: {k: v for k, v in tier.items() if k not in HASHER_STATS} for name, tier in stats["tiers"].items()}
    return {**stats, "tiers": tiers}


def run_machine(chain: str, policy: str, base: str, max_examples: int, watch_demotions: bool = True,
                compress: bool = False, **more) -> None:
    fields = {"chain": chain, "policy": policy, "base": base, "watch_demotions": watch_demotions, "compress": compress}
    machine = type(f"StoreMachine_{chain}_{policy}", (StoreMachine,), fields)
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        **more,
    )
    runner().runTest()


def examples(chain: str, policy: str) -> int:
    """Per-run example counts: the host-only chain is cheap; chains with the disk tier pay real fsyncs."""
    default = 150 if chain == "host" else 60 if policy == "lru" else 20 if "disk" in chain else 40
    return int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", default))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_store_against_model(tmp_path, chain, policy):
    run_machine(chain, policy, str(tmp_path), examples(chain, policy))


@pytest.mark.parametrize("chain", ["host+disk", "gpu+host(kept)+disk"])
def test_store_against_model_with_a_compressing_disk(tmp_path, chain):
    run_machine(chain, "lru", str(tmp_path), int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", 25)), compress=True)


def test_model_catches_a_store_that_breaks_the_tree_rule_across_gpu_and_host(tmp_path, monkeypatch):
    """The mutant evicts blocks that are not leaves of their tier: a gpu parent goes down to host while
    its child stays in gpu. The model's check() must fail on it, naming the broken rule (the watch on
    each demotion, which would see the non-leaf first, is off here)."""
    monkeypatch.setattr(kvstore.placement, "is_leaf_in", lambda entry, tier: True)
    with pytest.raises(AssertionError, match="faster than its parent in host"):
        run_machine("gpu+host", "lru", str(tmp_path), 200, watch_demotions=False, report_multiple_bugs=False, database=None,
                    phases=(Phase.generate,))  # found is enough: shrinking the mutant's failure takes minutes


def test_check_catches_a_broken_children_index_and_remove_walks_it():
    arena = HostArena(f"/dev/shm/kvtest-{uuid.uuid4().hex}", 12 * PAGE, PAGE, prefault=False)
    try:
        store = TieredStore(arena, policy="lru")
        ns = store.register_namespace(NS)
        a = child_hash(None, 1)
        b, c = child_hash(a, 2), child_hash(a, 3)  # a has two children: the set form of the index
        d = child_hash(b, 4)
        blocks = [(a, None), (b, a), (c, a), (d, b)]
        assert all(store.reserve(ns, blocks, 1))
        store.commit(ns, [a, b, c, d], 1)
        assert store.check() == []
        root = store.index.entries[block_key(ns, a)]
        assert root.child_keys == {block_key(ns, b), block_key(ns, c)}
        root.child_keys = block_key(ns, b)  # forget c
        assert any("children index" in p for p in store.check())
        root.child_keys = {block_key(ns, b), block_key(ns, c)}
        assert store.remove(ns, [b]) == 2  # b and d, not its sibling c
        assert root.child_keys == block_key(ns, c) and store.check() == []
        assert store.remove(ns, [a]) == 2 and not store.index.entries and store.check() == []
    finally:
        arena.close()
