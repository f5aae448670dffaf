"""The disk tier and its store integration, in process: real files, O_DIRECT, LMDB.

Every scenario ends with `store.check() == []`. Payloads are derived from the
block hash (`payload_for`), so any served byte can be verified.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import threading
import uuid

import numpy as np
import pytest

from kvstore.store import TieredStore
from kvstore.keys import Namespace, block_key, key_hash
from tests.helpers import chain_hashes, namespace, payload_bytes, poll, put_one_by_one
from kvstore.tiers.disk import DATA_FILE, DiskTier
from kvstore.tiers.disk_slot import checksum_of, extents_of
from kvstore.tiers.disk_alloc import PageAllocator
from kvstore.tiers.disk_writer import DiskWriter
from kvstore.tiers.host import HostArena

BLOCK = 64 * 1024
PAGE = 64 * 1024
NS = namespace("m", BLOCK, dtype="bf16")


class Harness:
    """A store over a fresh host arena and a disk tier in `folder`; reopenable."""

    def __init__(self, folder, host_blocks=8, disk_blocks=48, direct=None):
        self.folder, self.host_blocks, self.disk_blocks, self.direct = str(folder), host_blocks, disk_blocks, direct
        self.store: TieredStore | None = None
        self.open()

    def open(self) -> TieredStore:
        host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", self.host_blocks * BLOCK, PAGE)
        disk = DiskTier(self.folder, self.disk_blocks * BLOCK, page_bytes=PAGE, direct=self.direct,
                        staging_bytes=16 * BLOCK)
        self.store = TieredStore([host, disk])
        self.store.register_namespace(NS)
        return self.store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store.host.close()
            self.store = None

    def reopen(self) -> TieredStore:
        self.close()
        return self.open()

    def put(self, hashes, parent=None, owner="w") -> int:
        """Put a chain one block per reserve/commit (a batch cannot exceed the tiny host tier)."""
        return put_one_by_one(self.store, self.store.register_namespace(NS), hashes, BLOCK, parent, owner)

    def spill(self, *chains) -> None:
        """Put `chains`, then filler chains until every block of `chains` is on disk."""
        for c in chains:
            self.put(c)
        for salt in range(1000, 1100):
            if all(t == "disk" for c in chains for t in self.store.lookup(NS.id, c).tiers):
                return
            self.put(chain_hashes(salt, 2))
        raise AssertionError("the chains never reached the disk")

    def get(self, hashes, owner="r") -> list[bytes | None]:
        """Acquire (promoting), copy out, release: what a client would see."""
        store = self.store
        entries = store.pin(NS.id, hashes, owner)
        entries = asyncio.run(store.prepare_read(entries, owner))
        out = [store.host.read(e.location) if e is not None else None for e in entries]
        store.release(NS.id, [key_hash(e.key) for e in entries if e is not None], owner)
        return out


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path / "disk")
    yield h
    h.close()


def test_page_allocator_extents_and_check():
    alloc = PageAllocator(8, 4096)
    a = alloc.allocate(3 * 4096 - 10)
    assert a == [[0, 3 * 4096 - 10]]
    b = alloc.allocate(4096)
    alloc.free(a)
    c = alloc.allocate(5 * 4096)
    assert sum(n for _, n in c) == 5 * 4096
    assert alloc.check([b, c]) == []
    assert alloc.check([b]) != []  # c's pages leaked
    assert alloc.allocate(4 * 4096) is None


def test_direct_io_is_used_on_this_disk(harness):
    disk = harness.store.disk
    assert disk.direct, disk.direct_reason
    assert os.path.getsize(os.path.join(harness.folder, DATA_FILE)) == disk.capacity_bytes


def test_buffered_fallback_logs_its_reason(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk"):
        h = Harness(tmp_path / "disk", host_blocks=4, disk_blocks=16)
    try:
        assert not h.store.disk.direct
        assert "refuses O_DIRECT" in h.store.disk.direct_reason
        assert "refuses O_DIRECT" in caplog.text
        chains = [chain_hashes(s, 2) for s in range(5)]
        for c in chains:
            assert h.put(c) == 2
        assert h.store.lookup(NS.id, chains[0]).tiers == ("disk", "disk")
        h.store.flush()
        assert h.get(chains[0]) == [payload_bytes(x, BLOCK) for x in chains[0]]
        assert h.store.check() == []
    finally:
        h.close()


def test_demotion_instead_of_drop_and_promotion_identical_bytes(harness):
    store = harness.store
    chains = [chain_hashes(s, 4) for s in range(5)]
    for c in chains:
        assert harness.put(c) == 4
    tiers = [t for c in chains for t in store.lookup(NS.id, c).tiers]
    assert tiers.count("host") == 8 and tiers.count("disk") == 12
    for c in chains:  # the root is in the fastest tier of its chain
        t = store.lookup(NS.id, c).tiers
        assert list(t) == sorted(t, key=["gpu", "host", "disk"].index)
    assert store.check() == []  # flushes: every demoted block is durable now
    st = store.stats()["tiers"]
    assert st["disk"]["blocks"] == 12 and st["disk"]["demotions_in"] == 12
    assert st["disk"]["durable_blocks"] == 12 and st["disk"]["pending_writes"] == 0
    assert st["host"]["evictions"] == 12 and st["disk"]["evictions"] == 0
    assert store.lookup(NS.id, chains[0]).tiers == ("disk",) * 4
    assert harness.get(chains[0]) == [payload_bytes(x, BLOCK) for x in chains[0]]
    assert store.stats()["tiers"]["disk"]["hits"] == 4
    assert store.lookup(NS.id, chains[0]).tiers == ("host",) * 4
    assert store.check() == []


def test_disk_chain_is_promoted_root_first(harness):
    store = harness.store
    first, others = chain_hashes(1, 4), [chain_hashes(s, 4) for s in range(2, 6)]
    harness.put(first)
    for c in others:
        harness.put(c)  # pushes all of `first` to disk
    assert store.lookup(NS.id, first).tiers == ("disk",) * 4
    got = harness.get(first)
    assert got == [payload_bytes(x, BLOCK) for x in first]
    assert store.lookup(NS.id, first).tiers == ("host",) * 4
    assert sum(t == "disk" for c in others for t in store.lookup(NS.id, c).tiers) == 12  # made room for `first`
    st = store.stats()["tiers"]
    assert st["host"]["promotions_in"] == 4 and st["disk"]["promotions_out"] == 4
    assert st["disk"]["hits"] == 4
    assert store.check() == []


def test_idle_staging_goes_back_to_the_system_once_the_writes_are_done(harness, monkeypatch):
    """The staging buffers a burst of demotions filled (prefaulted: resident) are unmapped down to
    KEEP_BYTES once the writes are done and collected; the budget itself stays available."""
    import kvstore.tiers.disk_alloc as disk_alloc

    monkeypatch.setattr(disk_alloc, "KEEP_BYTES", 2 * BLOCK)
    disk = harness.store.disk
    poll(lambda: disk.stats()["staging_held_bytes"] == 16 * BLOCK, 10, "the namespace's prewarmed staging")
    harness.spill(chain_hashes(1, 6))
    harness.store.flush()
    disk.reap()
    assert disk.stats()["staging_held_bytes"] <= 2 * BLOCK
    harness.spill(chain_hashes(2, 6))  # and demotions take new buffers again
    assert harness.get(chain_hashes(2, 6)) == [payload_bytes(h, BLOCK) for h in chain_hashes(2, 6)]
    assert harness.store.check() == []


def test_written_blocks_keep_no_write_job_alive(harness):
    """Once a burst of demotions is written and collected, nothing holds their write jobs (each keeps
    its record and staging buffer): not the slots, nor the writer thread waiting for its next batch."""
    import gc

    from kvstore.tiers.disk import record_key
    from kvstore.tiers.disk_writer import DiskWrite

    hashes = chain_hashes(3, 6)
    mine = {record_key(block_key(NS.id, h)) for h in hashes}

    def jobs_alive() -> int:  # this burst's (type(), not isinstance: that would touch dead weak proxies)
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is DiskWrite and o.key in mine)

    harness.spill(hashes)
    harness.store.flush()
    harness.store.disk.reap()
    poll(lambda: jobs_alive() == 0, 5, "no write job alive")  # (the writer thread lets go after flush returns)
    assert harness.get(hashes) == [payload_bytes(h, BLOCK) for h in hashes]


def test_promotion_from_staging_before_the_write_lands(harness):
    store = harness.store
    first = chain_hashes(1, 4)
    for s in range(1, 6):
        harness.put(chain_hashes(s, 4))
    assert store.lookup(NS.id, first).tiers == ("disk",) * 4
    # Whatever the writer has done by now, the bytes are served (staging or disk).
    assert harness.get(first) == [payload_bytes(x, BLOCK) for x in first]
    assert store.check() == []


def test_disk_budget_is_never_exceeded(tmp_path):
    h = Harness(tmp_path / "disk", host_blocks=2, disk_blocks=6)
    try:
        store = h.store
        for s in range(12):
            h.put(chain_hashes(s, 3))
            assert store.disk.used_bytes <= store.disk.capacity_bytes
            assert store.stats()["tiers"]["disk"]["bytes"] <= store.disk.capacity_bytes
        assert store.shared.tier_stats["disk"].evictions > 0
        assert os.path.getsize(os.path.join(h.folder, DATA_FILE)) == store.disk.capacity_bytes
        assert store.check() == []
        store = h.reopen()
        assert store.disk.used_bytes <= store.disk.capacity_bytes
        assert store.check() == []
    finally:
        h.close()


def test_smaller_budget_at_restart_drops_what_no_longer_fits(tmp_path):
    h = Harness(tmp_path / "disk", host_blocks=2, disk_blocks=16)
    try:
        for s in range(6):
            h.put(chain_hashes(s, 3))
        h.close()
        h.disk_blocks = 4
        store = h.open()
        assert store.disk.used_bytes <= 4 * BLOCK
        assert os.path.getsize(os.path.join(h.folder, DATA_FILE)) == 4 * BLOCK
        assert store.check() == []
    finally:
        h.close()


def test_tree_rule_across_tiers_under_random_operations(harness):
    rng = np.random.default_rng(7)
    store = harness.store
    chains = [chain_hashes(s, int(rng.integers(1, 7))) for s in range(30)]
    restarts = 0
    for step in range(200):
        c = chains[int(rng.integers(len(chains)))]
        op = rng.random()
        if op < 0.5:
            harness.put(c)
        elif op < 0.9:
            got = harness.get(c)
            for h, data in zip(c, got):
                if data is not None:
                    assert data == payload_bytes(h, BLOCK)
        elif op < 0.97:
            store.remove(NS.id, c[:1])
        else:
            before = {e.key for e in store.iter_entries()}
            store = harness.reopen()  # a clean restart keeps every block (the host tier is persisted)
            after = {e.key for e in store.iter_entries()}
            assert after <= before and len(after) == min(len(before), harness.disk_blocks)
            restarts += 1
        for e in store.iter_entries():
            if e.parent is not None:
                parent = store.index.entries[e.parent]
                assert ["gpu", "host", "disk"].index(e.tier) >= ["gpu", "host", "disk"].index(parent.tier)
        if step % 30 == 0:
            assert store.check() == []
    assert store.check() == [] and restarts >= 3
    harness.reopen()
    assert harness.store.check() == []


def test_put_under_a_disk_parent_is_skipped(harness):
    store = harness.store
    first = chain_hashes(1, 2)
    harness.spill(first)
    assert store.lookup(NS.id, first).tiers == ("disk", "disk")
    child = chain_hashes(1, 3)[2]
    assert harness.put([child], parent=first[1]) == 0
    assert store.shared.counters["put_parent_on_disk_blocks"] == 1
    assert store.check() == []


def test_write_failure_drops_the_block(harness, monkeypatch):
    store = harness.store
    disk = store.disk

    def broken(views, offset):  # every data write fails, as on a failing device
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk.writer, "_pwrite_all", broken)
    chains = [chain_hashes(s, 4) for s in range(4)]
    for c in chains:
        harness.put(c)
    store.flush()
    assert store.shared.counters["disk_write_failures"] == 8
    assert store.stats()["tiers"]["disk"]["blocks"] == 0
    assert store.check() == []


def test_unaligned_block_size_round_trips_through_the_bounce_buffer(tmp_path):
    ns = Namespace("odd", "fp32", 1, 1, 64, 16, 50_001)  # not a multiple of 4096
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 4 * BLOCK, PAGE)
    store = TieredStore([host, DiskTier(str(tmp_path / "disk"), 32 * BLOCK, page_bytes=PAGE)])
    try:
        ns_id = store.register_namespace(ns)
        hashes = [bytes([i]) * 16 for i in range(1, 9)]
        for h in hashes:  # eight roots; the host tier holds four
            (e,) = store.reserve(ns_id, [(h, None)], "w")
            store.host.write(e.location, payload_bytes(h, ns.block_bytes))
            store.commit(ns_id, [h], "w")
        assert store.lookup(ns_id, hashes[:1]).tiers == ("disk",)
        store.flush()
        entries = store.pin(ns_id, hashes[:4], "r", prefix=False)
        got = asyncio.run(store.prepare_read(entries, "r"))
        assert [store.host.read(e.location) for e in got] == [payload_bytes(h, ns.block_bytes) for h in hashes[:4]]
        store.release(ns_id, hashes[:4], "r")
        assert store.check() == []
    finally:
        store.close()
        host.close()


def test_a_read_scattered_over_more_segments_than_iov_max(tmp_path):
    ns = Namespace("big", "bf16", 1, 1, 64, 16, 1200 * 4096)
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 2 * ns.block_bytes, 4096)
    store = TieredStore([host, DiskTier(str(tmp_path / "disk"), 4 * ns.block_bytes, page_bytes=PAGE)])
    try:
        ns_id = store.register_namespace(ns)
        hashes = [bytes([i]) * 16 for i in range(1, 4)]
        for h in hashes:
            (e,) = store.reserve(ns_id, [(h, None)], "w")
            store.host.write(e.location, payload_bytes(h, ns.block_bytes))
            store.commit(ns_id, [h], "w")
        store.flush()
        slot = store.index.entries[block_key(ns_id, hashes[0])].location
        assert store.disk.direct and store.disk.read_blocks(slot)
        buf = mmap.mmap(-1, ns.block_bytes)
        whole = np.frombuffer(buf, dtype=np.uint8)
        dst = [whole[i * 4096 : (i + 1) * 4096] for i in range(1200)]  # 1200 iovecs > IOV_MAX (1024)
        assert store.disk.reader.read_block(extents_of(slot), ns.block_bytes, checksum_of(slot), dst)
        assert whole.tobytes() == payload_bytes(hashes[0], ns.block_bytes)
        del dst, whole
        buf.close()
        assert store.check() == []
    finally:
        store.close()
        host.close()


def test_flush_does_not_wait_for_formatting(tmp_path, monkeypatch):
    """Formatting a large file takes long; flush() (check(), close()) waits for one chunk at most."""
    chunks = []

    def slow_chunk(self):  # a formatter that would need thousands of chunks
        chunks.append(1)
        threading.Event().wait(0.002)
        self.formatted_bytes += self.data.page_bytes

    monkeypatch.setattr(DiskWriter, "_format_chunk", slow_chunk)
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 4 * BLOCK, PAGE)
    disk = DiskTier(str(tmp_path / "disk"), 4096 * PAGE, page_bytes=PAGE)
    store = TieredStore([host, disk])
    try:
        store.register_namespace(NS)
        for _ in range(20):
            before = len(chunks)
            store.flush()
            assert len(chunks) - before <= 1
        assert store.check() == []
        assert disk.formatted_bytes < disk.capacity_bytes
        formatted = disk.formatted_bytes
        # and formatting resumes afterwards
        assert disk.writer.wait_for(lambda: disk.formatted_bytes > formatted + 10 * PAGE, timeout=30)
    finally:
        store.close()
        host.close()


def test_tier_on_tmpfs_works_with_whatever_io_the_kernel_allows(caplog):
    """/dev/shm is tmpfs: O_DIRECT where the kernel supports it there (>= 6.6), else buffered + reason."""
    folder = f"/dev/shm/kvstore-test-disk-{uuid.uuid4().hex}"
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk"):
            h = Harness(folder, host_blocks=4, disk_blocks=16)
        try:
            disk = h.store.disk
            assert disk.direct or ("refuses O_DIRECT" in disk.direct_reason and disk.direct_reason in caplog.text)
            chains = [chain_hashes(s, 2) for s in range(5)]
            for c in chains:
                h.put(c)
            assert h.store.lookup(NS.id, chains[0]).tiers == ("disk", "disk")
            assert h.get(chains[0]) == [payload_bytes(x, BLOCK) for x in chains[0]]
            assert h.store.check() == []
            h.reopen()
            assert h.store.check() == []
        finally:
            h.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def corrupt_on_disk(harness, entry) -> None:
    """Overwrite the first bytes of a disk-tier block in the data file (its checksum no longer matches)."""
    with open(os.path.join(harness.folder, DATA_FILE), "r+b") as f:
        f.seek(extents_of(entry.location)[0][0])
        f.write(b"garbage!")
        f.flush()
        os.fsync(f.fileno())


def present_misses(store) -> dict:
    prefix = "present_misses_"
    return {k[len(prefix):]: n for k, n in store.stats()["counters"].items() if k.startswith(prefix)}


def test_a_present_block_read_as_a_miss_is_counted_by_reason(harness):
    """Protocol fuzzing: reads of committed, unpinned blocks returned misses with nothing to say
    why. Each such miss is counted by its reason: no room to promote, checksum (and the subtree
    discarded with it), a prefix read's stop at its first miss."""
    store = harness.store
    hashes = chain_hashes(0, 4)
    harness.spill(hashes)
    assert present_misses(store) == {}
    residents = [key_hash(e.key) for e in store.iter_entries() if e.tier == "host" and e.committed]
    store.pin(NS.id, residents, "hog", prefix=False)  # the arena full of pinned blocks: no room to promote
    assert harness.get(hashes) == [None] * 4
    assert present_misses(store) == {"no_room": 4}
    store.release(NS.id, residents, "hog")
    store.flush()
    victim = store.index.entries[block_key(NS.id, hashes[1])]
    assert victim.tier == "disk"
    corrupt_on_disk(harness, victim)
    got = harness.get(hashes)
    assert got[0] == payload_bytes(hashes[0], BLOCK) and got[1:] == [None] * 3
    assert present_misses(store) == {"no_room": 4, "checksum_disk": 1, "discarded": 2}
    absent = chain_hashes(7, 1)[0]
    store.pin(NS.id, [absent, hashes[0]], "r")  # hashes[0] is present; the prefix read stopped before it
    assert present_misses(store)["after_a_miss"] == 1
    assert store.check() == []
