"""A GPU reader's encoded disk hits expanded on the GPU (kvstore/gpu_decode.py): the stored bytes go to the
GPU tier encoded and the Triton kernel expands them there, byte-exact with the CPU decoder, the disk copy
kept, the host arena untouched. Run on the emulated GPU tier (shared memory) with the kernel in Triton's
interpreter; a damaged block is a miss, a GPU fault falls back to the CPU, `check()` after every scenario.
Real shared memory, real files with O_DIRECT, LMDB."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.codec import BlockLayout, Budget, decode, encode
from kvstore.compression import Compression
from kvstore.config import CompressionConfig
from kvstore.gpu_decode import GpuExpander, expander_for
from kvstore.keys import Namespace, block_key, key_hash
from kvstore.tiers.disk import DATA_FILE
from kvstore.tiers.gpu import GpuPool, GpuTier, cuda_available
from tests.helpers import chain_hashes, wait_for
from tests.test_compression_store import Harness as StoreHarness, payload

pytest.importorskip("triton", reason="the GPU decoder is a Triton kernel (the test extra installs it)")

PAGE = 4096
LAYOUT = BlockLayout(2, 2, 16, 64, "bfloat16", "HNC")  # what vLLM's CUDA backends' "LBHNC" is to the codec
EXACT_NS = Namespace("m", "bfloat16", 2, 2, 64, 16, LAYOUT.block_bytes, layout="cuda/LBHNC")
LOSSY_NS = dataclasses.replace(EXACT_NS, codec="k4v2")
BLOCK = LAYOUT.block_bytes  # 16 KiB: a layer's slice is 8 KiB
CUDA_OK, CUDA_REASON = cuda_available()


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    """The kernel in Triton's interpreter (it reads and writes host memory: the emulated tier)."""
    import kvstore.codec_triton as mod

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(mod)
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(mod)


def lossy(h: bytes) -> bytes:
    """What the CPU decoder gives back of the block stored at k4v2."""
    return decode(encode(np.frombuffer(payload(h), np.uint8), LAYOUT, Budget.uniform(LAYOUT, 4, 2)), LAYOUT).tobytes()


class Harness(StoreHarness):
    """tests/test_compression_store.py's store (a host arena of 4 blocks over a disk tier that compresses,
    every opted-in demotion encoded) with an emulated GPU tier of 8 blocks above it."""

    def __init__(self, folder, gpu_decode=True, profile_dir=""):
        self.gpu_decode = gpu_decode
        super().__init__(folder, profile_dir=profile_dir)

    def tiers_above(self) -> list:
        self.gpu = GpuTier([GpuPool("cpu", 8 * BLOCK, PAGE)])
        return [self.gpu]

    def compression_config(self) -> CompressionConfig:
        return dataclasses.replace(super().compression_config(), gpu_decode=self.gpu_decode)

    def spill(self, ns: Namespace, hashes) -> None:
        """Put `hashes`, then filler chains until all of them sit on disk, written."""
        super().spill(ns, hashes)
        self.store.disk.flush()

    def read(self, ns: Namespace, hashes, tier: str = "gpu") -> list:
        """(tier, bytes) of each block as a reader of `tier` gets it (None: a miss)."""
        store = self.store
        entries = asyncio.run(store.prepare_read(store.pin(ns.id, hashes, "r"), "r", tier))
        out = [None if e is None else (e.tier, store.tiers[e.tier].read(e.location)) for e in entries]
        store.release(ns.id, [key_hash(e.key) for e in entries if e is not None], "r")
        return out


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path / "disk")
    yield h
    h.close()


def test_a_gpu_readers_encoded_disk_hits_are_expanded_on_the_gpu(harness):
    store = harness.store
    assert store.expander is not None, store.gpu_decode_off
    hashes = chain_hashes(1, 3)
    harness.spill(LOSSY_NS, hashes)
    host_used = store.host.used_bytes
    got = harness.read(LOSSY_NS, hashes)
    assert got == [("gpu", lossy(h)) for h in hashes]  # byte-exact with the CPU decoder
    assert store.shared.counters["gpu_expanded_blocks"] == 3
    assert store.host.used_bytes == host_used  # the host arena took no copy
    for h in hashes:
        e = store.index.entries[block_key(LOSSY_NS.id, h)]
        assert "disk" in e.copies  # its encoded disk copy stays
    assert store.stats()["gpu_decode"] == {"on": True, "reason": ""}
    assert store.check() == []


def test_a_parent_in_host_goes_up_first_and_its_children_are_expanded(harness):
    """The tree keeps a child out of a faster tier than its parent: the read's host blocks before the
    expanded ones are lifted into the gpu tier first."""
    store = harness.store
    hashes = chain_hashes(11, 3)
    harness.spill(LOSSY_NS, hashes)
    assert harness.read(LOSSY_NS, hashes[:1], tier="host") == [("host", lossy(hashes[0]))]
    assert harness.read(LOSSY_NS, hashes) == [("gpu", lossy(h)) for h in hashes]
    counters = store.shared.counters
    assert counters["gpu_expanded_blocks"] == 2 and counters["lifts"] == 1
    assert store.check() == []


def test_a_sink_block_stored_exact_comes_up_first_and_the_rest_are_expanded(tmp_path):
    """A profile whose first block stays exact (the attention sink): that block takes the host way and is
    lifted, within the same promotion, so the encoded blocks below it can be expanded into the gpu tier."""
    bits = [[[4, 2], [4, 2]], [[4, 2], [4, 2]]]
    (tmp_path / "sink1.json").write_text(json.dumps({"format": "kvstore-codec-profile/1", "name": "sink1",
                                                     "bits": bits, "sink_blocks": 1}))
    ns = dataclasses.replace(LOSSY_NS, codec="sink1")
    h = Harness(tmp_path / "disk", profile_dir=str(tmp_path))
    try:
        hashes = chain_hashes(12, 3)
        h.spill(ns, hashes)
        budget = Budget(np.array(bits, np.uint8))
        want = [payload(hashes[0])] + [decode(encode(np.frombuffer(payload(x), np.uint8), LAYOUT, budget),
                                              LAYOUT).tobytes() for x in hashes[1:]]
        assert h.read(ns, hashes) == [("gpu", b) for b in want]
        assert h.store.shared.counters["gpu_expanded_blocks"] == 2 and h.store.shared.counters["lifts"] == 1
        assert h.store.check() == []
    finally:
        h.close()


def test_exact_blocks_and_a_host_reader_take_the_cpu_way(harness):
    store = harness.store
    exact, lossy_hashes = chain_hashes(2, 2), chain_hashes(3, 2)
    harness.spill(EXACT_NS, exact)
    harness.spill(LOSSY_NS, lossy_hashes)
    assert harness.read(EXACT_NS, exact) == [("gpu", payload(h)) for h in exact]  # through host, lifted
    assert harness.read(LOSSY_NS, lossy_hashes, tier="host") == [("host", lossy(h)) for h in lossy_hashes]
    assert store.shared.counters["gpu_expanded_blocks"] == 0
    assert store.check() == []


def test_blocks_in_a_cpu_engines_layout_are_decoded_on_the_cpu(harness):
    """vLLM's CPU kernels store a head's keys transposed: the kernel does not read that layout, so those
    blocks come up through the host arena, decoded on the CPU, never dropped."""
    cpu_layout = BlockLayout(2, 2, 16, 64, "bfloat16", "HKTVND")
    ns = dataclasses.replace(LOSSY_NS, layout="cpu/LBHNC")
    hashes = chain_hashes(8, 2)
    harness.spill(ns, hashes)
    want = [decode(encode(np.frombuffer(payload(h), np.uint8), cpu_layout, Budget.uniform(cpu_layout, 4, 2)),
                   cpu_layout).tobytes() for h in hashes]
    assert [b for _, b in harness.read(ns, hashes)] == want
    assert harness.store.shared.counters["gpu_expanded_blocks"] == 0
    assert harness.store.check() == []


def test_off_in_the_config_the_cpu_decodes(tmp_path):
    h = Harness(tmp_path / "disk", gpu_decode=False)
    try:
        hashes = chain_hashes(4, 2)
        h.spill(LOSSY_NS, hashes)
        assert h.read(LOSSY_NS, hashes) == [("gpu", lossy(x)) for x in hashes]  # promoted to host, then lifted
        assert h.store.shared.counters["gpu_expanded_blocks"] == 0
        assert h.store.stats()["gpu_decode"] == {"on": False, "reason": "compression.gpu_decode is off"}
        assert h.store.check() == []
    finally:
        h.close()


def test_a_damaged_block_is_a_miss_and_never_served(harness):
    store = harness.store
    hashes = chain_hashes(5, 3)
    harness.spill(LOSSY_NS, hashes)
    slot = store.index.entries[block_key(LOSSY_NS.id, hashes[1])].location
    with open(os.path.join(harness.folder, DATA_FILE), "r+b") as f:
        f.seek(slot.extents[0][0] + 100)
        byte = f.read(1)
        f.seek(slot.extents[0][0] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = harness.read(LOSSY_NS, hashes)
    assert got == [("gpu", lossy(hashes[0])), None, None]  # the block and its subtree are gone
    assert store.shared.counters["disk_checksum_failures"] == 1
    assert store.lookup(LOSSY_NS.id, hashes).hits == 1
    assert store.check() == []  # no gpu page left held


def test_a_gpu_fault_falls_back_to_the_cpu(harness, monkeypatch):
    store = harness.store
    hashes = chain_hashes(6, 3)
    harness.spill(LOSSY_NS, hashes)

    def fault(self, items):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(GpuExpander, "__call__", fault)
    got = harness.read(LOSSY_NS, hashes)
    assert [b for _, b in got] == [lossy(h) for h in hashes]  # served all the same, decoded on the CPU
    assert store.shared.counters["gpu_decode_errors"] == 1 and store.shared.counters["gpu_expanded_blocks"] == 0
    assert store.check() == []


def test_the_expander_writes_blocks_whose_layers_cross_page_runs_and_refuses_damaged_ones():
    """Straight into the pages where each layer's slice is one run; through a scratch buffer where the
    pages split a layer; a block whose codec checksum fails leaves its pages untouched."""
    tier = GpuTier([GpuPool("cpu", 16 * PAGE, PAGE)])
    expand, why = expander_for(tier, Compression(CompressionConfig(disk=True)))
    assert expand is not None, why
    blobs = [encode(np.frombuffer(payload(h), np.uint8), LAYOUT, Budget.uniform(LAYOUT, 4, 2, rotate=i != 1))
             for i, h in enumerate(chain_hashes(7, 3))]  # (rotated and not: two launches)
    whole = [[0, BLOCK]]  # one run: layers at 0 and 8 KiB
    split = [[5 * PAGE, PAGE], [8 * PAGE, 2 * PAGE], [12 * PAGE, PAGE]]  # layer 0 spans two runs
    damaged = blobs[2].copy()
    damaged[-1] ^= 1
    pool = tier.pools[0].host
    pool[:] = 0
    assert expand([(whole, blobs[0]), (split, blobs[1]), ([[13 * PAGE, BLOCK - PAGE], [4 * PAGE, PAGE]], damaged)]) \
        == [True, True, False]
    assert np.array_equal(pool[:BLOCK], decode(blobs[0], LAYOUT))
    got = np.concatenate([pool[o : o + n] for o, n in split])
    assert np.array_equal(got, decode(blobs[1], LAYOUT))
    assert not pool[13 * PAGE :].any() and not pool[4 * PAGE : 5 * PAGE].any()
    tier.close()


def test_without_the_interpreter_the_emulated_tier_decodes_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    tier = GpuTier([GpuPool("cpu", 4 * PAGE, PAGE)])
    expand, why = expander_for(tier, Compression(CompressionConfig(disk=True)))
    assert expand is None and "TRITON_INTERPRET" in why
    tier.close()


def test_through_the_daemon_a_gpu_clients_disk_hits_come_up_expanded_in_its_pool(daemon_factory, tmp_path):
    """A real daemon (the config's [compression] and [gpu] sections, the kernel interpreted in its process)
    and a client that maps the emulated pool as a GPU engine maps CUDA pools: its reads of blocks demoted
    to disk come back in the GPU tier, expanded there."""
    from kvstore.tiers.gpu import SLOT, open_pool

    config = tmp_path / "kvstore.toml"
    config.write_text("[compression]\ndisk = true\nexact_when_busy = false\n")
    d = daemon_factory("--config", str(config), "--disk-path", str(tmp_path / "d"), "--disk-bytes", str(64 * BLOCK),
                       "--gpu-device", "cpu", "--gpu-devices", "0", "--gpu-bytes", str(8 * BLOCK),
                       "--gpu-page-bytes", str(BLOCK), host_bytes=str(4 * BLOCK), page_bytes=str(PAGE), disk=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    client = d.client()
    ns_id = client.register(LOSSY_NS)
    hashes = chain_hashes(9, 3)
    for salt in [None] + list(range(2000, 2040)):  # the prompt, then others until it sits on disk
        chain = hashes if salt is None else chain_hashes(salt, 2)
        blocks = list(zip(chain, [None] + chain[:-1]))
        extents = client.reserve(ns_id, blocks)
        for h, ext in zip(chain, extents):
            data, pos = np.frombuffer(payload(h), np.uint8), 0
            for o, n in ext:
                client.arena[o : o + n] = data[pos : pos + n]
                pos += n
        client.commit(ns_id, chain)
        if all(t == "disk" for t in client.lookup(ns_id, hashes).tiers):
            break
    assert wait_for(lambda: client.stats()["tiers"]["disk"]["pending_writes"] == 0, timeout_s=20)
    extents, at = client.acquire_at(ns_id, hashes, "gpu")
    assert at == ["gpu"] * 3
    pool = open_pool(client.gpu_pools[0], os.getuid())
    for h, ext in zip(hashes, extents):
        assert np.concatenate([pool[o % SLOT : o % SLOT + n] for o, n in ext]).tobytes() == lossy(h)
    client.release(ns_id, hashes)
    stats = client.stats()
    assert stats["counters"]["gpu_expanded_blocks"] == 3 and stats["gpu_decode"] == {"on": True, "reason": ""}
    human = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", d.socket_path],
                           capture_output=True, text=True, timeout=60)
    assert "gpu decode: on; 3 blocks expanded on the GPU, 0 launches failed" in human.stdout, human.stdout + human.stderr
    assert "kvstore_gpu_expanded_blocks_total 3.0" in d.http("/metrics")[1].decode()
    assert d.check() == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")
def test_on_cuda_the_kernel_expands_into_vram_byte_exact(monkeypatch):
    """The compiled kernel on a CUDA pool: encoded bytes staged in pinned memory, one copy to the device, the
    kernel into the pages (and through the scratch buffer), byte-exact with the CPU decoder."""
    import kvstore.codec_triton as mod

    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(mod)
    try:
        tier = GpuTier([GpuPool("cuda:0", 16 * PAGE, PAGE)])
        expand = GpuExpander(tier)
        for rotate in (True, False):
            blobs = [encode(np.frombuffer(payload(h), np.uint8), LAYOUT, Budget.uniform(LAYOUT, 4, 2, rotate=rotate))
                     for h in chain_hashes(10, 2)]
            split = [[5 * PAGE, PAGE], [8 * PAGE, 2 * PAGE], [12 * PAGE, PAGE]]
            assert expand([([[0, BLOCK]], blobs[0]), (split, blobs[1])]) == [True, True]
            assert tier.read([[0, BLOCK]]) == decode(blobs[0], LAYOUT).tobytes()
            assert tier.read(split) == decode(blobs[1], LAYOUT).tobytes()
        tier.close()
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
        importlib.reload(mod)


def test_a_block_stored_exact_in_the_middle_of_a_chain_keeps_the_chain_whole(harness, monkeypatch):
    """Encoded, exact (as a demotion while the encoders were busy stores it), encoded: taken root first in
    runs of one kind, the exact block goes the host way and up between two expansions."""
    store = harness.store
    hashes = chain_hashes(13, 3)
    middle = block_key(LOSSY_NS.id, hashes[1])
    codec_for = store.placement.codec_for
    monkeypatch.setattr(store.placement, "codec_for", lambda e, dst: None if e.key == middle else codec_for(e, dst))
    harness.spill(LOSSY_NS, hashes)
    assert harness.read(LOSSY_NS, hashes) == [("gpu", lossy(hashes[0])), ("gpu", payload(hashes[1])),
                                               ("gpu", lossy(hashes[2]))]
    counters = store.shared.counters
    assert counters["gpu_expanded_blocks"] == 2 and counters["lifts"] == 1
    assert store.check() == []
