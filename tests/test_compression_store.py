"""Compressed blocks in the store (kvstore/compression.py): demoted to disk encoded, promoted decoded,
kept apart from exact blocks, refused when damaged, recovered after a restart. Real shared memory, real
files with O_DIRECT, LMDB; `check()` after every scenario."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import uuid

import numpy as np
import pytest

from kvstore.codec import BlockLayout, Budget, decode, encode, encoded_bytes, from_float32
from kvstore.compression import Compression, decode_into
from kvstore.config import CompressionConfig
from kvstore.errors import NamespaceError
from kvstore.keys import Namespace, block_key, key_hash, key_ns
from kvstore.store import TieredStore
from kvstore.tiers.base import ENCODE_THREADS
from kvstore.tiers.disk import DATA_FILE, ENCODE_BACKLOG, DiskTier, record_key
from kvstore.tiers.disk_slot import codec_of
from kvstore.tiers.host import HostArena
from tests.helpers import chain_hashes

PAGE = 4096
LAYOUT = BlockLayout(2, 2, 16, 64, "bfloat16", "HKTVND")  # what "cpu/LBHNC" is to the codec
EXACT_NS = Namespace("m", "bfloat16", 2, 2, 64, 16, LAYOUT.block_bytes, layout="cpu/LBHNC")
LOSSY_NS = dataclasses.replace(EXACT_NS, codec="k4v2")
BLOCK = LAYOUT.block_bytes  # 16 KiB: 4 pages exact, 1 page at k4v2


def payload(h: bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return from_float32(rng.standard_normal(BLOCK // 2).astype(np.float32), "bfloat16").tobytes()


class Harness:
    def __init__(self, folder, compress=True, profile_dir="", decoder=decode_into, host_blocks=4,
                 exact_when_busy=False, disk_pages=256):
        """`exact_when_busy` off: every opted-in demotion is encoded, however busy the encoders."""
        self.folder, self.compress, self.profile_dir, self.decoder = str(folder), compress, profile_dir, decoder
        self.host_blocks, self.exact_when_busy, self.disk_pages = host_blocks, exact_when_busy, disk_pages
        self.open()

    def open(self) -> None:
        host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", self.host_blocks * BLOCK, PAGE)
        disk = DiskTier(self.folder, self.disk_pages * PAGE, page_bytes=PAGE, staging_bytes=16 * BLOCK, decoder=self.decoder)
        self.store = TieredStore([*self.tiers_above(), host, disk], compression=Compression(self.compression_config()))

    def tiers_above(self) -> list:
        """Tiers above the arena: none here (tests/test_gpu_decode.py adds a GPU tier)."""
        return []

    def compression_config(self) -> CompressionConfig:
        return CompressionConfig(disk=self.compress, profile_dir=self.profile_dir, exact_when_busy=self.exact_when_busy)

    def close(self) -> None:
        self.store.close()
        self.store.host.close()

    def put(self, ns: Namespace, hashes) -> None:
        store = self.store
        ns_id = store.register_namespace(ns)
        prev = None
        for h in hashes:
            (e,) = store.reserve(ns_id, [(h, prev)], "w")
            prev = h
            store.host.write(e.location, payload(h))
            store.commit(ns_id, [h], "w")

    def spill(self, ns: Namespace, hashes) -> None:
        """Put `hashes`, then filler chains until all of them sit on disk."""
        self.put(ns, hashes)
        for salt in range(1000, 1100):
            if all(t == "disk" for t in self.store.lookup(ns.id, hashes).tiers):
                return
            self.put(ns, chain_hashes(salt, 2))
        raise AssertionError("never reached the disk")

    def get(self, ns: Namespace, hashes) -> list[bytes | None]:
        store = self.store
        entries = asyncio.run(store.prepare_read(store.pin(ns.id, hashes, "r"), "r"))
        out = [store.host.read(e.location) if e is not None else None for e in entries]
        store.release(ns.id, [key_hash(e.key) for e in entries if e is not None], "r")
        return out


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path / "disk")
    yield h
    h.close()


def lossy(h: bytes, ns: Namespace = LOSSY_NS) -> bytes:
    budget = Budget.uniform(LAYOUT, 4, 2)
    return decode(encode(np.frombuffer(payload(h), np.uint8), LAYOUT, budget), LAYOUT).tobytes()


def test_an_opted_in_block_is_demoted_encoded_and_promoted_decoded(harness):
    hashes = chain_hashes(1, 3)
    harness.spill(LOSSY_NS, hashes)
    disk = harness.store.disk
    disk.flush()  # served from disk, not from a pending write's staging buffer
    stored = encoded_bytes(LAYOUT, Budget.uniform(LAYOUT, 4, 2))
    row = disk.stats()["compressed"]
    (tag,) = row
    assert tag.startswith("k4v2@") and row[tag]["stored_bytes"] == row[tag]["blocks"] * stored
    assert row[tag]["logical_bytes"] == row[tag]["blocks"] * BLOCK and row[tag]["ratio"] == round(BLOCK / stored, 3)
    e = harness.store.index.entries[block_key(LOSSY_NS.id, hashes[0])]
    assert e.nbytes == BLOCK and sum(n for _, n in e.location.extents) == stored  # one page, not four
    got = harness.get(LOSSY_NS, hashes)
    assert got == [lossy(h) for h in hashes]
    assert got[0] != payload(hashes[0])  # lossy indeed
    assert harness.store.check() == []


def test_exact_namespaces_stay_exact_and_never_see_lossy_blocks(harness):
    hashes = chain_hashes(2, 3)
    harness.spill(LOSSY_NS, hashes)
    assert harness.store.lookup(harness.store.register_namespace(EXACT_NS), hashes).hits == 0
    harness.spill(EXACT_NS, hashes)
    harness.store.disk.flush()  # (a block whose write is pending is served exact, from its staging buffer)
    assert harness.get(EXACT_NS, hashes) == [payload(h) for h in hashes]
    assert harness.get(LOSSY_NS, hashes) == [lossy(h) for h in hashes]
    assert EXACT_NS.id != LOSSY_NS.id
    assert harness.store.check() == []


def test_compression_off_stores_opted_in_blocks_exact(tmp_path):
    h = Harness(tmp_path / "disk", compress=False)
    try:
        hashes = chain_hashes(3, 2)
        h.spill(LOSSY_NS, hashes)
        assert h.store.disk.stats()["compressed"] == {}
        assert h.get(LOSSY_NS, hashes) == [payload(x) for x in hashes]
        assert h.store.check() == []
    finally:
        h.close()


def test_a_damaged_compressed_block_is_a_miss_and_never_served(harness):
    hashes = chain_hashes(4, 3)
    harness.spill(LOSSY_NS, hashes)
    store = harness.store
    store.disk.flush()
    slot = store.index.entries[block_key(LOSSY_NS.id, hashes[1])].location
    offset = slot.extents[0][0]
    with open(os.path.join(harness.folder, DATA_FILE), "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = harness.get(LOSSY_NS, hashes)
    assert got[0] == lossy(hashes[0]) and got[1] is None and got[2] is None
    assert store.shared.counters["disk_checksum_failures"] == 1
    assert store.lookup(LOSSY_NS.id, hashes).hits == 1
    assert store.check() == []


def test_a_promoted_block_goes_back_to_its_encoded_copy_and_is_never_encoded_twice(tmp_path):
    """A block promoted from disk is the codec's image of its encoded copy. A full disk drops that copy only
    once it can evict no block (an exact copy would go first), so the block goes back to it without a
    write, and reads back as its first image: encoding the image again would not give the same bytes
    (rotated groups), and the error would grow with every round trip."""
    h = Harness(tmp_path / "disk", disk_pages=12)  # 12 encoded blocks
    try:
        store, disk, ns_id = h.store, h.store.disk, LOSSY_NS.id
        a, *fill = [chain_hashes(400 + i, 1)[0] for i in range(1 + 11 + h.host_blocks)]
        for x in [a, *fill]:
            h.put(LOSSY_NS, [x])
        disk.flush()
        assert list(store.lookup(ns_id, [a]).tiers) == ["disk"] and disk.free_bytes == 0
        (pinned,) = asyncio.run(store.prepare_read(store.pin(ns_id, [a], "r"), "r"))  # promoted, held in host
        assert pinned.tier == "host" and pinned.copies["disk"].codec is not None
        more = [chain_hashes(500 + i, 1)[0] for i in range(3 * h.host_blocks)]
        for x in more:  # every demotion into the full disk needs room
            h.put(LOSSY_NS, [x])
        store.release(ns_id, [a], "r")
        store.placement.demote(store.index.entries[block_key(ns_id, a)])  # (the host's policy keeps a block it saw hit)
        disk.flush()
        assert list(store.lookup(ns_id, [a]).tiers) == ["disk"]
        counters = store.shared.counters
        assert counters["disk_writes_saved"] == 1 and counters["disk_encoded_copies_dropped"] == 0
        assert h.get(LOSSY_NS, [a]) == [lossy(a)]
        image = np.frombuffer(lossy(a), np.uint8)
        assert decode(encode(image, LAYOUT, Budget.uniform(LAYOUT, 4, 2)), LAYOUT).tobytes() != lossy(a)
        assert store.stats()["tiers"]["disk"]["encoded_copies"] == 1  # `a` in host again, its copy kept
        assert store.check() == []
    finally:
        h.close()


def test_a_full_disk_drops_an_encoded_copy_once_it_can_evict_no_block(tmp_path):
    """Every block on disk pinned by a reader: a demotion into the full disk takes the page of a promoted
    block's encoded copy (counted), and that block, demoted again, is encoded anew from its image."""
    h = Harness(tmp_path / "disk", disk_pages=4)
    try:
        store, disk, ns_id = h.store, h.store.disk, LOSSY_NS.id
        a, *fill = [chain_hashes(700 + i, 1)[0] for i in range(1 + 3 + h.host_blocks)]
        for x in [a, *fill]:
            h.put(LOSSY_NS, [x])
        disk.flush()
        asyncio.run(store.prepare_read(store.pin(ns_id, [a], "r"), "r"))
        on_disk = [x for x in fill if list(store.lookup(ns_id, [x]).tiers) == ["disk"]]
        assert disk.free_bytes == 0 and len(on_disk) == 3
        store.pin(ns_id, on_disk, "r")
        h.put(LOSSY_NS, [chain_hashes(800, 1)[0]])  # a host victim goes down: only `a`'s copy can make room
        assert store.shared.counters["disk_encoded_copies_dropped"] == 1
        assert store.index.entries[block_key(ns_id, a)].copies is None
        store.release(ns_id, [a, *on_disk], "r")
        store.placement.demote(store.index.entries[block_key(ns_id, a)])
        disk.flush()
        assert store.shared.counters["disk_writes_saved"] == 0
        image = decode(encode(np.frombuffer(lossy(a), np.uint8), LAYOUT, Budget.uniform(LAYOUT, 4, 2)), LAYOUT)
        assert h.get(LOSSY_NS, [a]) == [image.tobytes()]
        assert store.check() == []
    finally:
        h.close()


def demote_while_busy(h: Harness, n: int, salt: int = 200) -> list[bytes]:
    """Demote n one-block chains while the encoders' threads are held busy; checks that the blocks stored
    exact are durable before the encoders are let go. The n hashes now on disk."""
    store, gate = h.store, threading.Event()
    held = [store.disk.writer.encoders.submit(gate.wait, 30) for _ in range(ENCODE_THREADS)]
    roots = [chain_hashes(salt + i, 1)[0] for i in range(n + h.host_blocks)]
    for x in roots:
        h.put(LOSSY_NS, [x])
    exact = [e.location for e in store.index.entries.values()
             if key_ns(e.key) == LOSSY_NS.id and e.tier == "disk" and codec_of(e.location) is None]
    assert len(exact) == (n - ENCODE_BACKLOG if h.exact_when_busy else 0)
    assert store.disk.writer.wait_for(lambda: all(store.disk.read_blocks(slot) for slot in exact), 30)
    gate.set()
    assert all(f.result() for f in held)
    store.disk.flush()
    on_disk = [x for x, t in zip(roots, store.lookup(LOSSY_NS.id, roots).tiers) if t == "disk"]
    assert len(on_disk) == n
    return on_disk


def codecs_of(store: TieredStore, hashes) -> list[str | None]:
    return [codec_of(store.index.entries[block_key(LOSSY_NS.id, x)].location) for x in hashes]


@pytest.mark.parametrize("exact_when_busy", [True, False])
def test_a_demotion_while_the_encoders_are_behind_is_stored_exact_unless_told_to_wait(tmp_path, exact_when_busy):
    """The encoders' threads are held busy while blocks are demoted: the first ENCODE_BACKLOG blocks queue
    for them, the later ones are stored exact (counted), and are durable before the encoders are let go;
    with `exact_when_busy` off every one waits and is encoded. Each block reads back as what its record
    says it is."""
    h = Harness(tmp_path / "disk", exact_when_busy=exact_when_busy)
    try:
        store, n = h.store, ENCODE_BACKLOG + 3
        on_disk = demote_while_busy(h, n)
        codecs = codecs_of(store, on_disk)
        encoded = n - codecs.count(None)
        assert encoded == (ENCODE_BACKLOG if exact_when_busy else n)
        assert store.shared.counters["disk_stored_exact_busy"] == n - encoded
        (row,) = store.disk.stats()["compressed"].values()
        assert row["blocks"] == encoded
        assert [h.get(LOSSY_NS, [x])[0] for x in on_disk] == [payload(x) if c is None else lossy(x)
                                                              for x, c in zip(on_disk, codecs)]
        assert store.check() == []
    finally:
        h.close()


def test_blocks_stored_exact_while_busy_are_encoded_once_the_disk_is_idle(tmp_path):
    """The compactor encodes them in place: every block on disk ends up encoded, the exact pages go back,
    each reads back as the codec's image, and a restart finds the encoded records (`check()`: no page
    leaked, every record on its block's pages)."""
    h = Harness(tmp_path / "disk", exact_when_busy=True)
    try:
        store, n = h.store, ENCODE_BACKLOG + 3
        on_disk = demote_while_busy(h, n, salt=300)
        stored = -(-encoded_bytes(LAYOUT, Budget.uniform(LAYOUT, 4, 2)) // PAGE) * PAGE
        assert store.disk.used_bytes == ENCODE_BACKLOG * stored + 3 * BLOCK
        assert store.stats()["compaction"] == {"waiting_blocks": 3, "in_flight_blocks": 0, "compacted_blocks": 0}
        asyncio.run(store.compactor.run_until_idle())
        assert store.stats()["compaction"] == {"waiting_blocks": 0, "in_flight_blocks": 0, "compacted_blocks": 3}
        assert codecs_of(store, on_disk) == [codecs_of(store, on_disk)[0]] * n and None not in codecs_of(store, on_disk)
        assert store.shared.counters["disk_compacted"] == 3
        assert store.disk.used_bytes == n * stored
        (row,) = store.disk.stats()["compressed"].values()
        assert row["blocks"] == n
        assert store.check() == []
        h.close()
        h.open()  # the records read back from the index: the encoded ones, on their own pages
        store = h.store
        store.wait_recovered()
        assert list(store.lookup(LOSSY_NS.id, on_disk).tiers) == ["disk"] * n
        slots = [store.index.entries[block_key(LOSSY_NS.id, x)].location for x in on_disk]
        assert all(sum(k for _, k in slot.extents) == encoded_bytes(LAYOUT, Budget.uniform(LAYOUT, 4, 2))
                   for slot in slots) and None not in codecs_of(store, on_disk)
        assert [h.get(LOSSY_NS, [x])[0] for x in on_disk] == [lossy(x) for x in on_disk]
        assert store.check() == []
    finally:
        h.close()


def test_compaction_makes_room_in_a_full_disk_tier(tmp_path):
    """A disk tier is full in its steady state: the compactor evicts for an encoded copy's page as a
    demotion would, and every opted-in block left on disk ends up encoded."""
    h = Harness(tmp_path / "disk", exact_when_busy=True)
    try:
        store, n = h.store, ENCODE_BACKLOG + 3
        for salt in range(700, 800):  # exact blocks of another namespace, until the disk is nearly full
            if store.disk.free_bytes < BLOCK:
                break
            h.put(EXACT_NS, chain_hashes(salt, 2))
        on_disk = demote_while_busy(h, n, salt=600)  # (the newest: the disk evicts the exact namespace's)
        rest = store.disk.allocate(store.disk.free_bytes) if store.disk.free_bytes else None  # now it is full
        evictions = store.stats()["tiers"]["disk"]["evictions"]
        asyncio.run(store.compactor.run_until_idle())
        if rest is not None:
            store.disk.release(rest, None)
        assert store.shared.counters["disk_compacted"] == 3
        assert store.stats()["tiers"]["disk"]["evictions"] > evictions
        left = [x for x in on_disk if block_key(LOSSY_NS.id, x) in store.index.entries]
        assert len(left) == n and None not in codecs_of(store, left)
        assert store.check() == []
    finally:
        h.close()


def test_a_restart_hands_the_blocks_left_exact_to_the_compactor(tmp_path):
    """Stopped before its compaction: the next start's recovery finds the exact records of the opted-in
    namespace and compacts them; an exact namespace's blocks stay exact."""
    h = Harness(tmp_path / "disk", exact_when_busy=True)
    try:
        n = ENCODE_BACKLOG + 3
        on_disk = demote_while_busy(h, n, salt=500)
        h.spill(EXACT_NS, chain_hashes(501, 2))
        h.close()
        h.open()
        store = h.store
        store.wait_recovered()
        assert None in codecs_of(store, on_disk) and len(store.compactor.waiting) >= 3
        asyncio.run(store.compactor.run_until_idle())
        assert None not in codecs_of(store, on_disk)
        exact = [store.index.entries[block_key(EXACT_NS.id, x)] for x in chain_hashes(501, 2)]
        assert all(codec_of(e.location) is None for e in exact)
        assert store.check() == []
    finally:
        h.close()


def one_block_left_exact(h: Harness, salt: int) -> bytes:
    """Demote ENCODE_BACKLOG + 1 blocks while the encoders are busy: the hash of the one stored exact."""
    on_disk = demote_while_busy(h, ENCODE_BACKLOG + 1, salt=salt)
    (x,) = [x for x, c in zip(on_disk, codecs_of(h.store, on_disk)) if c is None]
    return x


async def written(compactor, key, task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Wait until `key`'s compaction is writing its encoded copy; a failure, not a hang, when the compaction
    ended first (it skipped the block) or never got there."""
    for _ in range(int(timeout_s / 0.001)):
        if key in compactor.in_flight:
            return
        assert not task.done(), f"the compaction ended before its write: {task.result()}, {compactor.stats()}"
        await asyncio.sleep(0.001)
    raise AssertionError(f"the compaction did not reach its write in {timeout_s} s")


def test_a_block_removed_while_its_compaction_is_written_leaves_nothing_behind(tmp_path):
    """The block goes while its encoded copy is being written: the new pages are freed, its record is
    gone once the writes land, and `check()` is clean before and after."""
    h = Harness(tmp_path / "disk", exact_when_busy=True)
    try:
        store, compactor = h.store, h.store.compactor
        x = one_block_left_exact(h, salt=400)
        key = block_key(LOSSY_NS.id, x)

        async def race() -> bool:
            task = asyncio.create_task(compactor.compact(key))
            await asyncio.sleep(0)  # it allocated the encoded copy's pages and reads the block in a thread
            assert compactor.held_pages() and store.check() == []  # (the new pages are counted, not leaked)
            await written(compactor, key, task)
            assert store.check() == []  # (it flushes: the new record is written, the block still exact)
            assert store.remove(LOSSY_NS.id, [x]) == 1
            return await task

        used = store.disk.used_bytes
        assert not asyncio.run(race())
        assert not compactor.in_flight and store.shared.counters["disk_compacted"] == 0
        assert store.disk.used_bytes == used - BLOCK
        store.disk.flush()
        assert record_key(key) not in store.disk.index_records()
        assert store.check() == []
    finally:
        h.close()


def test_a_block_promoted_while_its_compaction_is_written_keeps_the_encoded_copy(tmp_path):
    """The block is promoted (read from its exact pages) while its encoded copy is being written: the copy
    it left on disk becomes the encoded one, listed with the encoded copies, and the block goes back to it
    when demoted (no write) and reads back as the codec's image."""
    h = Harness(tmp_path / "disk", exact_when_busy=True)
    try:
        store, compactor = h.store, h.store.compactor
        x = one_block_left_exact(h, salt=450)
        key = block_key(LOSSY_NS.id, x)

        async def race() -> bool:
            task = asyncio.create_task(compactor.compact(key))
            await written(compactor, key, task)
            (e,) = await store.prepare_read(store.pin(LOSSY_NS.id, [x], "r"), "r")
            # The copy it left is the exact one until the compaction's swap, which may already have run
            # while the promotion awaited its last steps (the block had left the old pages by then).
            assert e.tier == "host" and (codec_of(e.copies["disk"]) is None or key not in compactor.in_flight)
            assert bytes(store.host.read(e.location)) == payload(x)  # read from the exact pages
            store.release(LOSSY_NS.id, [x], "r")
            return await task

        assert asyncio.run(race())
        e = store.index.entries[key]
        assert e.tier == "host" and e.copies["disk"].codec is not None
        assert list(store.index.encoded_copies["disk"]) == [key] and key not in store.index.copies["disk"]
        assert store.check() == []
        store.placement.demote(e)
        assert store.shared.counters["disk_writes_saved"] == 1
        store.disk.flush()
        assert h.get(LOSSY_NS, [x]) == [lossy(x)]
        assert store.check() == []
    finally:
        h.close()


def test_a_decoder_that_refuses_makes_a_miss():
    """The codec's own checksum: a blob that the tier's checksum passed but that does not decode."""
    blob = encode(np.frombuffer(payload(b"x" * 16), np.uint8), LAYOUT, Budget.uniform(LAYOUT, 4, 2))
    out = np.zeros(BLOCK, np.uint8)
    assert decode_into(blob, [out[:PAGE], out[PAGE:]]) and out.tobytes() == lossy(b"x" * 16)
    bad = blob.copy()
    bad[-1] ^= 1
    out[:] = 7
    assert not decode_into(bad, [out]) and (out == 7).all()
    assert not decode_into(blob, [out[:100]])


def test_compressed_blocks_survive_a_restart(harness):
    hashes = chain_hashes(5, 3)
    harness.spill(LOSSY_NS, hashes)
    harness.close()
    harness.open()
    store = harness.store
    assert store.lookup(LOSSY_NS.id, hashes).tiers == ("disk",) * 3
    assert sum(r["blocks"] for r in store.disk.stats()["compressed"].values()) >= 3
    assert harness.get(LOSSY_NS, hashes) == [lossy(h) for h in hashes]
    assert store.check() == []


def test_without_a_decoder_encoded_records_are_dropped_at_open(tmp_path):
    h = Harness(tmp_path / "disk")
    hashes = chain_hashes(6, 2)
    h.spill(LOSSY_NS, hashes)
    h.close()
    h2 = Harness(tmp_path / "disk", decoder=None)
    try:
        assert h2.store.lookup(LOSSY_NS.id, hashes).hits == 0
        assert h2.store.disk.counters.dropped_records >= 2
        assert h2.store.check() == []
    finally:
        h2.close()


def test_an_unknown_or_misfit_profile_is_refused_at_registration(harness, tmp_path):
    with pytest.raises(NamespaceError, match="no built-in profile"):
        harness.store.register_namespace(dataclasses.replace(EXACT_NS, codec="nosuch"))
    with pytest.raises(NamespaceError, match="cannot read layout"):
        harness.store.register_namespace(dataclasses.replace(EXACT_NS, codec="k4v2", layout="cuda/BLHNC/mla"))
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "wide.json").write_text(json.dumps({"format": "kvstore-codec-profile/1", "name": "wide",
                                                  "bits": [[[4, 4]] * 3] * 2}))
    h = Harness(tmp_path / "disk2", profile_dir=str(folder))
    try:
        with pytest.raises(NamespaceError, match="is for"):
            h.store.register_namespace(dataclasses.replace(EXACT_NS, codec="wide"))
    finally:
        h.close()
    off = Harness(tmp_path / "disk3", compress=False)
    try:
        assert off.store.register_namespace(dataclasses.replace(EXACT_NS, codec="nosuch"))
    finally:
        off.close()


def test_a_profile_file_with_sink_blocks_keeps_the_first_block_exact(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    bits = [[[8, 4], [4, 2]], [[3, 2], [4, 3]]]
    (folder / "mixed.json").write_text(json.dumps({"format": "kvstore-codec-profile/1", "name": "mixed",
                                                   "bits": bits, "sink_blocks": 1}))
    h = Harness(tmp_path / "disk", profile_dir=str(folder))
    ns = dataclasses.replace(EXACT_NS, codec="mixed")
    try:
        hashes = chain_hashes(7, 3)
        h.spill(ns, hashes)
        h.store.disk.flush()
        got = h.get(ns, hashes)
        budget = Budget(np.array(bits))
        assert got[0] == payload(hashes[0])  # the sink block: exact
        for x, g in zip(hashes[1:], got[1:]):
            assert g == decode(encode(np.frombuffer(payload(x), np.uint8), LAYOUT, budget), LAYOUT).tobytes()
        assert h.store.check() == []
    finally:
        h.close()

