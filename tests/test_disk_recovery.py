"""Serve first: the disk tier's records are read in the background and adopted while the store serves.

In process, real files, O_DIRECT and LMDB (kvstore/recovery.py, tiers/disk_scan.py). The scan of the
disk's index is held at a gate where a test needs the store to serve before it ends; the recovery's
steps are driven by hand. Every scenario ends with `store.check() == []`, and a restart of what the
recovery left recovers every block again.
"""

from __future__ import annotations

import threading
import time

import pytest

import kvstore.tiers.disk_scan as disk_scan
import kvstore.tiers.record_scan as record_scan
from kvstore.keys import ROOT_HASH, block_key, key_hash
from kvstore.store import TieredStore
from kvstore.tiers.disk_slot import extents_of
from tests.helpers import chain_hashes, hold_scans, namespace, payload_bytes, poll, put_one_by_one

BLOCK = PAGE = 64 * 1024
NS = namespace("bg", BLOCK, dtype="bf16")


@pytest.fixture
def open_store(store_factory):
    """`open_store(background=False)`: a store over a fresh (not kept) host arena of 8 blocks and the
    test's disk tier of 64 (the same folder each time)."""

    def open_(background: bool = False) -> TieredStore:
        store = store_factory(8 * BLOCK, PAGE, disk_bytes=64 * BLOCK, staging_bytes=16 * BLOCK, policy="lru",
                              recover_in_background=background)
        store.register_namespace(NS)
        return store

    return open_


def put(store: TieredStore, hashes: list[bytes], parent: bytes | None = None) -> int:
    return put_one_by_one(store, NS.id, hashes, BLOCK, parent)


def read(store: TieredStore, hashes: list[bytes]) -> list[bytes | None]:
    import asyncio

    entries, _ = asyncio.run(store.acquire(NS.id, hashes, "r"))
    out = [None if e is None else store.host.read(e.location) for e in entries]
    store.release(NS.id, [h for h, e in zip(hashes, entries) if e is not None], "r")
    return out


def on_disk(open_store, chains: list[list[bytes]]) -> None:
    """A stopped store whose disk tier holds `chains` (the host tier, not kept, holds the last few)."""
    store = open_store()
    for c in chains:
        put(store, c)
    for salt in range(500, 600):  # fillers until every block of `chains` is on disk
        if all(store.lookup(NS.id, c).tiers == ("disk",) * len(c) for c in chains):
            break
        put(store, chain_hashes(salt, 2))
    assert all(store.lookup(NS.id, c).tiers == ("disk",) * len(c) for c in chains)
    store.flush()
    store.close()


@pytest.fixture
def no_peek(monkeypatch):
    """The disk tier reads no record on its own while it scans (as one whose cap was lowered): a request's
    block is not adopted before the scan has read it."""
    from kvstore.tiers.disk import DiskTier

    monkeypatch.setattr(DiskTier, "peekable", property(lambda self: False))


@pytest.fixture
def gate(monkeypatch):
    """The disk tier's scan waits until the returned event is set."""
    event = hold_scans(monkeypatch, disk_scan.DiskScan)
    yield event
    event.set()


@pytest.mark.parametrize("peek", [True, False], ids=["records-read-one-by-one", "without-them"])
def test_the_store_serves_while_the_disk_is_read_and_adopts_what_a_request_names(open_store, gate, peek,
                                                                                  request):
    """While the disk's scan has not read its records, a request's blocks are hits all the same: their
    records (and their ancestors') are read one by one from the index and adopted (`peek`); without that,
    a miss until the scan is done."""
    chains = [chain_hashes(s, 6) for s in range(6)]
    gate.set()
    on_disk(open_store, chains)
    gate.clear()
    if not peek:
        request.getfixturevalue("no_peek")
    store = open_store(background=True)
    assert store.recovery.active and store.recovery.scanning
    assert store.lookup(NS.id, chains[0]).hits == (6 if peek else 0)  # served at once
    assert store.lookup(NS.id, chains[1][:4]).hits == (4 if peek else 0)  # (a prefix: its tail waits)
    assert store.lookup(NS.id, chain_hashes(77, 6)).hits == 0  # never written
    assert store.recovery.stats()["disk"]["adopted_early_blocks"] == (10 if peek else 0)
    if peek:
        assert store.lookup(NS.id, chains[0]).tiers == ("disk",) * 6
        assert read(store, chains[0]) == [payload_bytes(h, BLOCK) for h in chains[0]]  # promoted, copies kept
    put(store, chain_hashes(900, 6))
    put(store, chain_hashes(901, 6))  # the host tier evicts: the disk takes nothing yet
    assert store.stats()["counters"]["demotions_dropped_disk_scanning"] >= 1
    gate.set()
    while store.recovery.scanning:
        store.recovery.step(2)
    while store.recovery.active and store.recovery.stats()["disk"]["stage"] == "index":
        store.recovery.step(2)
    assert store.recovery.stats()["disk"]["adopted_blocks"] == (10 if peek else 0)
    assert store.lookup(NS.id, chains[5]).tiers == ("disk",) * 6  # adopted on demand, ancestors first
    assert read(store, chains[5]) == [payload_bytes(h, BLOCK) for h in chains[5]]
    while store.recovery.step(3):
        pass
    assert all(store.lookup(NS.id, c).hits == 6 for c in chains)
    counters = store.stats()["counters"]
    recovered = counters["disk_blocks_recovered"]
    assert recovered == store.disk.counters.recovered_records >= 36  # every record (fillers too) adopted
    assert counters.get("disk_blocks_recovered_early", 0) == (10 if peek else 0)
    assert store.check() == []
    store.close()
    store = open_store()  # and all of it is there again
    assert all(store.lookup(NS.id, c).hits == 6 for c in chains)
    assert store.check() == []


class _CountedBegins:
    """A scan's LMDB environment, counting the transactions the event loop's thread begins in it."""

    def __init__(self, env) -> None:
        self.env, self.begins = env, 0

    def begin(self, **kw):
        self.begins += threading.current_thread() is threading.main_thread()
        return self.env.begin(**kw)


def test_a_request_reads_its_records_in_one_transaction_while_the_scan_waits(open_store, gate, monkeypatch):
    """While the disk scans, the records a request reads on its own share one LMDB transaction, and the
    scan waits at its next pause until the request is done with them: each LMDB call lets the GIL go,
    and with the scan's thread running the loop waited to have it back at every one."""
    chains = [chain_hashes(s, 6) for s in range(4)]
    gate.set()
    on_disk(open_store, chains)
    gate.clear()
    monkeypatch.setattr(record_scan, "YIELD_EVERY", 1)  # (a pause at every record)
    store = open_store(background=True)
    scan = store.disk._scan
    scan._env = counted = _CountedBegins(scan._env)
    assert store.lookup(NS.id, chains[0]).hits == 6 and counted.begins == 1  # six records, one transaction
    with store.disk.peeks():
        gate.set()  # the scan starts, and waits at its first record
        assert store.lookup(NS.id, chains[1]).hits == 6 and counted.begins == 2
        time.sleep(0.3)
        assert not scan._done.is_set()  # (~40 records: done in milliseconds otherwise)
    poll(lambda: scan._done.is_set(), 10, "the scan")
    while store.recovery.step(4):
        pass
    assert all(store.lookup(NS.id, c).hits == 6 for c in chains)
    assert store.stats()["counters"]["disk_blocks_recovered_early"] == 12
    assert store.check() == []


def test_a_request_is_served_while_the_disk_still_sorts_its_records(open_store, gate):
    """Once the disk's records are read, a request's blocks (and their ancestors) are sorted and adopted
    first, before the tier has sorted the rest: a hit two steps after the scan, not after every record."""
    chains = [chain_hashes(s, 6) for s in range(6)]
    gate.set()
    on_disk(open_store, chains)
    store = open_store(background=True)
    while store.recovery.scanning:
        store.recovery.step(2)
    store.recovery.step(2)
    assert store.recovery.stats()["disk"]["stage"] == "index"  # (36 records and more: 2 sorted)
    assert store.lookup(NS.id, chains[3]).tiers == ("disk",) * 6
    assert store.lookup(NS.id, chain_hashes(77, 6)).hits == 0  # (never written: nothing to adopt)
    assert store.recovery.stats()["disk"]["adopted_blocks"] == 6
    assert read(store, chains[3]) == [payload_bytes(h, BLOCK) for h in chains[3]]
    while store.recovery.step(3):
        pass
    assert all(store.lookup(NS.id, c).hits == 6 for c in chains)
    assert store.stats()["counters"]["disk_blocks_recovered"] == store.disk.counters.recovered_records
    assert store.check() == []


def test_a_root_s_many_children_read_before_it_are_all_adopted(open_store, gate):
    """Twelve blocks under one root, on disk: the records are read in key order, so children come before
    their parent and wait for it (a list of them, where one child waits as its key alone); once the root
    is adopted every child is, in the background and on demand alike."""
    root = chain_hashes(5, 1)
    kids = [chain_hashes(100 + i, 1) for i in range(12)]
    gate.set()
    store = open_store()
    put(store, root)
    for k in kids:
        put(store, k, parent=root[0])
    for salt in range(500, 600):  # fillers until every block is on disk
        if all(store.lookup(NS.id, root + k).tiers == ("disk", "disk") for k in kids):
            break
        put(store, chain_hashes(salt, 2))
    store.flush()
    store.close()
    for on_demand in (True, False):
        store = open_store(background=True)
        while store.recovery.scanning or store.recovery.stats()["disk"]["stage"] == "index":
            store.recovery.step(100)
        if on_demand:  # a request names a child: its root is adopted first, then it
            assert store.lookup(NS.id, root + kids[7]).hits == 2
        store.wait_recovered()
        assert all(store.lookup(NS.id, root + k).hits == 2 for k in kids)
        assert read(store, root + kids[3]) == [payload_bytes(h, BLOCK) for h in root + kids[3]]
        assert store.check() == []
        store.close()


def test_a_put_of_a_block_whose_record_waits_is_not_stored_twice(open_store, gate):
    chain = chain_hashes(1, 6)
    gate.set()
    on_disk(open_store, [chain])
    store = open_store(background=True)
    while store.recovery.scanning or store.recovery.stats()["disk"]["stage"] == "index":
        store.recovery.step(100)
    assert put(store, chain) == 0  # every block is there (adopted on demand), none written again
    assert store.stats()["counters"]["put_dedup_blocks"] == 6
    store.wait_recovered()
    assert store.check() == []


def test_a_record_written_again_meanwhile_gives_back_only_its_pages(open_store, gate, no_peek):
    """A block promoted before the restart keeps its record on disk as a copy; before that record is read
    (by a disk that reads none on its own while it scans: `no_peek`), the block is demoted again and
    written anew: the old record's pages are freed (once the new
    record is durable), the new record is kept, and a later restart finds the block on disk."""
    chain = chain_hashes(2, 2)
    gate.set()
    on_disk(open_store, [chain])
    store = open_store()
    assert read(store, chain) == [payload_bytes(h, BLOCK) for h in chain]  # promoted: copies stay on disk
    assert all(t == "host" for t in store.lookup(NS.id, chain).tiers)
    store.close()  # (a host tier that is not kept: the blocks live on in their disk copies only)
    store = open_store(background=True)
    assert put(store, chain) == 2  # into the host tier again, before the records are read
    while store.recovery.scanning or store.recovery.stats()["disk"]["stage"] == "index":  # read and sorted
        store.recovery.step(100)
    store.recovery.finish()
    assert store.stats()["tiers"]["disk"]["copies"] == 2
    for salt in range(700, 720):  # demoted: back to their copies, no write
        put(store, chain_hashes(salt, 2))
    assert all(t == "disk" for t in store.lookup(NS.id, chain).tiers)
    assert store.check() == []
    store.close()
    store = open_store()
    assert store.lookup(NS.id, chain).tiers == ("disk", "disk")
    assert read(store, chain) == [payload_bytes(h, BLOCK) for h in chain]
    assert store.check() == []


def test_a_record_replaced_before_its_adoption_gives_back_only_its_pages(open_store, gate, no_peek):
    """The disk copy of a host block waits to be attached while the block is demoted and written anew (a
    disk that reads no record on its own while it scans: `no_peek`):
    the old record (replaced in the disk's index by the new one) gives back its pages, once the new
    record is durable, and no record; a restart finds the block on disk, intact."""
    chain = chain_hashes(3, 2)
    gate.set()
    on_disk(open_store, [chain])
    store = open_store()
    read(store, chain)  # promoted to host, records kept on disk as copies
    store.close()
    gate.clear()
    store = open_store(background=True)
    put(store, chain)  # in the host tier again; their disk records are not read yet
    gate.set()
    while store.recovery.scanning or store.recovery.stats()["disk"]["stage"] == "index":
        store.recovery.step(100)
    for salt in range(800, 820):  # demoted: written anew (their old records are not attached yet)
        put(store, chain_hashes(salt, 2))
    assert all(t == "disk" for t in store.lookup(NS.id, chain).tiers)
    assert store.stats()["counters"].get("disk_writes_saved", 0) == 0
    store.recovery.finish()
    assert store.stats()["tiers"]["disk"]["copies"] == 0
    assert store.check() == []  # no page held by the old records, every record is a block's
    store.close()
    store = open_store()
    assert read(store, chain) == [payload_bytes(h, BLOCK) for h in chain]
    assert store.check() == []


def test_a_stop_during_the_recovery_loses_nothing(open_store, gate):
    chains = [chain_hashes(s, 6) for s in range(20, 26)]
    gate.set()
    on_disk(open_store, chains)
    store = open_store(background=True)
    while store.recovery.scanning or store.recovery.stats()["disk"]["stage"] == "index":
        store.recovery.step(10)
    store.recovery.step(5)  # a few adopted, the rest not
    assert 0 < store.recovery.stats()["disk"]["adopted_blocks"] < 36
    store.close()
    store = open_store()
    assert all(store.lookup(NS.id, c).hits == 6 for c in chains)
    assert store.check() == []


@pytest.mark.parametrize("scans_held", [False, True], ids=["scans-free", "requests-while-both-scan"])
def test_host_and_disk_recovered_together_hold_what_one_after_the_other_holds(store_factory, gate, scans_held,
                                                                             monkeypatch):
    """A kept host arena over a disk: chains split between them (a host block's children on disk), disk
    copies of host blocks. Adopted in small interleaved steps, with requests adopting on demand, the
    store ends with the same blocks in the same tiers, and the same copies, as a recovery done at once.
    With requests while both tiers still read their records, every chain is a hit at once, each block
    from the tier that held it (the arena's, verified before it is read; not their disk copies)."""
    from kvstore.tiers.host_scan import HostScan

    host_gate = hold_scans(monkeypatch, HostScan)
    host_gate.set()
    gate.set()

    def open_kept(background: bool, arena: str | None = None) -> TieredStore:
        store = store_factory(40 * BLOCK, PAGE, arena=arena, prefault=False, persistent=True, disk_bytes=64 * BLOCK,
                              staging_bytes=16 * BLOCK, policy="lru", recover_in_background=background)
        store.register_namespace(NS)
        return store

    def held(store: TieredStore) -> dict:
        return {k: (e.tier, sorted(e.copies or ())) for k, e in store.index.entries.items()}

    chains = [chain_hashes(s, 6) for s in range(40, 48)]
    store = open_kept(False)
    arena = store.host.path
    # many host records, few disk ones: the disk is sorted and adopting long before the host is done
    for c in chains:
        put(store, c)
    read(store, chains[0])  # promoted: their records stay on disk as copies
    assert store.stats()["tiers"]["disk"]["copies"] > 0
    split = [c for c in chains if {store.index.entries[block_key(NS.id, h)].tier for h in c} == {"host", "disk"}]
    assert split, "no chain spans both tiers: the test proves less than it says"
    store.flush()
    store.close()
    store = open_kept(False, arena)
    expected = held(store)
    store.close()
    if scans_held:
        gate.clear()
        host_gate.clear()
    store = open_kept(True, arena)
    assert len(store.index.entries) == 0
    if scans_held:
        on_disk_only = [c for c in chains if all(expected[block_key(NS.id, h)][0] == "disk" for h in c)]
        assert on_disk_only and chains[0] not in on_disk_only
        for c in chains:  # each block from the tier that held it: the arena's, not their disk copies
            assert store.lookup(NS.id, c).tiers == tuple(expected[block_key(NS.id, h)][0] for h in c)
        assert read(store, chains[0]) == [payload_bytes(h, BLOCK) for h in chains[0]]  # (verified first)
        assert store.stats()["tiers"]["host"]["verified_blocks"] >= 6
        assert store.recovery.scanning and store.host.scanning  # (both still read their records)
        assert all(held(store)[k][0] == expected[k][0] for k in held(store))  # (copies: once the disk is read)
        gate.set()
        host_gate.set()
    n = 0
    while store.recovery.step(1):
        n += 1
        if n % 7 == 0:  # a request in between names a chain
            store.lookup(NS.id, chains[n // 7 % len(chains)])
    assert held(store) == expected
    assert store.check() == []


def test_a_daemon_serves_before_its_disk_is_adopted_and_keeps_every_block(tmp_path):
    """More records than a daemon recovers before it serves: it prints its ready line, adopts in the
    background (stats' "recovery" until done), answers every request meanwhile, and then holds every
    block it held before the stop, byte-identical."""
    from kvstore.client import KVClient
    from kvstore.keys import Namespace
    from kvstore.store import RECOVER_BEFORE_SERVING_BLOCKS
    from kvstore.tools.harness.daemon_proc import start_daemon
    from tests.helpers import poll

    ns_small = Namespace("bg-daemon", "bf16", 1, 1, 8, 16, 4096)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\ncapacity = {8192 * 4096}\npage_size = 4096\n')
    flags = dict(host_bytes=str(1024 * 4096), page_bytes="4096", disk=True)
    chains = [chain_hashes(s, 512) for s in range(12)]
    assert sum(map(len, chains)) > RECOVER_BEFORE_SERVING_BLOCKS
    d = start_daemon(tmp_path, "--config", str(config), **flags)
    try:
        with KVClient(d.socket_path) as c:
            ns = c.register(ns_small)
            for hs in chains:
                assert c.put(ns, [(h, p, payload_bytes(h, 4096)) for h, p in zip(hs, [None] + hs[:-1])], chunk=512) == 512
        d.stop(keep_arena=True)
        d = start_daemon(tmp_path, "--config", str(config), name=d.name, **flags)
        with KVClient(d.socket_path) as c:
            ns = c.register(ns_small)
            first = c.stats()
            assert "recovery" in first, "the daemon recovered everything before it served"
            assert c.lookup(ns, chains[3]).hits == 512  # a hit while it recovers, whether it has read the records
            poll(lambda: "recovery" not in c.stats(), 60, "the background recovery")
            for hs in chains:
                assert c.lookup(ns, hs).hits == 512
            got = c.get(ns, chains[7])
            assert all(g is not None and g.tobytes() == payload_bytes(h, 4096) for g, h in zip(got, chains[7]))
        assert d.check() == []
    finally:
        d.stop()


def test_the_scan_keeps_the_well_formed_records_and_deletes_the_others(tmp_path):
    """A disk record is kept only if its key and fields are well formed, it has a checksum, its extents lie
    inside the data file on page boundaries, its length matches and no earlier record (in key order) claims
    its pages; every other record is deleted, and its pages are free. (The host arena's: test_host_restart.)"""
    import lmdb
    import msgpack

    from kvstore.tiers.disk import INDEX_DIR, DiskTier

    pages, path = 16, str(tmp_path / "disk")
    DiskTier(path, pages * PAGE, PAGE).close()  # its meta and data file
    good = {"e": [[0, PAGE], [2 * PAGE, PAGE]], "n": 2 * PAGE, "x": 7, "p": None, "a": None, "t": 0.0}
    second = {**good, "e": [[4 * PAGE, PAGE]], "n": PAGE}
    bad = [
        {**good, "e": [[pages * PAGE, PAGE]], "n": PAGE},  # outside the data file
        {**good, "e": [[5 * PAGE + 100, PAGE]], "n": PAGE},  # off a page boundary
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE // 2},  # length not the extents'
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE, "x": None},  # no checksum
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE, "c": "no-such-codec", "z": PAGE},  # encoded, no decoder
        {"n": PAGE, "x": 1},  # no extents
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE, "a": "high"},  # an estimate that is no number
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE, "t": [1]},  # a time that is no number
        {**good, "e": [[5 * PAGE, PAGE]], "n": PAGE, "p": 3},  # a parent that is no hash
    ]
    env = lmdb.open(str(tmp_path / "disk" / INDEX_DIR), subdir=True, max_dbs=4, lock=True, map_size=1 << 34)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        txn.put(msgpack.packb([NS.id, b"\x00" * 16]), msgpack.packb(good))
        txn.put(msgpack.packb([NS.id, b"\x01" * 16]), msgpack.packb(second))
        for i, rec in enumerate(bad):
            txn.put(msgpack.packb([NS.id, bytes([0xF0 + i]) * 16]), msgpack.packb(rec))
        txn.put(msgpack.packb([7, b"\xfd" * 16]), msgpack.packb(second))  # a namespace id that is no string
        txn.put(msgpack.packb([NS.id, b"\xfe" * 16]), b"\xc1")  # not msgpack
        txn.put(msgpack.packb([NS.id, b"\xff" * 16]), msgpack.packb({**second, "e": [[2 * PAGE, PAGE]]}))  # taken
    env.close()
    disk = DiskTier(path, pages * PAGE, PAGE)
    try:
        # read on their own while the tier scans (`peek`), the records are judged as the scan judges them
        # (but for pages another record claims: the scan's to find)
        peeked = {h: disk.peek(block_key(NS.id, h)) for h in [b"\x00" * 16, b"\x01" * 16, b"\x02" * 16]
                  + [bytes([0xF0 + i]) * 16 for i in range(len(bad))] + [b"\xfe" * 16, b"\xff" * 16]}
        assert {h for h, rec in peeked.items() if rec is not None} == {b"\x00" * 16, b"\x01" * 16, b"\xff" * 16}
        assert peeked[b"\x00" * 16][1:3] == (ROOT_HASH, 2 * PAGE) and extents_of(peeked[b"\x00" * 16][3]) == good["e"]
        kept = {key_hash(b.key): extents_of(b.location) for b in disk.scanned(wait=True)}
        assert disk.peek(block_key(NS.id, b"\x00" * 16)) is None  # (the scan is over: the store has its rows)
        assert kept == {b"\x00" * 16: good["e"], b"\x01" * 16: second["e"]}
        disk.flush()
        assert len(disk.index_records()) == 2  # the others were deleted
        assert disk.alloc.free_pages == pages - 3  # their pages are free
    finally:
        disk.close()


def test_records_that_name_each_other_or_themselves_as_parent_are_orphans(store_factory, gate):
    """Well-formed records whose parents form a cycle (two naming each other, one naming itself) reach no
    root: the recovery frees them, in the background, on demand and read one by one while the scan runs
    alike, and serves none of them."""
    import lmdb
    import msgpack

    from kvstore.tiers.disk import INDEX_DIR

    a, b, c, root = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    for on_demand in (False, True, "scanning"):
        gate.set()
        store = store_factory(8 * BLOCK, PAGE, disk_bytes=16 * BLOCK, recover_in_background=True)
        store.register_namespace(NS)
        store.close()
        env = lmdb.open(f"{store.disk.path}/{INDEX_DIR}", subdir=True, max_dbs=4, lock=True, map_size=1 << 34)
        with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
            for i, (h, parent) in enumerate(((a, b), (b, a), (c, c), (root, None))):
                rec = {"e": [[i * PAGE, PAGE]], "n": PAGE, "x": 7, "p": parent, "a": None, "t": float(i)}
                txn.put(msgpack.packb([NS.id, h]), msgpack.packb(rec))
        env.close()
        if on_demand == "scanning":
            gate.clear()
        store = store_factory(8 * BLOCK, PAGE, disk_bytes=16 * BLOCK, recover_in_background=True)
        if on_demand:
            while store.recovery.scanning and on_demand != "scanning":
                store.recovery.step(1)
            for h in (a, b, c, root):
                assert store.lookup(NS.id, [h]).hits == (h == root)
            assert store.recovery.scanning == (on_demand == "scanning")
            gate.set()
        store.wait_recovered()
        assert store.stats()["counters"]["disk_orphans_dropped"] == 3
        assert [store.lookup(NS.id, [h]).hits for h in (a, b, c, root)] == [0, 0, 0, 1]
        assert store.check() == []
        store.disk.flush()
        assert len(store.disk.index_records()) == 1  # the orphans' records deleted
        store.close()


def test_blocks_given_back_while_the_disk_scans_free_their_pages_once_it_ends(open_store, gate):
    """Blocks adopted from records read one by one, then cleared before the scan ends: the tier frees no
    page while it scans (the scan counts them its records'), so they are freed once the scan's rows come;
    the cleared blocks are not adopted again, now or at the next start, and every other block is."""
    chains = [chain_hashes(s, 6) for s in range(30, 36)]
    gate.set()
    on_disk(open_store, chains)
    gate.clear()
    store = open_store(background=True)
    assert store.lookup(NS.id, chains[0]).hits == store.lookup(NS.id, chains[1]).hits == 6
    free_before = store.disk.alloc.free_pages
    assert store.clear() >= 12
    assert store.disk.alloc.free_pages == free_before  # (while it scans, no page is free)
    assert store.lookup(NS.id, chains[0]).hits == 0  # given back: not read again before the scan ends
    gate.set()
    store.wait_recovered()
    assert [store.lookup(NS.id, c).hits for c in chains] == [0, 0, 6, 6, 6, 6]
    assert store.check() == []  # the cleared blocks' pages are free, every other page a block's
    put(store, chain_hashes(950, 6))  # (new blocks land on free pages only)
    assert store.check() == []
    store.close()
    store = open_store()
    assert [store.lookup(NS.id, c).hits for c in chains] == [0, 0, 6, 6, 6, 6]
    assert read(store, chains[4]) == [payload_bytes(h, BLOCK) for h in chains[4]]
    assert store.check() == []


def test_a_block_read_early_whose_record_the_scan_does_not_keep_leaves_the_index(open_store, gate, tmp_path):
    """A record read one by one while the scan runs can still be one the scan refuses: here a second
    record, earlier in key order, claims its pages (never written so). The block adopted from it leaves the
    index when the scan's rows come, its pages left to the record that keeps them, and nothing is torn."""
    import lmdb

    from kvstore.tiers.disk import INDEX_DIR
    from kvstore.tiers.record_scan import record_key

    chain = chain_hashes(40, 2)
    assert chain[1] > bytes(16)
    gate.set()
    on_disk(open_store, [chain])
    env = lmdb.open(str(tmp_path / "disk" / INDEX_DIR), subdir=True, max_dbs=4, lock=True, map_size=1 << 34)
    twin = bytes(16)  # a record of another block on the tail's pages, before it in key order
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        txn.put(record_key(block_key(NS.id, twin)), txn.get(record_key(block_key(NS.id, chain[1]))))
    env.close()
    gate.clear()
    store = open_store(background=True)
    assert store.lookup(NS.id, chain).tiers == ("disk", "disk")  # read one by one: the scan waits
    gate.set()
    store.wait_recovered()
    assert store.stats()["counters"]["disk_early_blocks_forgotten"] == 1
    assert store.lookup(NS.id, chain).hits == 1  # the tail's record went (the scan deleted it)
    assert store.lookup(NS.id, [chain[0], twin]).hits == 2  # (the twin's record holds the pages, bytes intact)
    assert read(store, [chain[0], twin]) == [payload_bytes(chain[0], BLOCK), payload_bytes(chain[1], BLOCK)]
    assert store.check() == []
    store.close()
    store = open_store()
    assert store.lookup(NS.id, chain).hits == 1
    assert store.check() == []
