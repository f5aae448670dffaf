"""The disk tier's integrity: what a restart brings back, damage found and never served, the index's
records against the tier's blocks (`check`), one owner per folder. Real files with O_DIRECT, LMDB,
shared memory (the harness of tests/test_disk.py)."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from kvstore.errors import KVStoreError
from kvstore.keys import block_key, key_hash
from kvstore.tiers.disk import DATA_FILE, DiskTier, record_key
from kvstore.tiers.disk_slot import extents_of
from tests.helpers import chain_hashes, payload_bytes
from tests.test_disk import BLOCK, NS, PAGE, corrupt_on_disk, harness  # noqa: F401  (harness: the fixture)

def test_restart_round_trip(harness):
    chains = [chain_hashes(s, 5) for s in range(6)]
    harness.spill(*chains)
    store = harness.store
    on_disk = {key_hash(e.key) for e in store.iter_entries() if e.tier == "disk"}
    assert {h for c in chains for h in c} <= on_disk
    assert store.check() == []
    store = harness.reopen()
    assert NS.id in store.shared.namespaces  # namespaces survive
    assert store.check() == []
    assert {key_hash(e.key) for e in store.iter_entries()} >= on_disk  # close() also persisted the host tier
    for c in chains:
        assert store.lookup(NS.id, c).tiers == ("disk",) * 5
        assert harness.get(c) == [payload_bytes(h, BLOCK) for h in c]
    assert store.check() == []


def test_sigterm_path_persists_the_host_tier(harness):
    """close() (the daemon's drain) writes host blocks to disk: a restart serves everything."""
    chains = [chain_hashes(s, 3) for s in range(5)]
    for c in chains:
        harness.put(c)
    store = harness.store
    assert any(e.tier == "host" for e in store.iter_entries())
    everything = {key_hash(e.key) for e in store.iter_entries()}
    store = harness.reopen()
    assert {key_hash(e.key) for e in store.iter_entries()} == everything
    for c in chains:
        assert harness.get(c) == [payload_bytes(h, BLOCK) for h in c]
    assert store.check() == []


def test_restart_serves_every_disk_block_one_at_a_time(harness):
    hashes = chain_hashes(0, 6)
    harness.spill(hashes)
    store = harness.store
    on_disk = [h for h, t in zip(hashes, store.lookup(NS.id, hashes).tiers) if t == "disk"]
    store = harness.reopen()
    assert store.check() == []
    recovered = {key_hash(e.key) for e in store.iter_entries()}
    assert recovered >= set(on_disk)
    # One block at a time keeps the host tier (4 blocks) from being the limit.
    for h in on_disk:
        assert store.lookup(NS.id, [h]).hits == 1
        e = store.pin(NS.id, [h], "r", prefix=False)
        e = asyncio.run(store.prepare_read(e, "r"))
        if e[0] is None:  # its parent is on disk: promotion keeps the tree rule
            store.release(NS.id, [], "r")
            assert store.shared.counters["promotions_skipped_parent_on_disk"] >= 1
            continue
        assert store.host.read(e[0].location) == payload_bytes(h, BLOCK)
        store.release(NS.id, [h], "r")
    assert store.check() == []


def test_corruption_is_detected_and_never_served(harness):
    hashes = chain_hashes(0, 8)
    harness.spill(hashes)
    store = harness.store
    store.flush()
    victim = store.index.entries[block_key(NS.id, hashes[6])]
    offset = extents_of(victim.location)[0][0]
    harness.close()
    with open(os.path.join(harness.folder, DATA_FILE), "r+b") as f:
        f.seek(offset + 1000)
        f.write(b"\xff\x00\xee")
    store = harness.open()
    assert store.check() == []  # the index is consistent; corruption is found on read
    got = harness.get(hashes[:8])
    assert got[:6] == [payload_bytes(x, BLOCK) for x in hashes[:6]] or got[0] is not None
    assert got[6] is None and got[7] is None
    assert store.stats()["tiers"]["disk"]["checksum_failures"] == 1
    assert store.lookup(NS.id, hashes).hits == 6  # the corrupt block and its subtree are gone
    store.flush()
    assert record_key(victim.key) not in store.disk.index_records()
    assert store.check() == []
    store = harness.reopen()  # and stay gone after a restart
    assert store.lookup(NS.id, hashes).hits <= 6
    assert store.check() == []


def test_corruption_while_running_with_other_pins(harness):
    hashes = chain_hashes(0, 8)
    harness.spill(hashes)
    store = harness.store
    store.flush()
    e = store.index.entries[block_key(NS.id, hashes[2])]
    assert e.tier == "disk"
    corrupt_on_disk(harness, e)
    other = store.pin(NS.id, hashes, "other")
    assert all(x is not None for x in other)
    entries = store.pin(NS.id, hashes, "r")
    got = asyncio.run(store.prepare_read(entries, "r"))
    assert [x is not None for x in got] == [True, True, False, False, False, False, False, False]
    store.release(NS.id, hashes[:2], "r")
    store.release(NS.id, hashes, "other")  # ghost pins of removed blocks are accepted
    with pytest.raises(KVStoreError):
        store.release(NS.id, hashes[:1], "other")
    assert store.check() == []


def test_orphan_records_are_dropped_at_open(harness):
    hashes = chain_hashes(0, 8)
    harness.spill(hashes)
    store = harness.store
    store.flush()
    parent = store.index.entries[block_key(NS.id, hashes[5])]
    assert parent.tier == "disk"
    disk = store.disk
    harness.close()
    # Delete a middle record behind the store's back: its descendants become orphans.
    import lmdb

    env = lmdb.open(os.path.join(harness.folder, "index.lmdb"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        assert txn.delete(record_key(parent.key))
    env.close()
    store = harness.open()
    assert store.lookup(NS.id, hashes).hits == 5
    assert store.shared.counters["disk_orphans_dropped"] == 2
    assert store.check() == []
    del disk


def test_check_catches_a_missing_index_record(harness):
    hashes = chain_hashes(0, 8)
    harness.spill(hashes)
    store = harness.store
    store.flush()
    e = next(e for e in store.iter_entries() if e.tier == "disk")
    with store.disk.env.begin(write=True, db=store.disk._db_blocks) as txn:
        txn.delete(record_key(e.key))
    assert any("no index record" in p for p in store.check())
    with store.disk.env.begin(write=True, db=store.disk._db_blocks) as txn:
        txn.put(b"stray", msgpack.packb({"e": [], "n": 0, "x": 0}))
    assert any("belong to no disk block" in p for p in store.check())


def test_check_catches_leaked_and_double_owned_disk_pages(harness):
    hashes = chain_hashes(0, 4)
    harness.spill(hashes)
    store = harness.store
    leaked = store.disk.allocate(BLOCK)
    assert any("disk pages leaked" in p for p in store.check())
    store.disk.release(leaked, None)
    assert store.check() == []
    e = store.index.entries[block_key(NS.id, hashes[3])]
    store.disk.alloc.free(extents_of(e.location))  # free a live block's pages behind the store's back
    assert any("disk pages owned twice" in p for p in store.check())
    store.disk.alloc.allocate(BLOCK)  # take them back (the stack hands out the same pages)
    assert store.check() == []


def test_slot_reuse_never_serves_the_old_block(harness):
    """Evict from disk, reuse the slot, restart: the evicted block is gone and the new one intact."""
    store = harness.store
    for s in range(20):
        harness.put(chain_hashes(s, 2))
    store = harness.reopen()
    for e in list(store.iter_entries()):
        assert type(e.location) is int  # (exact blocks of one page, recovered: no slot object)
    for s in range(20):
        c = chain_hashes(s, 2)
        for h, data in zip(c, harness.get(c)):
            assert data is None or data == payload_bytes(h, BLOCK)
    assert store.check() == []


def test_a_folder_has_one_owner(harness):
    with pytest.raises(OSError, match="in use"):
        DiskTier(harness.folder, 8 * BLOCK, page_bytes=PAGE)
    assert harness.store.check() == []
