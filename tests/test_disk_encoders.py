"""The disk tier's encoders and writer (tiers/disk_writer.py) with a real codec, files and LMDB: a block that
fails to encode fails alone, blocks the encoders finish one by one share a sync, and the rule that stores
a demotion exact only where encoding it would hold the writer up (tiers/disk.py `encoders_behind`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.compression import Compression, decode_into
from kvstore.config import CompressionConfig
from kvstore.keys import block_key
from kvstore.tiers.base import ENCODE_THREADS, BlockMeta
from kvstore.tiers.disk import ENCODE_BACKLOG, DiskTier
from tests.helpers import chain_hashes
from tests.test_compression_store import BLOCK, LOSSY_NS, PAGE, payload


class FailingCodec:
    """A stored codec whose encoding raises for one block."""

    def __init__(self, codec, bad: bytes) -> None:
        self.codec, self.bad = codec, bad
        self.tag, self.stored_bytes = codec.tag, codec.stored_bytes

    def encode(self, data: np.ndarray) -> np.ndarray:
        if data.tobytes() == self.bad:
            raise ValueError("this block cannot be encoded")
        return self.codec.encode(data)


def test_a_block_that_fails_to_encode_fails_alone(tmp_path):
    """The disk tier encodes blocks on several threads at once: one whose encoding raises is a failed write
    (reported, never recorded), and the others queued with it are stored and read back decoded."""
    codec = Compression(CompressionConfig(disk=True)).for_block(LOSSY_NS, 1, "disk")
    hashes = chain_hashes(7, 6)
    failing = FailingCodec(codec, payload(hashes[2]))
    disk = DiskTier(str(tmp_path / "disk"), 256 * PAGE, page_bytes=PAGE, staging_bytes=16 * BLOCK, decoder=decode_into)
    try:
        disk.scanned(wait=True)  # a new tier: nothing to read, then its pages are free
        slots = {}
        for i, h in enumerate(hashes):
            meta = BlockMeta(block_key(LOSSY_NS.id, h), hashes[i - 1] if i else None, i, None, 0.0)
            data = np.frombuffer(payload(h), np.uint8)
            slots[h] = disk.write_from(disk.allocate(codec.stored_bytes), [data], meta, failing if i == 2 else codec)
        disk.flush()
        assert disk.failed_writes() == [block_key(LOSSY_NS.id, hashes[2])]
        assert disk.writer.counters.write_errors == 1 and disk.writer.counters.writes == 5
        for h in hashes[:2] + hashes[3:]:
            want, got = np.empty(BLOCK, np.uint8), np.empty(BLOCK, np.uint8)
            assert decode_into(codec.encode(np.frombuffer(payload(h), np.uint8)), [want])
            assert disk.read_into(slots[h], [got]) and np.array_equal(got, want)
    finally:
        disk.close()


class GatedCodec:
    """A stored codec whose encoding of block i waits for `gates[i]` (blocks told apart by their bytes)."""

    def __init__(self, codec, blocks: list[bytes]) -> None:
        self.codec, self.blocks = codec, blocks
        self.gates = [threading.Event() for _ in blocks]
        self.tag, self.stored_bytes = codec.tag, codec.stored_bytes

    def encode(self, data: np.ndarray) -> np.ndarray:
        assert self.gates[self.blocks.index(data.tobytes())].wait(30)
        return self.codec.encode(data)


def test_blocks_encoded_one_after_another_share_a_sync(tmp_path):
    """The encoders finish a burst's blocks one at a time (here: each lets the next go once the writer has
    written it): the writer writes each as it is ready, and one fdatasync and one commit cover the blocks
    of its batch (before, each was a batch of its own, with its sync). Every block reads back decoded."""
    codec = Compression(CompressionConfig(disk=True)).for_block(LOSSY_NS, 1, "disk")
    hashes = chain_hashes(8, 12)
    gated = GatedCodec(codec, [payload(h) for h in hashes])
    disk = DiskTier(str(tmp_path / "disk"), 256 * PAGE, page_bytes=PAGE, staging_bytes=16 * BLOCK, decoder=decode_into)
    try:
        disk.scanned(wait=True)
        disk.writer.sync_every_s = 30.0  # (the default bounds how long a written block waits for its sync: 50 ms)
        slots = {}
        for i, h in enumerate(hashes):
            meta = BlockMeta(block_key(LOSSY_NS.id, h), hashes[i - 1] if i else None, i, None, 0.0)
            slots[h] = disk.write_from(disk.allocate(codec.stored_bytes), [np.frombuffer(payload(h), np.uint8)],
                                       meta, gated)
        counters = disk.writer.counters
        for i, gate in enumerate(gated.gates):
            gate.set()
            deadline = time.monotonic() + 30
            while counters.writes <= i:  # (the writer counts a write without a notification: polled)
                assert time.monotonic() < deadline, f"block {i} was never written"
                time.sleep(0.001)
        disk.flush()
        assert disk.failed_writes() == []
        assert counters.writes == len(hashes) and counters.write_errors == 0
        assert counters.fsyncs <= 3, f"{counters.fsyncs} syncs for {len(hashes)} blocks"
        for h in hashes:
            want, got = np.empty(BLOCK, np.uint8), np.empty(BLOCK, np.uint8)
            assert decode_into(codec.encode(np.frombuffer(payload(h), np.uint8)), [want])
            assert disk.read_into(slots[h], [got]) and np.array_equal(got, want)
    finally:
        disk.close()


def test_a_disk_slower_than_the_encoders_gets_encoded_blocks_while_they_are_busy(tmp_path):
    """`encoders_behind`: not while an encoder thread is free; with every thread busy, before the writer has
    measured anything, yes (a block would wait); once it has measured the encoders and the disk, only
    where the encoders would finish the block later than the writer, with the exact bytes queued ahead of
    it, would reach it. The writer measures both as it writes, and counts the exact bytes ahead back to 0."""
    codec = Compression(CompressionConfig(disk=True)).for_block(LOSSY_NS, 1, "disk")
    hashes = chain_hashes(9, ENCODE_BACKLOG + 2)
    disk = DiskTier(str(tmp_path / "disk"), 256 * PAGE, page_bytes=PAGE, staging_bytes=16 * BLOCK, decoder=decode_into)
    writer = disk.writer
    try:
        disk.scanned(wait=True)

        def write(i: int, encoded: bool) -> None:
            meta = BlockMeta(block_key(LOSSY_NS.id, hashes[i]), None, 0, None, 0.0)
            disk.write_from(disk.allocate(codec.stored_bytes if encoded else BLOCK),
                            [np.frombuffer(payload(hashes[i]), np.uint8)], meta, codec if encoded else None)

        assert not disk.encoders_behind(BLOCK)
        gate = threading.Event()
        held = [writer.encoders.submit(gate.wait, 30) for _ in range(ENCODE_THREADS)]
        for i in range(ENCODE_BACKLOG):
            write(i, True)  # (they wait for the encoders)
        assert writer.encode_backlog == ENCODE_BACKLOG and writer.encode_backlog_bytes == ENCODE_BACKLOG * BLOCK
        assert writer.encode_s_per_byte is None and disk.encoders_behind(BLOCK)
        # As if measured: an encoder thread takes 4 ns a byte, the disk 2 ns. The encoders would finish a
        # block demoted now after 3 blocks' encodes on ENCODE_THREADS threads; the writer reaches it then
        # with 6 / ENCODE_THREADS blocks of exact bytes ahead of it.
        writer.encode_s_per_byte, writer.write_s_per_byte = 4e-9, 2e-9
        even = 6 * BLOCK // ENCODE_THREADS
        writer.exact_bytes_ahead = even - BLOCK // 2
        assert disk.encoders_behind(BLOCK)
        writer.exact_bytes_ahead = even + BLOCK // 2
        assert not disk.encoders_behind(BLOCK)
        writer.exact_bytes_ahead = 0
        gate.set()
        assert all(f.result() for f in held)
        write(ENCODE_BACKLOG, False)
        write(ENCODE_BACKLOG + 1, True)
        disk.flush()
        assert disk.failed_writes() == [] and writer.counters.writes == ENCODE_BACKLOG + 2
        assert writer.exact_bytes_ahead == 0 and writer.encode_backlog == 0
        assert writer.encode_s_per_byte != 4e-9 and writer.write_s_per_byte != 2e-9  # measured anew
    finally:
        disk.close()
