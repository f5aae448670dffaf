"""Serve first, verify as you go: a kept host arena is adopted without reading a byte (tiers/host_index.py),
its records read while the store serves (tiers/host_scan.py).

Each adopted block's checksum is verified before its bytes are first read (an
acquire, a demotion) or by the index's hasher in the background; a block that
fails is a miss, dropped with its subtree, never served nor copied to another
tier. In process, against a real arena in /dev/shm and a real disk tier; the
arena's bytes are altered between the stop and the restart.
"""

from __future__ import annotations

import asyncio
import logging

import lmdb
import numpy as np
import pytest

import kvstore.store as store_mod
import kvstore.tiers.host_index as host_index
import kvstore.tiers.host_scan as host_scan
from kvstore.keys import Namespace, block_key, hash_blocks
from kvstore.store import TieredStore
from tests.helpers import hold_scans, poll

BLOCK = 8192
NS = Namespace("verify-kept", "bf16", 1, 1, 8, 16, BLOCK)


def payload(h: bytes) -> bytes:
    return h * (BLOCK // len(h))


def write_chain(store: TieredStore, ns: str, hashes: list[bytes]) -> None:
    for e, h in zip(store.reserve(ns, list(zip(hashes, [None] + hashes[:-1])), owner="w"), hashes):
        store.host.write(e.location, np.frombuffer(payload(h), np.uint8))
    store.commit(ns, hashes, owner="w")


def kept_chain(store_factory, blocks: int = 16) -> tuple[str, list[bytes]]:
    """A stopped daemon's arena (its path): one chain of six blocks, recorded with checksums."""
    store = store_factory(blocks * BLOCK, BLOCK, prefault=False, persistent=True)
    hashes = hash_blocks(np.arange(16 * 6), 16)
    write_chain(store, store.register_namespace(NS), hashes)
    store.close()  # a clean stop: every record has its checksum
    return store.host.path, hashes


def reopen(store_factory, path: str, blocks: int = 16, **store_kw) -> TieredStore:
    """A store over the arena kept at `path` (a restart)."""
    return store_factory(blocks * BLOCK, BLOCK, arena=path, prefault=False, persistent=True, **store_kw)


def alter(path: str, store: TieredStore, h: bytes) -> None:
    """Change bytes of block `h` in the arena file, behind the store's back."""
    (offset, _), *_ = store.index.entries[block_key(NS.id, h)].location
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xde\xad")


def read(store: TieredStore, hashes: list[bytes]) -> list[bytes | None]:
    entries = store.pin(NS.id, hashes, "r")
    out = [None if e is None else store.host.read(e.location) for e in entries]
    store.release(NS.id, [h for h, e in zip(hashes, entries) if e is not None], "r")
    return out


def never_quiet(monkeypatch) -> None:
    """The hasher never runs: only a read (or a demotion) verifies."""
    monkeypatch.setattr(host_index, "QUIET_S", float("inf"))
    monkeypatch.setattr(host_index, "CHECK_LAG_S", float("inf"))


def test_a_restart_reads_no_byte_and_an_altered_block_is_never_served(monkeypatch, store_factory):
    path, hashes = kept_chain(store_factory)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path)
    stats = store.host.stats()
    assert stats["adopted_blocks"] == 6 and stats["unverified_blocks"] == 6 and stats["verified_blocks"] == 0
    alter(path, store, hashes[3])
    assert store.lookup(NS.id, hashes).hits == 6  # indexed, not yet read
    got = read(store, hashes)
    assert got[:3] == [payload(h) for h in hashes[:3]]
    assert got[3:] == [None, None, None], "an altered block (or a descendant) was served"
    st = store.stats()
    assert st["counters"]["host_checksum_failures"] == 1 and st["counters"]["host_blocks_discarded"] == 3
    assert store.host.stats()["verified_blocks"] == 3 and store.host.stats()["unverified_blocks"] == 0
    assert store.lookup(NS.id, hashes).hits == 3
    assert store.check() == []


def test_the_hasher_verifies_in_the_background_and_a_failure_is_dropped(monkeypatch, store_factory):
    path, hashes = kept_chain(store_factory)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path)
    alter(path, store, hashes[4])
    monkeypatch.setattr(host_index, "QUIET_S", 0.0)
    store.host.index._hash_wake.set()
    poll(lambda: store.host.stats()["unverified_blocks"] == 0, 30, "the background verification")
    assert store.host.stats()["corrupt_blocks"] == 1 and store.host.stats()["verified_blocks"] == 5
    assert store.lookup(NS.id, hashes).hits == 4  # the store dropped it (and its child) when it looked
    assert store.stats()["counters"]["host_checksum_failures"] == 1
    assert read(store, hashes) == [payload(h) for h in hashes[:4]] + [None, None]
    assert store.check() == []


def test_an_altered_block_is_not_demoted(monkeypatch, store_factory):
    """Eviction reads a victim's bytes to copy them into the disk tier: an unverified block is verified
    first, and one that fails is dropped, not written to the disk with a checksum of its altered bytes."""
    path, hashes = kept_chain(store_factory, blocks=6)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path, blocks=6, disk_bytes=32 * BLOCK, policy="lru")
    ns = store.register_namespace(NS)
    alter(path, store, hashes[5])  # the chain's leaf: the first victim
    other = hash_blocks(np.arange(16 * 3) + 10_000, 16)
    write_chain(store, ns, other)  # three blocks of room: three victims, leaf first
    assert store.index.entries.get(block_key(ns, hashes[5])) is None
    assert store.stats()["counters"]["host_checksum_failures"] == 1
    assert [store.index.entries[block_key(ns, h)].tier for h in hashes[3:5]] == ["disk", "disk"]
    assert store.stats()["tiers"]["disk"]["blocks"] == 2
    store.flush()
    got = asyncio.run(store.acquire(ns, hashes, "r"))[0]
    assert [store.host.read(e.location) if e is not None else None for e in got] == \
        [payload(h) for h in hashes[:5]] + [None]
    store.release(ns, [h for h, e in zip(hashes, got) if e is not None], "r")
    assert store.check() == []


def test_a_freed_block_is_not_verified_against_its_new_bytes(monkeypatch, store_factory):
    """A block dropped before it was verified leaves the list first: its pages, written again by another
    block, are never compared with the old record (no false failure, no record left)."""
    path, hashes = kept_chain(store_factory, blocks=6)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path, blocks=6)
    ns = store.register_namespace(NS)
    assert store.remove(ns, [hashes[2]]) == 4
    write_chain(store, ns, hash_blocks(np.arange(16 * 4) + 20_000, 16))  # into the freed pages
    assert store.host.stats()["unverified_blocks"] == 2
    monkeypatch.setattr(host_index, "QUIET_S", 0.0)
    store.host.index._hash_wake.set()
    poll(lambda: store.host.stats()["unverified_blocks"] == 0, 30, "the background verification")
    assert store.host.stats()["corrupt_blocks"] == 0
    assert store.lookup(ns, hashes).hits == 2 and store.check() == []


def test_a_block_found_altered_before_it_is_adopted_is_never_served(monkeypatch, store_factory):
    """A store that serves first adopts what the arena kept while it serves: the hasher may judge a block
    before the store has adopted it, and the store may hear that verdict before then. The verdict stays
    with the tier until the block is gone, so the block is dropped once adopted, never served."""
    path, hashes = kept_chain(store_factory)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path)
    (offset, _), *_ = store.index.entries[block_key(NS.id, hashes[3])].location
    store.close()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xde\xad")
    store = reopen(store_factory, path, recover_in_background=True)
    poll(lambda: store.recovery.step(1) and not store.recovery.scanning, 30, "the read of the records")
    monkeypatch.setattr(host_index, "QUIET_S", 0.0)
    store.host.index._hash_wake.set()
    poll(lambda: store.host.stats()["unverified_blocks"] == 0, 30, "the background verification")
    assert store.host.stats()["corrupt_blocks"] == 1
    assert store.index.entries.get(block_key(NS.id, hashes[3])) is None  # not adopted yet
    store.placement.reap()  # the store hears of it with nothing to discard yet
    store.recovery.finish()  # adopted now, the altered block with the others
    got = read(store, hashes)
    assert got == [payload(h) for h in hashes[:3]] + [None, None, None], "an altered block was served"
    assert store.stats()["counters"]["host_checksum_failures"] == 1
    assert store.host.failed_checks() == []  # the verdict left with the block
    assert store.check() == []


@pytest.fixture
def held_scan(monkeypatch):
    """The host arena's read of its kept records waits until the returned event is set."""
    event = hold_scans(monkeypatch, host_scan.HostScan)
    yield event
    event.set()


def test_the_store_serves_while_the_kept_records_are_read_and_writes_over_none(monkeypatch, store_factory,
                                                                               held_scan):
    """The records are read in a thread while the store serves (a daemon past its ready line): a lookup
    is a hit all the same (the records of the blocks it names read one by one), a put into the arena is
    refused (it knows no free page: a kept block may sit on any); once read, every kept block is a hit
    with its own bytes and the arena takes writes."""
    path, hashes = kept_chain(store_factory)
    monkeypatch.setattr(store_mod, "RECOVER_BEFORE_SERVING_BLOCKS", 0)  # as with millions of records
    store = reopen(store_factory, path, recover_in_background=True)
    ns = store.register_namespace(NS)
    other = hash_blocks(np.arange(16 * 3) + 30_000, 16)

    async def serve() -> None:
        store.start()
        assert store.host.scanning and store.host.stats()["scanning"]
        assert store.lookup(ns, hashes[:4]).hits == 4  # not read yet: its records read one by one
        assert read(store, hashes[:2]) == [payload(h) for h in hashes[:2]]  # (verified first)
        assert store.host.stats()["verified_blocks"] == 2
        assert store.reserve(ns, [(h, None) for h in other], owner="w") == [None] * 3
        assert store.stats()["counters"]["put_capacity_rejects"] == 3 and store.host.pages.free_pages == 0
        held_scan.set()
        while store.recovery.active:
            await asyncio.sleep(0.01)

    asyncio.run(serve())
    assert not store.host.scanning and store.host.stats()["adopted_blocks"] == 6
    # one key object a block, those adopted early too (the arena's record of it keyed by the index's)
    assert all(store.index.entries[k].key is k for k in store.host.index._recorded)
    assert read(store, hashes) == [payload(h) for h in hashes]
    write_chain(store, ns, other)
    assert store.lookup(ns, other).hits == 3 and read(store, hashes + other) == [payload(h) for h in hashes + other]
    assert store.check() == []


def test_records_that_cannot_be_read_start_the_arena_empty(monkeypatch, store_factory, caplog):
    """An index whose records fail to read (a corrupt B-tree page) is replaced by an empty one: every
    page free, the kept namespaces kept, a log line saying why; the store serves and keeps what it
    writes from then on."""
    path, hashes = kept_chain(store_factory)

    def corrupt(self):
        raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED")

    monkeypatch.setattr(host_scan.HostScan, "_scan", corrupt)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.host"):
        store = reopen(store_factory, path)
    assert "starting empty, not re-adopting the arena" in caplog.text and "MDB_CORRUPTED" in caplog.text
    assert store.lookup(NS.id, hashes).hits == 0 and store.host.pages.free_pages == 16
    assert NS.id in store.host.index.namespaces()[0]
    write_chain(store, store.register_namespace(NS), hashes[:2])
    assert read(store, hashes[:2]) == [payload(h) for h in hashes[:2]]
    assert store.check() == []
    store.close()
    monkeypatch.undo()
    store = reopen(store_factory, path)
    assert store.lookup(NS.id, hashes).hits == 2 and store.check() == []


def test_a_kill_while_the_kept_blocks_are_adopted_loses_none(store_factory):
    """Killed while it adopts what the arena kept (the records read, some blocks adopted, new blocks
    written beside them), the store loses nothing: the next start finds the kept blocks and the new ones."""
    store = store_factory(32 * BLOCK, BLOCK, prefault=False, persistent=True)
    ns = store.register_namespace(NS)
    kept = [hash_blocks(np.arange(16 * 6) + 1000 * c, 16) for c in range(3)]
    for hs in kept:
        write_chain(store, ns, hs)
    path = store.host.path
    store.close()
    store = reopen(store_factory, path, blocks=32, recover_in_background=True)
    while store.recovery.stats()["host"]["adopted_blocks"] < 5:
        store.recovery.step(2)
    assert store.recovery.active and store.recovery.stats()["host"]["adopted_blocks"] < 18
    new = hash_blocks(np.arange(16 * 6) + 9000, 16)
    write_chain(store, ns, new)
    store.host.abandon()  # kill -9
    store = reopen(store_factory, path, blocks=32)
    for hs in kept + [new]:
        assert store.lookup(ns, hs).hits == 6
        assert read(store, hs) == [payload(h) for h in hs]
    assert store.check() == []


def test_the_metrics_show_how_far_a_recovery_has_come(monkeypatch, store_factory, held_scan):
    """While the kept records are read and adopted, the stats and `/metrics` show per tier its stage, the
    records it kept and the blocks adopted so far; once it is done, neither shows a recovery."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.server.admin import AdminView, StoreCollector

    path, hashes = kept_chain(store_factory)
    store = reopen(store_factory, path, recover_in_background=True)
    registry = CollectorRegistry()
    registry.register(StoreCollector(AdminView(store, lambda: {**store.stats(), "sessions": 0, "errors": {}}, "t")))

    def recovery_samples() -> dict:
        text = generate_latest(registry).decode()
        return {(s.name, s.labels["tier"], s.labels["stage"]): s.value
                for f in text_string_to_metric_families(text) if f.name.startswith("kvstore_recovery")
                for s in f.samples}

    host = store.stats()["recovery"]["host"]
    assert host == {**host, "stage": "scan", "kept_records": 6, "adopted_blocks": 0}
    assert recovery_samples() == {("kvstore_recovery_kept_records", "host", "scan"): 6,
                                  ("kvstore_recovery_adopted_blocks", "host", "scan"): 0}
    held_scan.set()
    while store.recovery.stats()["host"]["adopted_blocks"] < 2:
        store.recovery.step(2)
    assert recovery_samples()[("kvstore_recovery_adopted_blocks", "host", "adopt")] == 2
    store.wait_recovered()
    assert "recovery" not in store.stats() and recovery_samples() == {}
    assert store.lookup(NS.id, hashes).hits == 6


def test_a_block_adopted_before_the_records_are_read_is_verified_before_it_is_served(monkeypatch, store_factory,
                                                                                   held_scan):
    """A kept block adopted from its record read on its own, before the scan of the records: its bytes
    are verified against the record's checksum before they are first read, and an altered block is a
    miss, dropped with its subtree, never served; once the scan's rows come, its pages are free again and
    no record of it is left, here or at the next start."""
    path, hashes = kept_chain(store_factory)
    never_quiet(monkeypatch)
    store = reopen(store_factory, path)
    alter(path, store, hashes[3])
    store.close()
    store = reopen(store_factory, path, recover_in_background=True)
    assert store.host.scanning and store.lookup(NS.id, hashes).hits == 6  # (a lookup reads no byte)
    assert read(store, hashes) == [payload(h) for h in hashes[:3]] + [None] * 3, "an altered block was served"
    assert store.stats()["counters"]["host_checksum_failures"] == 1
    assert store.lookup(NS.id, hashes).hits == 3
    # the dropped blocks' pages stay taken while the records are read (the scan counts them its records'):
    # nothing is written there meanwhile
    other = hash_blocks(np.arange(16) + 40_000, 16)
    assert store.host.pages.free_pages == 0 and store.reserve(NS.id, [(other[0], None)], owner="w") == [None]
    held_scan.set()
    store.wait_recovered()
    assert store.lookup(NS.id, hashes).hits == 3 and store.host.failed_checks() == []
    assert store.check() == []  # the dropped blocks' pages are free
    store.close()
    store = reopen(store_factory, path)
    assert store.lookup(NS.id, hashes).hits == 3 and store.check() == []


def test_an_arena_that_starts_over_forgets_what_was_adopted_before_its_records_were_read(monkeypatch,
                                                                                       store_factory):
    """Blocks adopted from records read one by one, then the scan of the records fails (a corrupt page of
    the index): the arena starts empty, and the blocks adopted from it leave the store (their pages are
    the empty arena's), none served after."""
    path, hashes = kept_chain(store_factory)
    gate = hold_scans(monkeypatch, host_scan.HostScan)

    def corrupt(self):
        raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED")

    monkeypatch.setattr(host_scan.HostScan, "_scan", lambda self: gate.wait(30) and corrupt(self))
    store = reopen(store_factory, path, recover_in_background=True)
    assert store.lookup(NS.id, hashes).hits == 6
    gate.set()
    store.wait_recovered()
    assert store.lookup(NS.id, hashes).hits == 0 and store.host.pages.free_pages == 16
    assert store.stats()["counters"]["host_early_blocks_forgotten"] >= 1
    assert store.check() == []
