"""The disk tier's two forms of a block's location (tiers/disk_slot.py): a small exact block is a plain
int from the moment it is staged, its pending write kept apart by the tier; any other block a `DiskSlot`.
Real files, O_DIRECT, LMDB; payloads derived from the hash, so every byte served is checked."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from kvstore.keys import key_hash
from kvstore.store import TieredStore
from kvstore.tiers.disk import HASHED_HERE_BYTES, DiskTier
from kvstore.tiers.disk_slot import DiskSlot, checksum_of, codec_of, extents_of, settled
from kvstore.tiers.host import HostArena
from tests.helpers import chain_hashes, namespace, payload_bytes

BLOCK = 4096
NS = namespace("slots", BLOCK)


class Store:
    """A host tier of 4 blocks over a disk tier of 64, in `folder`; reopenable."""

    def __init__(self, folder) -> None:
        self.folder, self.arena = str(folder), f"/dev/shm/kvstore-test-{uuid.uuid4().hex}"
        self.open()

    def open(self) -> None:
        host = HostArena(self.arena, 4 * BLOCK, BLOCK, persistent=False)
        self.store = TieredStore([host, DiskTier(self.folder, 64 * BLOCK, page_bytes=BLOCK)])
        self.store.register_namespace(NS)
        self.disk = self.store.disk

    def close(self) -> None:
        self.store.close()
        self.store.host.close()

    def put(self, roots: list[bytes]) -> None:
        for h in roots:  # one root a reserve: the host tier demotes the oldest to disk
            (e,) = self.store.reserve(NS.id, [(h, None)], "w")
            self.store.host.write(e.location, payload_bytes(h, BLOCK))
            self.store.commit(NS.id, [h], "w")

    def get(self, roots: list[bytes]) -> list[bytes | None]:
        """Acquire (promoting), copy out, release, as a client would; at most 4 blocks (the host tier)."""
        if len(roots) > 2:
            return [x for i in range(0, len(roots), 2) for x in self.get(roots[i:i + 2])]
        store = self.store
        entries = asyncio.run(store.prepare_read(store.pin(NS.id, roots, "r", prefix=False), "r"))
        out = [store.host.read(e.location) if e is not None else None for e in entries]
        store.release(NS.id, [key_hash(e.key) for e in entries if e is not None], "r")
        return out

    def on_disk(self) -> dict:
        return {key_hash(e.key): e.location for e in self.store.iter_entries() if e.tier == "disk"}


@pytest.fixture
def slots(tmp_path):
    s = Store(tmp_path / "disk")
    yield s
    s.close()


def roots(n: int, salt: int = 0) -> list[bytes]:
    return [chain_hashes(salt + i, 1)[0] for i in range(n)]


def test_the_int_form_holds_what_a_slot_holds():
    where = settled([[7 * 4096, 4000]], 0xFEDC_BA98_7654_3210)
    assert type(where) is int and where.bit_length() <= 128
    assert extents_of(where) == [[7 * 4096, 4000]] and checksum_of(where) == 0xFEDC_BA98_7654_3210
    assert codec_of(where) is None and codec_of([[0, 1]], 1) == 1  # (another tier's location: the default)
    # not representable: several extents, a checksum not known yet or not 64 bits
    assert settled([[0, 4096], [8192, 4096]], 1) is None
    assert settled([[0, 4096]], None) is None and settled([[0, 4096]], 1 << 64) is None
    # a recovered exact block in one extent takes the int form; an encoded one stays a slot
    assert type(DiskSlot.recovered([[4096, 4096]], 5, None, 4096)) is int
    encoded = DiskSlot.recovered([[4096, 1000]], 5, "q4", 4096)
    assert isinstance(encoded, DiskSlot) and codec_of(encoded) == "q4" and extents_of(encoded) == [[4096, 1000]]


def test_a_slot_keeps_the_int_form_once_its_checksum_is_known():
    """A slot packs its extent and checksum the way a plain-int location does, once they pack: one format."""
    slot = DiskSlot([[3 * 4096, 1000]], None, codec="q4", logical=4096)  # its write pending
    assert slot.checksum is None and slot.extents == [[3 * 4096, 1000]] and slot._where == [[[3 * 4096, 1000]], None]
    slot.checksum = 0xABCD
    assert slot._where == settled([[3 * 4096, 1000]], 0xABCD)
    assert slot.extents == [[3 * 4096, 1000]] and slot.checksum == 0xABCD == checksum_of(slot)
    slot.checksum = None  # (back to pending: nothing the tier does, but the setter takes it)
    assert slot.checksum is None and slot.extents == [[3 * 4096, 1000]]
    several = DiskSlot([[0, 4096], [8192, 4096]], 7)
    assert several.extents == [[0, 4096], [8192, 4096]] and several.checksum == 7 and codec_of(several) is None


def test_a_small_block_is_an_int_served_from_staging_until_written_then_from_disk(slots):
    """While the writer is held, the demoted blocks are ints whose writes the tier keeps; they are
    served from their staging buffers. Once written, the tier keeps nothing of them but the int, and
    they read back from the file, and again after a restart."""
    assert BLOCK <= HASHED_HERE_BYTES
    gate, real = threading.Event(), slots.disk.writer._pwrite_all

    def held(views, offset):
        gate.wait(30)
        real(views, offset)

    slots.disk.writer._pwrite_all = held
    blocks = roots(10)
    slots.put(blocks)
    on_disk = slots.on_disk()
    assert len(on_disk) == 6 and all(type(loc) is int for loc in on_disk.values())
    assert len(slots.disk._jobs) == 6 and not any(slots.disk.read_blocks(loc) for loc in on_disk.values())
    first = blocks[:2]  # promoted from their staging buffers (not written yet)
    assert slots.get(first) == [payload_bytes(h, BLOCK) for h in first]
    gate.set()
    slots.store.flush()
    slots.disk.reap()
    assert slots.disk._jobs == {}
    records = slots.disk.index_records()
    on_disk = slots.on_disk()
    assert len(on_disk) >= 4 and all(type(loc) is int and slots.disk.durable(loc) for loc in on_disk.values())
    assert {checksum_of(loc) for loc in on_disk.values()} <= {r["x"] for r in records.values()}
    held_keys = sorted(on_disk)
    assert slots.get(held_keys) == [payload_bytes(h, BLOCK) for h in held_keys]
    assert slots.store.check() == []
    slots.close()
    slots.open()
    slots.store.wait_recovered()
    assert slots.get(blocks) == [payload_bytes(h, BLOCK) for h in blocks]
    assert slots.store.check() == []


def test_a_small_blocks_failed_write_is_a_miss_and_its_pages_serve_the_next_block(slots):
    disk = slots.disk
    real = disk.writer._pwrite_all

    def broken(views, offset):
        raise OSError(5, "Input/output error")

    disk.writer._pwrite_all = broken
    lost = roots(8)
    slots.put(lost)  # the first four demoted, their writes failing
    slots.store.flush()
    assert slots.store.shared.counters["disk_write_failures"] == 4
    assert slots.on_disk() == {} and disk._jobs == {}  # dropped, and the tier keeps nothing of them
    assert disk.used_bytes == 0  # their pages free
    assert slots.get(lost[:4]) == [None] * 4
    disk.writer._pwrite_all = real
    fresh = roots(4, salt=100)
    slots.put(fresh)  # the other four of `lost` demoted
    slots.store.flush()
    assert sorted(slots.on_disk()) == sorted(lost[4:])
    assert slots.get(lost[4:]) == [payload_bytes(h, BLOCK) for h in lost[4:]]
    assert slots.store.check() == []


def test_a_block_past_the_bound_keeps_a_slot(tmp_path):
    """A block larger than HASHED_HERE_BYTES is hashed by the writer, off the event loop: a DiskSlot."""
    big = 2 * HASHED_HERE_BYTES
    ns = namespace("slots-big", big)
    host = HostArena(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}", 2 * big, big, persistent=False)
    store = TieredStore([host, DiskTier(str(tmp_path / "disk"), 8 * big, page_bytes=4096)])
    try:
        store.register_namespace(ns)
        hashes = roots(4)
        for h in hashes:
            (e,) = store.reserve(ns.id, [(h, None)], "w")
            store.host.write(e.location, payload_bytes(h, big))
            store.commit(ns.id, [h], "w")
        store.flush()
        on_disk = [e.location for e in store.iter_entries() if e.tier == "disk"]
        assert len(on_disk) == 2 and all(isinstance(loc, DiskSlot) for loc in on_disk)
        entries = asyncio.run(store.prepare_read(store.pin(ns.id, hashes[:2], "r", prefix=False), "r"))
        assert [store.host.read(e.location) for e in entries] == [payload_bytes(h, big) for h in hashes[:2]]
        assert store.check() == []
    finally:
        store.close()
        host.close()
