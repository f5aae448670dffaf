"""The disk tier moves blocks on adjacent pages together: the writer's vectored writes, the promotion's
vectored reads (`runs`, `read_many`), and what fails when one of them fails. Real files, O_DIRECT, LMDB."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvstore.keys import block_key, key_hash
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.disk import DATA_FILE, DiskTier
from kvstore.tiers.disk_slot import extents_of
from kvstore.tiers.pages import adjacent_groups
from tests.helpers import chain_hashes, payload_bytes
from tests.test_disk import BLOCK, NS, harness  # noqa: F401  (harness: the fixture)


def test_adjacent_groups_join_blocks_that_follow_one_another_on_disk():
    """In file order; a block in several extents, or one kept apart (an encoded block), is alone, and a group
    stops at the byte limit."""
    page = 4096
    blocks = [[[2 * page, page]], [[0, page]], [[page, page]], [[3 * page, page]], [[4 * page, page]],
              [[6 * page, page], [9 * page, page]], [[8 * page, page]]]
    assert adjacent_groups(blocks, 1 << 20) == [[1, 2, 0, 3, 4], [5], [6]]
    assert adjacent_groups(blocks, 1 << 20, [False, False, False, True, False, False, False]) == \
        [[1, 2, 0], [3], [4], [5], [6]]
    assert adjacent_groups(blocks, 2 * page) == [[1, 2], [0, 3], [4], [5], [6]]


def _stage_one_batch(disk: DiskTier, blocks: list[tuple[bytes, list]]) -> dict:
    """Stage every (hash, pages) block into the disk tier while its writer waits, so that one batch
    writes them all; their slots by hash."""
    slots = {}
    with disk.writer._cv:  # (the writer takes its next batch once this is released)
        for i, (h, extents) in enumerate(blocks):
            nbytes = sum(n for _, n in extents)
            meta = BlockMeta(block_key(NS.id, h), None, 0, None, 0.0)
            slots[h] = disk.write_from(extents, [np.frombuffer(payload_bytes(h, nbytes), np.uint8)], meta)
    return slots


def test_blocks_of_adjacent_pages_go_to_the_disk_in_one_write(tmp_path):
    """The writer writes a batch's exact blocks in file order, the blocks on adjacent pages with one
    pwritev whatever order they were queued in; a gap starts another write. Every block reads its own
    bytes back, and its record is found at the next open."""
    page = 4096
    disk = DiskTier(str(tmp_path / "disk"), 64 * page, page_bytes=page)
    try:
        disk.scanned(wait=True)
        # Three runs of pages: 0-9 (one-page blocks, queued in a shuffled order), 12-17 (two-page blocks),
        # 30 (alone). 11 pages in one-page blocks and 3 of two pages: 14 blocks in 3 writes.
        singles = [[[p * page, page]] for p in range(10)]
        doubles = [[[p * page, 2 * page]] for p in (12, 14, 16)]
        order = [3, 0, 9, 1, 8, 2, 7, 4, 6, 5]
        blocks = [(bytes([0x10 + i]) * 16, singles[i]) for i in order]
        blocks += [(bytes([0x40 + i]) * 16, ext) for i, ext in enumerate(doubles)]
        blocks += [(b"\x7f" * 16, [[30 * page, page]])]
        calls0, writes0 = disk.writer.counters.write_calls, disk.writer.counters.writes
        slots = _stage_one_batch(disk, blocks)
        disk.flush()
        assert disk.writer.counters.writes - writes0 == 14
        assert disk.writer.counters.write_calls - calls0 == 3
        for h, extents in blocks:
            nbytes = sum(n for _, n in extents)
            out = np.empty(nbytes, np.uint8)
            assert disk.read_blocks(slots[h])  # (settles the finished write, as the store does first)
            assert disk.read_into(slots[h], [out]) and out.tobytes() == payload_bytes(h, nbytes)
    finally:
        disk.close()
    disk = DiskTier(str(tmp_path / "disk"), 64 * page, page_bytes=page)
    try:
        kept = {key_hash(b.key): b.location for b in disk.scanned(wait=True)}
        assert {h: extents_of(slot) for h, slot in kept.items()} == {h: ext for h, ext in blocks}
        for h, extents in blocks:
            out = np.empty(extents[0][1], np.uint8)
            assert disk.read_into(kept[h], [out]) and out.tobytes() == payload_bytes(h, extents[0][1])
    finally:
        disk.close()


def test_a_failed_write_fails_the_blocks_it_carried_and_no_others(tmp_path, monkeypatch):
    """A pwritev that fails takes down the blocks of its run of pages, reported as failed writes and never
    recorded; the blocks of the batch's other runs are written and recorded."""
    page = 4096
    disk = DiskTier(str(tmp_path / "disk"), 64 * page, page_bytes=page)
    real = os.pwritev

    def failing_at_page_20(fd, buffers, offset):
        if offset == 20 * page:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    try:
        disk.scanned(wait=True)
        monkeypatch.setattr(os, "pwritev", failing_at_page_20)
        good = [(bytes([0x10 + p]) * 16, [[p * page, page]]) for p in range(4)]
        bad = [(bytes([0x20 + p]) * 16, [[p * page, page]]) for p in range(20, 23)]
        slots = _stage_one_batch(disk, bad + good)
        disk.flush()
        assert sorted(disk.failed_writes()) == sorted(block_key(NS.id, h) for h, _ in bad)
        assert disk.writer.counters.write_errors == 3 and disk.writer.counters.writes == 4
        assert len(disk.index_records()) == 4
        for h, extents in good:
            out = np.empty(page, np.uint8)
            assert disk.read_blocks(slots[h]) and disk.read_into(slots[h], [out])
            assert out.tobytes() == payload_bytes(h, page)
    finally:
        disk.close()


def test_a_chain_on_adjacent_pages_is_promoted_with_one_read(harness):
    """A chain demoted together sits on adjacent pages: its promotion reads it with one preadv, and every
    block is verified on its own (a disk hit serves each block's own bytes)."""
    store = harness.store
    chains = [chain_hashes(s, 4) for s in range(5)]
    for c in chains:
        harness.put(c)
    assert store.lookup(NS.id, chains[0]).tiers == ("disk",) * 4
    store.flush()
    calls = store.stats()["tiers"]["disk"]["read_calls"]
    assert harness.get(chains[0]) == [payload_bytes(x, BLOCK) for x in chains[0]]
    assert store.stats()["tiers"]["disk"]["read_calls"] - calls == 1
    assert store.stats()["tiers"]["disk"]["reads"] >= 4
    assert store.check() == []


def test_blocks_read_together_are_verified_and_fail_apart(tmp_path, monkeypatch):
    """`runs` groups blocks on adjacent pages (in file order, up to RUN_BYTES, an encoded or scattered block
    alone); `read_many` reads a group with one preadv and verifies each block: a corrupt block is False
    while its neighbours read True, and a failed read is None for the blocks of that read only."""
    from kvstore.tiers import disk as disk_module

    page = 4096
    disk = DiskTier(str(tmp_path / "disk"), 64 * page, page_bytes=page)
    try:
        disk.scanned(wait=True)
        blocks = [(bytes([0x10 + p]) * 16, [[p * page, page]]) for p in (5, 0, 2, 1, 4, 3, 7, 6)]
        blocks += [(bytes([0x20 + p]) * 16, [[p * page, page]]) for p in (20, 21)]
        slots = _stage_one_batch(disk, blocks)
        disk.flush()
        locations = [slots[h] for h, _ in blocks]
        assert all(disk.read_blocks(slot) for slot in locations)
        assert disk.runs(locations) == [[1, 3, 2, 5, 4, 0, 7, 6], [8, 9]]  # pages 0-7, then 20-21
        monkeypatch.setattr(disk_module, "RUN_BYTES", 3 * page)
        assert disk.runs(locations) == [[1, 3, 2], [5, 4, 0], [7, 6], [8, 9]]
        monkeypatch.undo()
        with open(os.path.join(tmp_path, "disk", DATA_FILE), "r+b") as f:  # page 2's block no longer verifies
            f.seek(2 * page)
            f.write(b"garbage!")
        real = os.preadv

        def failing_at_page_20(fd, buffers, offset):
            if offset == 20 * page:
                raise OSError(5, "Input/output error")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", failing_at_page_20)
        views = [np.frombuffer(mmap.mmap(-1, page), np.uint8) for _ in blocks]  # page-aligned: DMA'd into
        calls = disk.reader.counters.read_calls
        got = disk.read_many([(slot, [v]) for slot, v in zip(locations, views)])
        assert disk.reader.counters.read_calls - calls == 2
        assert got == [True, True, False, True, True, True, True, True, None, None]
        # Each block's own bytes where it verified (the corrupt one holds what the disk holds: garbage first)
        assert [v.tobytes() == payload_bytes(h, page) for (h, _), v in zip(blocks, views)][:8] == got[:8]
    finally:
        disk.close()


def test_a_block_read_into_more_pieces_than_one_call_takes_is_read_on_its_own(tmp_path):
    """Host pages can hand a block more pieces than a preadv takes (IOV_MAX): `read_many` reads such a block
    on its own, in several calls, and serves it whole."""
    page, pieces = 4096, 1200
    disk = DiskTier(str(tmp_path / "disk"), (pieces + 8) * page, page_bytes=page)
    try:
        disk.scanned(wait=True)
        h = b"\x55" * 16
        (slot,) = _stage_one_batch(disk, [(h, [[0, pieces * page]])]).values()
        disk.flush()
        assert disk.read_blocks(slot)
        whole = np.frombuffer(mmap.mmap(-1, pieces * page), np.uint8)
        assert disk.read_many([(slot, [whole[i * page : (i + 1) * page] for i in range(pieces)])]) == [True]
        assert whole.tobytes() == payload_bytes(h, pieces * page)
    finally:
        disk.close()
