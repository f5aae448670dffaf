"""The disk tier's cap on blocks (`[disk] max_blocks`): each block it holds is indexed in the daemon's
memory, so a disk of small blocks is capped at what the memory indexes, and past the cap it evicts as a
full tier does. In process, real files and LMDB (tests/test_disk.py's harness)."""

from __future__ import annotations

import pytest

from kvstore.chain import INDEX_BYTES_PER_BLOCK, INDEX_MEMORY_SHARE, disk_max_blocks, memory_limit
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.tiers.disk import DiskTier
from tests.helpers import chain_hashes, payload_bytes
from tests.test_disk import BLOCK, NS, PAGE, Harness


class CappedHarness(Harness):
    """tests/test_disk.py's harness with the disk tier capped at `max_blocks` (None: no cap)."""

    def __init__(self, folder, max_blocks, **kwargs):
        self.max_blocks = max_blocks
        super().__init__(folder, **kwargs)

    def open(self):
        store = super().open()
        store.disk.max_blocks = store.disk.num_pages if self.max_blocks is None else self.max_blocks
        return store


def test_the_tier_allocates_up_to_its_cap_and_counts_what_it_frees(tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), 16 * BLOCK, page_bytes=PAGE, max_blocks=3)
    try:
        disk.scanned(wait=True)
        taken = [disk.allocate(BLOCK) for _ in range(3)]
        assert all(a is not None for a in taken) and disk.blocks == 3
        assert disk.allocate(BLOCK) is None  # 13 pages free, no block to be had
        assert disk.shortfall(BLOCK) == PAGE and disk.batch_shortfall(BLOCK, 4) == 4 * PAGE
        disk.release(taken.pop(), None)
        assert disk.blocks == 2 and disk.shortfall(BLOCK) <= 0 and disk.allocate(BLOCK) is not None
        assert "disk tier counts 3 blocks, the store holds 2" in disk.check(taken)  # one allocation unaccounted
        assert disk.stats()["held_blocks"] == 3 and disk.stats()["max_blocks"] == 3
    finally:
        disk.close()
    with pytest.raises(ValueError, match="max_blocks"):
        DiskTier(str(tmp_path / "other"), 16 * BLOCK, page_bytes=PAGE, max_blocks=0)


@pytest.mark.parametrize("cap", [5, None])
def test_a_capped_disk_evicts_at_its_cap_and_keeps_the_newest(tmp_path, cap):
    """Room for 40 blocks of pages, a cap of 5: writing 30 chains of 3 through a host tier of 2 blocks keeps
    the disk at 5 blocks, evicting; without the cap (the control) it holds far more."""
    h = CappedHarness(tmp_path / "disk", cap, host_blocks=2, disk_blocks=40)
    try:
        store = h.store
        for s in range(30):
            h.put(chain_hashes(s, 3))
            assert cap is None or store.disk.blocks <= cap
        held = store.stats()["tiers"]["disk"]["held_blocks"]
        assert store.check() == []
        if cap is None:
            assert held > 20 and store.shared.tier_stats["disk"].evictions > 0  # its 40 pages filled up
            return
        assert held == store.disk.blocks == cap and store.shared.tier_stats["disk"].evictions > 40
        newest = chain_hashes(29, 3)
        found = store.lookup(NS.id, newest).hits
        assert found >= 2  # the last chain (a block under a disk parent is skipped: tests/test_disk.py)
        assert [bytes(b) for b in h.get(newest[:found])] == [payload_bytes(x, BLOCK) for x in newest[:found]]
    finally:
        h.close()


def test_a_lowered_cap_keeps_the_newest_blocks_at_the_restart(tmp_path, caplog):
    """A disk over its cap at a restart (the cap was lowered) keeps the blocks that reached it last, as a
    smaller budget keeps what fits; the others' records go and their pages are free."""
    h = CappedHarness(tmp_path / "disk", None, host_blocks=2, disk_blocks=40)
    try:
        for s in range(8):
            h.put(chain_hashes(s, 3))
        h.store.close()  # (its host blocks are written down to the disk)
        h.store.host.close()
        h.store = None
        disk = DiskTier(h.folder, 40 * BLOCK, page_bytes=PAGE)
        every = sorted(disk.scanned(wait=True), key=lambda b: b.stamp)
        disk.close()
        assert len(every) > 6 and every[-7].stamp < every[-6].stamp  # (no tie across the cut)
        newest = every[-6:]
        disk = DiskTier(h.folder, 40 * BLOCK, page_bytes=PAGE, max_blocks=6)
        try:
            found = disk.scanned(wait=True)
            assert {b.key for b in found} == {b.key for b in newest}
            assert disk.blocks == 6 and disk.alloc.free_pages == 40 - 6
            disk.flush()
            assert disk.num_kept_records == 6 and "more than max_blocks 6" in caplog.text
        finally:
            disk.close()
        h.max_blocks = 6
        store = h.open()
        store.wait_recovered()
        kept = {b.key for b in newest}
        assert {k for k, e in store.index.entries.items() if e.tier == "disk"} <= kept  # (orphans freed)
        assert store.disk.blocks <= 6 and store.check() == []
    finally:
        h.close()


def test_the_default_cap_is_what_a_quarter_of_the_memory_limit_indexes(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       32768000 kB\nMemFree:        1000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/kube/pod1/kvstore\n")
    assert memory_limit(str(proc), str(cgroup)) == 32768000 * 1024  # no cgroup files: the host's
    (cgroup / "kube" / "pod1").mkdir(parents=True)
    (cgroup / "kube" / "pod1" / "memory.max").write_text("8589934592\n")  # the pod's 8 GiB, above the group
    (cgroup / "kube" / "pod1" / "kvstore").mkdir()
    (cgroup / "kube" / "pod1" / "kvstore" / "memory.max").write_text("max\n")
    assert memory_limit(str(proc), str(cgroup)) == 8 << 30
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")  # cgroup v1's memory controller
    (cgroup / "memory" / "job").mkdir(parents=True)
    (cgroup / "memory" / "job" / "memory.limit_in_bytes").write_text("4294967296\n")
    assert memory_limit(str(proc), str(cgroup)) == 4 << 30
    auto = load_config()
    assert auto.disk.max_blocks == "auto"
    assert disk_max_blocks(auto, 8 << 30) == int((8 << 30) * INDEX_MEMORY_SHARE) // INDEX_BYTES_PER_BLOCK
    assert disk_max_blocks(load_config(None, {"disk.max_blocks": 1000}), 8 << 30) == 1000


@pytest.mark.parametrize("value", [0, -3, "lots", True, 2.5])
def test_a_bad_cap_is_refused_with_its_key(tmp_path, value):
    path = tmp_path / "kv.toml"
    path.write_text(f"[disk]\nmax_blocks = {value!r}\n".replace("'", '"').replace("True", "true"))
    with pytest.raises(ConfigError, match="disk.max_blocks"):
        load_config(str(path))


def test_the_daemon_s_store_takes_the_configured_cap_and_logs_a_binding_one(tmp_path, caplog):
    import uuid

    from kvstore.chain import open_store

    def store_with(max_blocks):
        return open_store(load_config(None, {
            "name": f"cap-{uuid.uuid4().hex[:8]}", "host.capacity": "1MiB", "host.page_size": "64KiB",
            "host.persistent": False, "disk.path": str(tmp_path / "disk"), "disk.capacity": "4MiB",
            "disk.page_size": "64KiB", "disk.max_blocks": max_blocks}))

    for max_blocks, want in ((7, 7), (10**9, 64)):  # (a cap above its 64 pages binds nothing)
        caplog.clear()
        with caplog.at_level("INFO", logger="kvstore.chain"):
            store = store_with(max_blocks)
        try:
            assert store.disk.max_blocks == want and store.stats()["tiers"]["disk"]["max_blocks"] == want
            assert ("disk tier: at most 7 blocks" in caplog.text) == (want == 7)
        finally:
            store.close(persist=False)
            store.host.close()


@pytest.mark.parametrize("per_record", [1024, 8])
def test_the_index_map_holds_a_record_of_every_block_the_tier_can_hold(tmp_path, monkeypatch, per_record):
    """The disk index's LMDB map is sized for the tier's blocks (`map_bytes`): with a floor of 256 KiB, 1,500
    records of 4 KiB blocks all land. The control, a map of 8 B a block (the floor then), fills up: the
    writes past it fail (MDB_MAP_FULL, logged) and their blocks are dropped."""
    import asyncio
    import uuid

    import numpy as np

    from kvstore.keys import Namespace, hash_blocks
    from kvstore.store import TieredStore
    from kvstore.tiers import disk as disk_module, record_scan
    from kvstore.tiers.host import HostArena

    monkeypatch.setattr(disk_module, "INDEX_MAP_FLOOR", 256 << 10)
    monkeypatch.setattr(record_scan, "MAP_BYTES_PER_RECORD", per_record)
    block, n = 4096, 1500
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 64 * block, block, prefault=False)
    store = TieredStore([host, DiskTier(str(tmp_path / "disk"), n * block, block)], policy="lru")

    async def fill() -> None:
        ns = store.register_namespace(Namespace("map", "bf16", 1, 1, 128, 16, block))
        for c in range(0, n, 32):
            hs = hash_blocks(np.random.default_rng([3, c]).integers(0, 2**31, size=32 * 16), 16)
            store.reserve(ns, list(zip(hs, [None] + hs[:-1])), "w")
            store.commit(ns, hs, "w")
            await asyncio.sleep(0)
        store.disk.flush()

    try:
        store.start()
        asyncio.run(fill())
        kept = store.disk.num_kept_records
        if per_record == 8:
            assert kept < n - 64 - 32  # the map was what bounded it: the writes past it failed
            return
        assert kept >= n - 64 - 32  # all but what the host tier holds (and a batch it made room for)
        assert store.check() == []
    finally:
        store.close(persist=False)
        host.close()


def test_the_kept_arena_s_index_map_is_sized_for_its_pages(monkeypatch):
    """The host arena's placement index (one record a block) the same way: a map for every page it has."""
    import uuid

    from kvstore.tiers import record_scan
    from kvstore.tiers.host import HostArena
    from kvstore.tiers.host_index import MAP_FLOOR

    monkeypatch.setattr(record_scan, "MAP_BYTES_PER_RECORD", 2 * MAP_FLOOR // 256)  # 256 pages: twice the floor
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 256 * 4096, 4096, prefault=False, persistent=True)
    try:
        assert host.index.env.info()["map_size"] == 2 * MAP_FLOOR
    finally:
        host.close(unlink=True)


def test_a_daemon_holds_its_disk_at_the_cap_and_a_lowered_one_at_its_restart(tmp_path):
    """Separate processes: a daemon whose disk tier is capped at 300 blocks takes 1,536 through a host tier
    of 256, keeps 300 on disk (its stats and metrics say so), and serves the newest chain; restarted with a
    cap of 100 it keeps 100 of them and serves what it kept, byte-identical."""
    from kvstore.client import KVClient
    from kvstore.keys import Namespace
    from kvstore.tools.harness.daemon_proc import start_daemon
    from tests.helpers import poll

    ns_small = Namespace("capped", "bf16", 1, 1, 8, 16, 4096)
    config = tmp_path / "kvstore.toml"

    def configure(max_blocks: int) -> None:
        config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\ncapacity = {4096 * 4096}\npage_size = 4096\n'
                          f"max_blocks = {max_blocks}\n")

    configure(300)
    flags = dict(host_bytes=str(256 * 4096), page_bytes="4096", disk=True)
    chains = [chain_hashes(s, 64) for s in range(24)]
    d = start_daemon(tmp_path, "--config", str(config), **flags)
    try:
        with KVClient(d.socket_path) as c:
            ns = c.register(ns_small)
            for hs in chains:
                assert c.put(ns, [(h, p, payload_bytes(h, 4096)) for h, p in zip(hs, [None] + hs[:-1])]) == 64
            disk = c.stats()["tiers"]["disk"]
            assert disk["max_blocks"] == 300 and disk["held_blocks"] == 300 and disk["evictions"] > 0
            assert c.lookup(ns, chains[-1]).hits == 64
        status, body = d.http("/metrics")
        assert status == 200 and 'kvstore_held_blocks{tier="disk"} 300.0' in body.decode()
        assert d.check() == []
        d.stop()  # (its kept arena removed: the restart starts from the disk alone)
        configure(100)
        d = start_daemon(tmp_path, "--config", str(config), name=d.name, **flags)
        with KVClient(d.socket_path) as c:
            ns = c.register(ns_small)
            poll(lambda: "recovery" not in c.stats(), 60, "the background recovery")
            disk = c.stats()["tiers"]["disk"]
            assert disk["held_blocks"] <= 100 and disk["blocks"] > 0
            found = [(hs, c.lookup(ns, hs).hits) for hs in chains]
            hs, n = next((hs, n) for hs, n in reversed(found) if n)
            got = c.get(ns, hs[:n])
            assert all(g is not None and g.tobytes() == payload_bytes(h, 4096) for g, h in zip(got, hs))
        assert d.check() == []
    finally:
        d.stop()
