"""A restart keeps the host tier: the arena and its placement index outlive the daemon (tiers/host_index.py).

Against a real daemon process, restarted under the same name (so at the same
arena path), with the harness leaving the arena in place (`keep_arena`):

- kill -9 and SIGTERM, with and without a disk tier: every committed block the
  daemon held comes back byte-identical, from the re-adopted arena or the
  disk, including blocks that only the host tier held; check() clean. (In
  process: records whose checksum was not taken yet at the kill are adopted,
  then checked in the background.)
- kill -9 during a write storm (puts and reads), several rounds: every block
  whose record (host or disk index, read after the kill) is reachable from a
  root is held after the restart, and nothing is ever served wrong.
- a reserved, never committed block, and a committed block whose bytes were
  altered after its record was written, are never served after adoption (nor
  their descendants); the rest of the chain is. The altered block is adopted
  (a restart reads no byte) and dropped when it is first read
  (tests/test_verify_kept.py: before any read, in the background, before a
  demotion).
- a changed host capacity or page size, or a corrupt index, starts empty with
  a log line saying why; the daemon serves either way.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from kvstore.client import KVClient
from tests.helpers import chain_hashes, payload_for, poll
from tests.test_disk_crash import NS, Storm, acknowledged
from kvstore.keys import block_key, key_hash
from kvstore.tiers.host import copy_in
from kvstore.tiers.host_folder import index_path
from kvstore.tools.harness.daemon_proc import DaemonProc, start_daemon

BLOCK = NS.block_bytes  # 64 KiB


def arena_of(d: DaemonProc) -> str:
    return f"/dev/shm/kvstore-{os.getuid()}-{d.name}"


def put_chains(d: DaemonProc, chains: list[list[bytes]]) -> None:
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        for hashes in chains:
            assert c.put(ns, [(h, p, payload_for(h, BLOCK)) for h, p in zip(hashes, [None] + hashes[:-1])]) == len(hashes)


def held(d: DaemonProc, chains: list[list[bytes]]) -> dict[bytes, str]:
    """hash -> tier of every block the daemon holds now."""
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        return {h: t for hashes in chains for h, t in zip(hashes, c.lookup(ns, hashes).tiers)}


def settled(d: DaemonProc, checked: bool = True) -> bool:
    """Every host record (with its checksum, if `checked`) and disk write the daemon took is written."""
    host, disk = d.stats()["tiers"]["host"], d.stats()["tiers"]["disk"]
    return (host.get("pending_records", 0) == 0 and disk.get("pending_writes", 0) == 0
            and (not checked or host.get("unchecked_records", 0) == 0))


def served(d: DaemonProc, chains: list[list[bytes]]) -> dict[bytes, bool]:
    """hash -> whether it is served with its own bytes (a wrong byte fails the test)."""
    out = {}
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        for hashes in chains:
            for h, data in zip(hashes, c.get(ns, hashes)):
                assert data is None or np.array_equal(data, payload_for(h, BLOCK)), f"{h.hex()[:16]} served wrong"
                out[h] = data is not None
    return out


def verify_kept(d: DaemonProc, must: list[bytes], chains: list[list[bytes]]) -> None:
    """Every block of `must` is held right after the restart, and nothing is served wrong. (Reading
    them all would not prove more: promotions into a full host tier demote into a full disk, which
    drops blocks not read yet; tests/test_disk_crash.py can read them all, its host tier starts empty.)"""
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        present = {h for hashes in chains for h, _ in zip(hashes, c.lookup(ns, hashes).tiers)}
    missing = set(must) - present
    assert not missing, f"{len(missing)} blocks with records are not held after the restart: " + ", ".join(
        f"{h.hex()[:12]}" for h in sorted(missing)[:5])
    served(d, chains)


def gated(client: KVClient) -> threading.Event:
    """Make the client's puts and gets wait while the returned event is clear (a paused storm)."""
    gate = threading.Event()
    gate.set()
    for name in ("put", "get"):
        call = getattr(client, name)
        setattr(client, name, lambda *a, _call=call, **kw: gate.wait() and _call(*a, **kw))
    return gate


def host_records(arena: str) -> dict[bytes, bytes | None]:
    """The host placement index, opened read-only after a kill: {hash: parent}."""
    if not os.path.isdir(index_path(arena)):
        return {}
    env = lmdb.open(index_path(arena), subdir=True, readonly=True, max_dbs=4, lock=True)
    try:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            return {msgpack.unpackb(k)[1]: msgpack.unpackb(v)["p"] for k, v in txn.cursor()}
    finally:
        env.close()


def reachable(parents: dict[bytes, bytes | None]) -> set[bytes]:
    """The records whose every ancestor has a record too."""
    ok: dict[bytes, bool] = {}

    def walk(h: bytes) -> bool:
        path = []
        while h not in ok:
            path.append(h)
            if h not in parents:
                ok[h] = False
                break
            if parents[h] is None:
                ok[h] = True
                break
            h = parents[h]
        for x in path:
            ok[x] = ok[h]
        return ok[path[0]] if path else ok[h]

    return {h for h in parents if walk(h)}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
@pytest.mark.parametrize("disk", [False, True], ids=["host-only", "host+disk"])
def test_restart_keeps_every_committed_block(tmp_path, sig, disk):
    """40 blocks of 64 KiB; with a disk tier the 1 MiB host tier holds 16 and reads promote some back
    (their disk records stay as copies). Before today's change a restart kept none of the host's."""
    args = ("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "32MiB") if disk else ()
    host = "1MiB" if disk else "4MiB"
    chains = [chain_hashes(s, 4) for s in range(1, 11)]
    d = start_daemon(tmp_path, *args, host_bytes=host, page_bytes="64KiB", disk=disk)
    try:
        put_chains(d, chains)
        if disk:
            assert all(served(d, chains[:3]).values())  # promotions: host blocks with disk copies
        before = held(d, chains)
        assert len(before) == 40 and ("disk" in before.values()) == disk
        poll(lambda: settled(d, checked=sig == signal.SIGTERM), 30, "host records and disk writes")
        assert d.check() == []
        assert d.stop(sig, keep_arena=True) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        d = start_daemon(tmp_path, *args, host_bytes=host, page_bytes="64KiB", disk=disk, name=d.name)
        assert held(d, chains) == before, "a block changed tier or was lost across the restart"
        assert os.path.exists(arena_of(d)) and os.path.isdir(index_path(arena_of(d)))
        assert d.check() == []
        stats = d.stats()
        in_host = sum(t == "host" for t in before.values())
        assert stats["tiers"]["host"]["adopted_blocks"] == in_host == stats["counters"]["host_blocks_recovered"]
        assert stats["counters"].get("host_orphans_dropped", 0) == 0
        if disk:  # the promoted blocks' disk records are their copies again
            assert stats["tiers"]["disk"]["copies"] == stats["counters"]["disk_copies_recovered"] == 12
        assert all(served(d, chains).values())
        assert d.check() == []
        metrics = d.http("/metrics")[1].decode()
        assert f"kvstore_host_adopted_blocks {float(in_host)}" in metrics and "kvstore_host_pending_records" in metrics
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.parametrize("disk", [False, True], ids=["host-only", "host+small-disk"])
def test_kill_9_during_a_storm_then_restart_keeps_the_arena(tmp_path, disk):
    """Like tests/test_disk_crash.py, but the arena is re-adopted: after each kill every block whose
    record (host or disk) is reachable from a root is held, none served wrong; reads promote and a
    small host tier evicts, so host records are deleted and pages reused under the kills. Every
    other round pauses the storm and lets the index catch up before the kill (a 32-block host tier
    under a storm churns faster than records may be written on a loaded machine)."""
    args = ("--disk-path", str(tmp_path / "disk"), "--disk-bytes", str(96 * BLOCK)) if disk else ()
    host = "2MiB"  # 32 blocks
    rng = random.Random(77 + disk)
    must: list[bytes] = []
    chains: list[list[bytes]] = []
    name = None
    total_from_host = 0
    for round_no in range(4):
        d = start_daemon(tmp_path, *args, host_bytes=host, page_bytes="64KiB", disk=disk, name=name)
        name = d.name
        try:
            verify_kept(d, must, chains)
            assert d.check() == []
            total_from_host += d.stats()["tiers"]["host"].get("adopted_blocks", 0)
            storm = Storm(d.socket_path, 1000 * (round_no + 1), read_from=list(chains))
            gate = gated(storm.client)
            target = rng.randint(20, 80)
            poll(lambda: storm.acked >= target or storm.error is not None, 120, f"{target} acknowledged puts")
            assert storm.error is None, storm.error
            if round_no % 2:  # the storm paused and every record written: the kill must lose nothing
                gate.clear()
                poll(lambda: settled(d), 60, "host records and disk writes")
            d.proc.send_signal(signal.SIGKILL)
            assert d.proc.wait(timeout=30) == -signal.SIGKILL
            gate.set()
            storm.thread.join(timeout=30)
            storm.client.close()
            assert storm.wrong == [], "wrong bytes served during the storm"
        finally:
            if d.alive():
                d.stop(signal.SIGKILL, keep_arena=True)
            d.cleanup(keep_arena=True)
        chains += storm.chains
        parents = host_records(arena_of(d))
        if disk:
            parents.update(acknowledged(str(tmp_path / "disk"))[0])
        must = sorted(reachable(parents))
        print(f"round {round_no}: {storm.acked} puts, {storm.reads} reads; {len(must)} blocks to serve")
    d = start_daemon(tmp_path, *args, host_bytes=host, page_bytes="64KiB", disk=disk, name=name)
    try:
        verify_kept(d, must, chains)
        assert d.check() == []
        total_from_host += d.stats()["tiers"]["host"].get("adopted_blocks", 0)
    finally:
        d.stop()
    assert total_from_host > 20, f"the arena brought back {total_from_host} blocks in all: the test proves nothing"


def test_torn_or_altered_blocks_are_not_served_after_adoption(tmp_path):
    d = start_daemon(tmp_path, host_bytes="4MiB", page_bytes="64KiB")
    good = chain_hashes(1, 4)
    torn = chain_hashes(2, 2)
    try:
        put_chains(d, [good])
        with KVClient(d.socket_path) as c:  # reserved and written, never committed: a put cut short
            ns = c.register(NS)
            for ext, h in zip(c.reserve(ns, list(zip(torn, [None, torn[0]]))), torn):
                copy_in(c.arena, ext, payload_for(h, BLOCK))
            poll(lambda: settled(d), 30, "host records")
            d.stop(signal.SIGKILL, keep_arena=True)
        with open(arena_of(d), "r+b") as f:  # alter the third block of the chain after its record was written
            f.seek(host_record_extents(arena_of(d))[good[2]][0][0] + 1000)
            f.write(b"\xff\x00\xff")
        d = start_daemon(tmp_path, host_bytes="4MiB", page_bytes="64KiB", name=d.name, log_path=str(tmp_path / "d.log"))
        got = served(d, [good, torn])
        assert [got[h] for h in good] == [True, True, False, False], "an altered block (or its child) was served"
        assert not any(got[h] for h in torn), "a block that was never committed was served"
        assert d.check() == []
        stats = d.stats()
        assert stats["tiers"]["host"]["adopted_blocks"] == 4  # adopted unverified; good[2] failed at its first read
        assert stats["counters"]["host_checksum_failures"] == 1
        assert stats["counters"]["host_blocks_discarded"] == 2  # good[2] and its child good[3]
        assert "checksum mismatch" in Path(tmp_path / "d.log").read_text()
    finally:
        d.stop()


def host_record_extents(arena: str) -> dict[bytes, list]:
    env = lmdb.open(index_path(arena), subdir=True, readonly=True, max_dbs=4, lock=True)
    try:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            return {msgpack.unpackb(k)[1]: msgpack.unpackb(v)["e"] for k, v in txn.cursor()}
    finally:
        env.close()


@pytest.mark.parametrize("change", ["capacity", "page-size", "corrupt-index", "no-index"])
def test_a_mismatched_arena_starts_empty_with_a_log_line(tmp_path, change):
    chain = chain_hashes(3, 4)
    d = start_daemon(tmp_path, host_bytes="4MiB", page_bytes="64KiB")
    try:
        put_chains(d, [chain])
    finally:
        assert d.stop(keep_arena=True) == 0
    host, page = "4MiB", "64KiB"
    if change == "capacity":
        host = "8MiB"
    elif change == "page-size":
        page = "128KiB"
    elif change == "corrupt-index":
        with open(os.path.join(index_path(arena_of(d)), "data.mdb"), "r+b") as f:
            f.write(os.urandom(16384))
    else:
        import shutil

        shutil.rmtree(index_path(arena_of(d)))
    log = tmp_path / "d.log"
    d = start_daemon(tmp_path, host_bytes=host, page_bytes=page, name=d.name, log_path=str(log))
    try:
        assert not any(served(d, [chain]).values())
        assert d.stats()["tiers"]["host"]["adopted_blocks"] == 0
        assert "host tier: starting empty, not re-adopting the arena" in log.read_text(), log.read_text()
        put_chains(d, [chain])  # and it serves
        assert all(served(d, [chain]).values()) and d.check() == []
    finally:
        d.stop()


def test_records_without_a_checksum_are_adopted_then_checked(monkeypatch):
    """A kill before the store was quiet leaves records without checksums: they are adopted (written
    only after commit, deleted before reuse) and checked in the background once the store is quiet."""
    import kvstore.tiers.host_index as host_index
    from kvstore.keys import hash_blocks
    from kvstore.store import TieredStore
    from kvstore.tiers.host import HostArena, remove_stale_arena

    monkeypatch.setattr(host_index, "QUIET_S", 3600.0)  # never quiet: no checksum is taken
    path = f"/dev/shm/kvtest-{os.urandom(8).hex()}"
    ns_small = type(NS)("unchecked", "bf16", 1, 1, 8, 16, 8192)
    try:
        store = TieredStore([HostArena(path, 64 * 8192, 8192, prefault=False, persistent=True)])
        ns = store.register_namespace(ns_small)
        hs = hash_blocks(np.arange(16 * 6), 16)
        for e, h in zip(store.reserve(ns, list(zip(hs, [None] + hs[:-1])), owner=1), hs):
            store.host.write(e.location, np.frombuffer(h * 512, np.uint8))
        store.commit(ns, hs[:5], owner=1)  # the sixth stays reserved: a put cut short
        poll(lambda: store.host.index.num_pending == 0, 30, "records")
        assert store.host.index.num_unchecked == 5
        store.host.abandon()  # killed
        monkeypatch.setattr(host_index, "QUIET_S", 0.0)
        store = TieredStore([HostArena(path, 64 * 8192, 8192, prefault=False, persistent=True)])
        assert store.lookup(ns, hs).hits == 5 and store.host.stats()["adopted_unchecked"] == 5
        for h in hs[:5]:
            assert store.host.read(store.index.entries[block_key(ns, h)].location) == h * 512
        poll(lambda: store.host.index.num_unchecked == 0, 30, "background checksums")
        assert store.check() == []  # every record has its checksum, and the bytes match it
        store.close()
    finally:
        remove_stale_arena(path)


def test_the_index_thread_writes_checksums_a_short_transaction_at_a_time(monkeypatch, store_factory):
    """The hasher hands over thousands of checksums a batch; the index thread writes them COMMIT_RECORDS
    a transaction, each under the lock the loop's own record keeping takes (a batch's transaction, with
    the disk busy, held the loop 406 ms at 10^7 blocks), and every record ends with its checksum. The
    hasher lets the GIL go every few blocks."""
    import kvstore.tiers.host_index as host_index
    from kvstore.keys import hash_blocks

    monkeypatch.setattr(host_index, "QUIET_S", 3600.0)  # no checksum until the records are all written
    monkeypatch.setattr(host_index, "COMMIT_RECORDS", 32)
    store = store_factory(512 * 4096, 4096, prefault=False, persistent=True)
    ns = store.register_namespace(type(NS)("chunked", "bf16", 1, 1, 8, 16, 4096))
    hs = hash_blocks(np.arange(16 * 400), 16)
    assert all(store.reserve(ns, list(zip(hs, [None] + hs[:-1])), owner=1))
    store.commit(ns, hs, owner=1)
    index = store.host.index
    poll(lambda: index.num_pending == 0, 30, "records")
    assert index.num_unchecked == 400
    sizes: list[int] = []
    real = index._commit
    index._commit = lambda new, sums: (sizes.append(len(sums)), real(new, sums))[1]
    yields: list[str] = []  # the threads that let the GIL go on purpose (`time.sleep(0)`)

    class Clock:  # host_index's `time`, its sleeps noted
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(s: float) -> None:
            yields.append(threading.current_thread().name)
            time.sleep(s)

    monkeypatch.setattr(host_index, "time", Clock)
    monkeypatch.setattr(host_index, "QUIET_S", 0.0)
    index._hash_wake.set()
    poll(lambda: index.num_unchecked == 0, 30, "the checksums")
    assert sum(sizes) == 400 and max(sizes) <= 32 and len(sizes) >= 13, sizes
    # the hasher let the GIL go every HASH_YIELD_EVERY blocks: a checksum lets it go and it took it back
    # at once, so the loop waited out the switch interval at each of its own LMDB calls
    assert yields.count("kvstore-host-hash") >= 400 // host_index.HASH_YIELD_EVERY, yields
    assert all(rec["x"] is not None for rec in index.records().values())
    assert store.check() == []


def test_a_reopened_arena_keeps_the_well_formed_records_and_deletes_the_others():
    """At open the placement index keeps a record only if its key and fields are well formed, its extents
    lie inside the arena on page boundaries, its length matches and no earlier record (in key order)
    claims its pages; every other record is deleted, and its pages stay free."""
    from kvstore.keys import hash_blocks
    from kvstore.store import TieredStore
    from kvstore.tiers.host import HostArena, remove_stale_arena

    page, pages = 8192, 64
    path = f"/dev/shm/kvtest-{os.urandom(8).hex()}"
    ns_small = type(NS)("records", "bf16", 1, 1, 8, 16, page)
    try:
        store = TieredStore([HostArena(path, pages * page, page, prefault=False, persistent=True)])
        ns = store.register_namespace(ns_small)
        roots = hash_blocks(np.arange(16 * 3), 16)
        got = store.reserve(ns, [(h, None) for h in roots], owner=1)
        for e, h in zip(got, roots):
            store.host.write(e.location, np.frombuffer(h * (page // 16), np.uint8))
        store.commit(ns, roots, owner=1)
        taken = {store.index.entries[block_key(ns, h)].location[0][0] // page for h in roots}
        store.close()
        free = [p * page for p in range(pages) if p not in taken]
        good = {"e": [[free[0], page], [free[1], page]], "n": 2 * page, "p": None, "d": 0, "a": None, "t": 0.0,
                "x": None}  # two extents: kept
        bad = {
            "outside the arena": {**good, "e": [[pages * page, page]], "n": page},
            "off a page boundary": {**good, "e": [[free[2] + 100, page]], "n": page},
            "length not the extents'": {**good, "e": [[free[2], page]], "n": page // 2},
            "empty extent": {**good, "e": [[free[2], 0]], "n": 0},
            "checksum not an int": {**good, "e": [[free[2], page]], "n": page, "x": "abc"},
            "no extents field": {"n": page, "x": None},
        }
        overlaps = {**good, "e": [[min(taken) * page, page]], "n": page}  # a root's page
        env = lmdb.open(index_path(path), subdir=True, max_dbs=4, lock=True)
        with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
            txn.put(msgpack.packb([ns, b"\x00" * 16]), msgpack.packb(good))
            for i, rec in enumerate(bad.values()):
                txn.put(msgpack.packb([ns, bytes([0xF0 + i]) * 16]), msgpack.packb(rec))
            txn.put(msgpack.packb([7, b"\xfe" * 16]), msgpack.packb(good))  # a namespace id that is no string
            txn.put(msgpack.packb([ns, b"\xfe" * 16]), b"\xc1")  # not msgpack
            txn.put(msgpack.packb([ns, b"\xff" * 16]), msgpack.packb(overlaps))  # last in key order: it goes
        env.close()
        arena = HostArena(path, pages * page, page, prefault=False, persistent=True)
        try:
            assert arena.scanning and arena.recover()[1] == []  # (the blocks come from the scan)
            kept = {key_hash(b.key): b.location for b in arena.scanned(wait=True)}
            assert set(kept) == set(roots) | {b"\x00" * 16}
            assert kept[b"\x00" * 16] == good["e"]
            assert len(arena.index.records()) == len(kept)  # the others were deleted
            assert arena.pages.free_pages == pages - len(taken) - 2  # their pages are free
        finally:
            arena.close(unlink=False)
    finally:
        remove_stale_arena(path)


def test_on_an_event_loop_records_and_deletions_are_written_at_the_end_of_the_turn():
    """The daemon's case: a store used on a running asyncio loop writes the records of the blocks a
    turn committed, and the deletions of the blocks it freed, in one transaction when the turn ends,
    on the loop itself (the index thread is never woken for them: its wake-up is disabled here)."""
    import asyncio

    from kvstore.keys import hash_blocks
    from kvstore.store import TieredStore
    from kvstore.tiers.host import HostArena, remove_stale_arena

    path = f"/dev/shm/kvtest-{os.urandom(8).hex()}"
    ns_small = type(NS)("turns", "bf16", 1, 1, 8, 16, 8192)

    async def main() -> None:
        store = TieredStore([HostArena(path, 64 * 8192, 8192, prefault=False, persistent=True)])
        index = store.host.index
        index._wake_index = lambda: None
        ns = store.register_namespace(ns_small)
        written = lambda: {msgpack.unpackb(k)[1] for k in index.records()}  # noqa: E731
        hs = hash_blocks(np.arange(16 * 6), 16)
        for e, h in zip(store.reserve(ns, list(zip(hs, [None] + hs[:-1])), owner=1), hs):
            store.host.write(e.location, np.frombuffer(h * 512, np.uint8))
        store.commit(ns, hs, owner=1)
        assert index.num_pending == 6 and written() == set()  # nothing written inside the turn
        await asyncio.sleep(0)
        assert index.num_pending == 0 and written() == set(hs)
        store.remove(ns, [hs[3]])  # the chain's tail from hs[3] on
        assert written() == set(hs)
        await asyncio.sleep(0)
        assert written() == set(hs[:3])
        # From another thread while a turn is open (the daemon's close runs in an executor), records
        # and deletions are the index thread's to write, now: the loop's list holds the loop's only.
        del index._wake_index
        for e, h in zip(store.reserve(ns, [(hs[3], hs[2]), (hs[4], hs[3])], owner=1), hs[3:]):
            store.host.write(e.location, np.frombuffer(h * 512, np.uint8))
        store.commit(ns, [hs[3]], owner=1)

        def in_another_thread(fn, *args) -> None:  # the loop waits meanwhile: its turn stays open
            worker = threading.Thread(target=fn, args=args)
            worker.start()
            worker.join()

        in_another_thread(store.commit, ns, [hs[4]], 1)
        assert [item.key for item in index._turn] == [block_key(ns, hs[3])]
        poll(lambda: written() == {*hs[:3], hs[4]}, 10, "the index thread's record")
        in_another_thread(store.remove, ns, [hs[4]])
        poll(lambda: written() == set(hs[:3]), 10, "the index thread's deletion")
        await asyncio.sleep(0)
        assert written() == set(hs[:4])
        # A turn that ends after the store closed writes nothing (close wrote what was pending).
        for e, h in zip(store.reserve(ns, [(hs[4], hs[3])], owner=1), hs[4:]):
            store.host.write(e.location, np.frombuffer(h * 512, np.uint8))
        store.commit(ns, [hs[4]], owner=1)
        store.close()
        await asyncio.sleep(0)

    try:
        asyncio.run(main())
        store = TieredStore([HostArena(path, 64 * 8192, 8192, prefault=False, persistent=True)])
        hs = hash_blocks(np.arange(16 * 6), 16)
        assert store.lookup(store.register_namespace(ns_small), hs).hits == 5
        assert store.check() == []
        store.close()
    finally:
        remove_stale_arena(path)


def test_a_reserve_into_a_full_tier_writes_its_victims_deletions_once_before_it_returns(store_factory):
    """On the daemon's loop, with a tier below, room for a batch is made block by block (each victim
    demoted, its record deleted): the deletions are written in one transaction at the end of the
    reserve, not one a block, and before it returns, so no record points at the pages it handed out
    (the client writes them after the reply)."""
    import asyncio

    from kvstore.keys import hash_blocks

    store = store_factory(8 * 8192, 8192, persistent=True, disk_bytes=64 * 8192)
    index = store.host.index
    ns = store.register_namespace(type(NS)("victims", "bf16", 1, 1, 8, 16, 8192))
    old, new = hash_blocks(np.arange(16 * 8), 16), hash_blocks(np.arange(16 * 6) + 10_000, 16)
    assert all(store.reserve(ns, list(zip(old, [None] + old[:-1])), owner=1))
    store.commit(ns, old, owner=1)
    assert len(index.records()) == 8
    commits: list[int] = []
    real = index._commit
    index._commit = lambda *a: (commits.append(len(index._deletes)), real(*a))[1]

    async def reserve() -> list:
        return store.reserve(ns, list(zip(new, [None] + new[:-1])), owner=1)

    entries = asyncio.run(reserve())
    assert all(entries)
    assert commits[0] == 6  # the six victims' deletions, in one transaction
    held = {tuple(map(tuple, rec["e"])) for rec in index.records().values()}
    assert len(held) == 2 and not held & {tuple(map(tuple, e.location)) for e in entries}
    assert store.lookup(ns, old).tiers == ("host",) * 2 + ("disk",) * 6  # the victims: the chain's leaves
