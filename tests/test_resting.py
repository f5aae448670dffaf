"""Blocks at rest (kvstore/resting.py): the disk tier's plain chain blocks kept as rows, woken as they were."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.background import RECOVERY_STEP_BLOCKS, Background
from kvstore.keys import block_key, key_hash
from kvstore.resting import RestingRows
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostArena
from tests.helpers import chain_hashes, namespace, payload_bytes, payload_for, put_one_by_one, wait_for

BLOCK = 4096
NS = namespace("rest", BLOCK, dtype="bf16")


class Ticking:
    """A clock that moves a millisecond at every reading: two stores fed the same calls read the same times."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> float:
        self.n += 1
        return self.n / 1000


def open_store(folder, host_blocks: int = 16, disk_blocks: int = 96, policy: str = "attention") -> TieredStore:
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", host_blocks * BLOCK, BLOCK)
    disk = DiskTier(str(folder), disk_blocks * BLOCK, page_bytes=BLOCK)
    store = TieredStore([host, disk], policy=policy, clock=Ticking())
    store.register_namespace(NS)
    return store


@pytest.fixture
def stores(tmp_path):
    made: list[TieredStore] = []

    def make(name: str, **kw) -> TieredStore:
        made.append(open_store(tmp_path / name, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
        s.host.close()


def put(store: TieredStore, hashes: list[bytes], parent: bytes | None = None) -> int:
    return put_one_by_one(store, NS.id, hashes, BLOCK, parent)


def get(store: TieredStore, hashes: list[bytes], prefix: bool = True) -> list[bytes | None]:
    """Acquire (promoting to the arena), copy out, release."""
    entries = store.pin(NS.id, hashes, "r", prefix)
    entries = asyncio.run(store.prepare_read(entries, "r"))
    out = [store.host.read(e.location) if e is not None else None for e in entries]
    store.release(NS.id, [key_hash(e.key) for e in entries if e is not None], "r")
    return out


# -- the rows -----------------------------------------------------------------------------------------
def _key(i: int) -> bytes:
    return b"tag-rest" + i.to_bytes(16, "little")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=400))
def test_rows_hold_what_a_dictionary_would(ops):
    """Adds and takes in any order (the tables grow, rows are reused, deletions shift runs back): every
    key is found at its row, with exactly what was put, and a key taken is gone."""
    rows, model = RestingRows(), {}
    for add, i in ops:
        key = _key(i)
        if add and key not in model:
            value = (key, None if i % 5 == 0 else _key(i + 1000), _key(i + 2000), i, (i * 7919) << 96 | (i << 64) | i,
                     i / 3, (i, [i]))
            rows.add(*value)
            model[key] = value
        elif not add and key in model:
            assert rows.take(rows.find(key)) == model.pop(key)
        assert len(rows) == len(model)
    for i in range(301):
        key = _key(i)
        row = rows.find(key)
        assert (row >= 0) == (key in model)
        if row >= 0:
            assert rows.read(row) == model[key]
    assert sorted(rows.read(r)[0] for r in rows.rows()) == sorted(model)


def test_rows_of_one_shard_and_a_clear_error_for_foreign_keys():
    """Keys crowded into few slots still probe right; a key that is not a store key is refused."""
    rows = RestingRows()
    keys = [_key(i) for i in range(5000)]
    for i, key in enumerate(keys):
        rows.add(key, None, key, 0, i, 0.0, (None, None))
    for i, key in enumerate(keys[::3]):
        rows.take(rows.find(key))
    assert all((rows.find(k) >= 0) == (i % 3 != 0) for i, k in enumerate(keys))
    with pytest.raises(ValueError, match="24 bytes"):
        rows.add(b"short", None, keys[1], 0, 0, 0.0, (None, None))
    assert len(rows) == 5000 - len(keys[::3])


# -- a store with blocks at rest ------------------------------------------------------------------------
def test_inner_disk_blocks_rest_lookups_read_them_and_reads_wake_them(stores):
    store = stores("a")
    chains = [chain_hashes(c, 10) for c in range(8)]
    for hs in chains:
        assert put(store, hs) == 10
    rested = store.resting.sweep(10**6)
    disk = store.stats()["tiers"]["disk"]["blocks"]
    assert disk >= 60 and rested == len(store.resting) >= disk - 8  # every inner block of a disk chain
    assert store.stats()["resting"]["blocks"] == rested
    assert store.lookup(NS.id, chains[0]).hits == 10 and len(store.resting) == rested  # read, not woken
    assert store.index.committed(block_key(NS.id, chains[0][3])) and block_key(NS.id, chains[0][3]) in \
        store.placement.policies["disk"]
    assert get(store, chains[0]) == [payload_bytes(h, BLOCK) for h in chains[0]]
    assert store.lookup(NS.id, chains[0]).tiers == ("host",) * 10
    assert len(store.resting) < rested and store.resting.woken >= 9
    assert store.check() == [] and len(store.resting) == 0  # (a check wakes every block first)


def test_memory_of_a_resting_block():
    """A row, its two references and its slots in the table, at 2^17 rows: well under the ~385 B of the
    objects a block at rest no longer has (an entry, a key, a location, a policy record, two table slots)."""
    rows, n = RestingRows(), 1 << 17
    for i in range(n):
        rows.add(_key(i), _key(i + n), _key(i + 1), 7, i << 96 | 4096 << 64 | i, 1.5, (None, None))
    per_block = rows.nbytes / n
    assert 105 + 16 <= per_block < 150, per_block


def _moves(store: TieredStore) -> dict:
    fields = ("blocks", "hits", "evictions", "demotions_in", "promotions_in", "promotions_out")
    return {t: [row.get(f) for f in fields] for t, row in store.stats()["tiers"].items()}


def _state(store: TieredStore, keys: list[bytes]) -> list:
    """What the index and the disk policy hold of each key, comparable between two stores."""
    policy = store.placement.policies["disk"]
    out = []
    for key in keys:
        e = store.index.entries.get(key)
        rec = policy._leaves.tracked.get(key)
        out.append(None if e is None else (e.tier, e.depth, e.pins, e.committed, e.parent, e.tier_children,
                                           sorted(e.child_keys) if isinstance(e.child_keys, set) else e.child_keys,
                                           e.last_access, type(e.location) is int))
        out.append(None if rec is None else (rec.parent, rec.children, rec.token is None, tuple(rec.freq),
                                             tuple(rec.cost), rec.val))
    return out


@pytest.mark.parametrize("seed", [3, 11])
def test_a_store_with_blocks_at_rest_decides_as_one_without(stores, seed):
    """Two stores fed the same operations (writes, reads that promote, reads of a chain's middle, removals,
    writes under a resting parent), one sweeping its disk blocks to rest after each: the same hits in the
    same tiers after every operation, and in the end the same entries and the same policy records, to
    the digit. The disk evicts all along, so resting parents wake as their last child leaves."""
    rng = np.random.default_rng(seed)
    a, b = stores("a"), stores("b")
    chains = [chain_hashes(c, int(rng.integers(2, 12))) for c in range(40)]
    most = 0
    for step in range(400):
        hs = chains[int(rng.integers(len(chains)))]
        op, lo = rng.random(), int(rng.integers(0, len(hs)))
        for s in (a, b):
            if op < 0.45:
                put(s, hs)
            elif op < 0.55:  # a longer prompt over the chain: its new blocks hang under its last one
                tail = chain_hashes(1000 + step, 3)
                put(s, tail, parent=hs[-1])
            elif op < 0.8:
                got = get(s, hs)
                assert all(x is None or x == payload_bytes(h, BLOCK) for h, x in zip(hs, got))
            elif op < 0.92:
                s.pin(NS.id, hs[lo // 2 :], "p", prefix=False)
                s.release(NS.id, [h for h in hs[lo // 2 :] if s.index.pinned_by("p", block_key(NS.id, h))], "p")
            else:
                s.remove(NS.id, hs[:1])
        a.resting.sweep(10**6)
        most = max(most, len(a.resting))
        for hs2 in chains:
            assert a.lookup(NS.id, hs2) == b.lookup(NS.id, hs2), step
        assert _moves(a) == _moves(b), step
    assert most > 20 and a.resting.woken > 20, "blocks rested and woke (the comparison can fail)"
    keys = sorted({block_key(NS.id, h) for hs in chains for h in hs} | {e.key for e in b.iter_entries()})
    assert a.check() == [] and b.check() == []  # (a's check wakes every block)
    assert _state(a, keys) == _state(b, keys)


def test_a_policy_without_rest_keeps_every_block(stores):
    store = stores("a", policy="lru")
    for c in range(6):
        put(store, chain_hashes(c, 10))
    assert not store.resting.on and store.resting.sweep(10**6) == 0 and len(store.resting) == 0
    assert "resting" not in store.stats() and store.check() == []


def kept_disk(tmp_path) -> tuple:
    """A disk tier left by a store that wrote 12 chains of 24 blocks: its folder, the chains."""
    folder = tmp_path / "disk"
    first = open_store(folder, disk_blocks=512)
    chains = [chain_hashes(c, 24) for c in range(12)]
    for hs in chains:
        put(first, hs)
    first.close()
    first.host.close()
    return folder, chains


def reopened(folder) -> tuple[HostArena, TieredStore]:
    """A store over the disk tier kept in `folder` (a new arena), recovering in the background."""
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 16 * BLOCK, BLOCK)
    return host, TieredStore([host, DiskTier(str(folder), 512 * BLOCK, page_bytes=BLOCK)], policy="attention",
                             clock=Ticking(), recover_in_background=True)


def test_a_restart_rests_what_it_adopts_as_it_goes(tmp_path):
    """A store reopened over a kept disk adopts its blocks in the background; the loop's background slices
    put what each step adopted to rest before the next step adopts more (parents once their child arrives),
    so the blocks held as objects stay a step's worth: at the end the same hits as a store recovered without
    resting, and a clean check."""
    folder, chains = kept_disk(tmp_path)
    got = {}
    for sweeping in (True, False):
        host, store = reopened(folder)
        try:
            store.register_namespace(NS)
            work = Background(store.recovery, store.resting if sweeping else None, store.chain)
            most = objects = 0
            while store.recovery.active:  # (a slice past its end at once: one step, then a sweep of what it brought)
                work.slice(0.0)
                most, objects = max(most, len(store.resting)), max(objects, len(store.index.entries))
            disk = store.stats()["tiers"]["disk"]["blocks"]
            if sweeping:  # (every inner block of its chains rests; never more than a step's worth as objects)
                assert most > 50 and len(store.resting) == disk - len(chains) > 150, (most, len(store.resting), disk)
                assert objects < RECOVERY_STEP_BLOCKS + 2 * len(chains) + 16, objects
            else:
                assert objects == disk > 150
            got[sweeping] = [store.lookup(NS.id, hs) for hs in chains]
            assert sum(r.hits for r in got[sweeping]) > 150
            assert get(store, chains[3][:12]) == [payload_bytes(h, BLOCK) for h in chains[3][:12]]
            assert store.check() == []
        finally:
            store.close(persist=False)
            host.close()
    assert got[True] == got[False]


def test_a_fault_in_the_background_work_is_logged_at_once_and_the_store_goes_on(tmp_path, monkeypatch, caplog):
    """A step of a recovery that raises (a fault of the store's own) ends the background work with a log line
    at once, not when its task is collected; the loop and the store go on serving what was adopted."""
    folder, chains = kept_disk(tmp_path)
    host, store = reopened(folder)
    step, steps = store.recovery.step, []

    def failing(budget: int) -> bool:
        steps.append(budget)
        if len(steps) == 3:
            raise RuntimeError("a broken record")
        return step(budget)

    monkeypatch.setattr(store.recovery, "step", failing)

    async def serve() -> int:
        task = asyncio.get_running_loop().create_task(Background(store.recovery, store.resting, store.chain).run())
        served = 0
        while not task.done():  # (a request's turns meanwhile)
            await asyncio.sleep(0)
            served += 1
        with pytest.raises(RuntimeError, match="a broken record"):
            await task
        return served

    try:
        store.register_namespace(NS)
        with caplog.at_level(logging.ERROR, logger="kvstore.background"):
            assert asyncio.run(serve()) >= 1
        assert len(steps) == 3 and "the background work (recovery, blocks to rest) stopped" in caplog.text
        assert get(store, chains[0][:4]) == [payload_bytes(h, BLOCK) for h in chains[0][:4]]  # (adopted on demand)
    finally:
        store.close(persist=False)
        host.close()


def test_kv_events_and_listings_see_blocks_at_rest(stores):
    """Resting and waking report nothing; what the listeners were told stays what the store holds, and a
    resync (`report_all`) reports the blocks at rest from their rows without waking them."""
    store = stores("a")
    held: set = set()

    class Follower:
        def stored(self, e, tier):
            assert (e.key, tier) not in held
            held.add((e.key, tier))

        def removed(self, e, tier):
            held.remove((e.key, tier))

    store.add_listener(Follower())
    chains = [chain_hashes(c, 10) for c in range(10)]
    for hs in chains:
        put(store, hs)
        store.resting.sweep(10**6)
    get(store, chains[2])
    store.resting.sweep(10**6)
    resting = len(store.resting)
    assert resting > 40
    before = set(held)
    held.clear()
    store.report_all()
    assert held == before and len(store.resting) == resting  # (read in place, not woken)
    keys = {e.key for e in store.iter_entries()}  # (wakes them all)
    assert {k for k, _ in held} == keys


def test_a_daemon_rests_its_disk_blocks_and_serves_them(daemon_factory, tmp_path):
    """Through a client: a daemon whose arena holds 64 blocks puts the disk's inner blocks to rest as they
    arrive (its sweep), finds them (lookups read them in place), serves their bytes, reports them."""
    from kvstore.client import KVClient

    d = daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB", host_bytes="4MiB", disk=True)
    ns_def = namespace("daemon-rest", 64 * 1024)
    with KVClient(d.socket_path) as c:
        ns = c.register(ns_def)
        chains = [chain_hashes(s, 32) for s in range(8)]
        for hs in chains:
            assert c.put(ns, [(h, p, payload_for(h, ns_def.block_bytes)) for h, p in zip(hs, [None, *hs[:-1]])]) == 32
        assert wait_for(lambda: d.stats()["resting"]["blocks"] >= 150, 10), d.stats().get("resting")
        resting = d.stats()["resting"]
        assert [c.lookup(ns, hs).hits for hs in chains] == [32] * 8
        assert d.stats()["resting"]["woken"] == resting["woken"]  # (lookups read them in place)
        got = c.get(ns, chains[0][:16])
        assert all(np.array_equal(x, payload_for(h, ns_def.block_bytes)) for h, x in zip(chains[0], got))
        assert d.stats()["resting"]["woken"] > resting["woken"]
    text = d.http("/metrics")[1].decode()
    assert "kvstore_resting_blocks " in text and "kvstore_resting_woken_total " in text


def test_the_resting_benchmark_reports_each_cost(capsys):
    from kvstore.tools.bench.bench_resting import main

    assert main(["--blocks", str(61 * 512), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["rested"] > 20_000 and row["woken"] > 5_000 and row["held"] > 10_000
    assert all(row[k] > 0 for k in ("sweep_us", "wake_us", "holds_us")) and 105 < row["row_bytes"] < 200
