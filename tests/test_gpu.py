"""GPU tier on CUDA: IPC sharing across processes, pinned arena DMA, gather/scatter on
vLLM's CUDA KV layouts, and concurrent readers and writers.

Every test here needs a CUDA device and skips with the reason `cuda_available()`
gives. Child processes are plain `python -c` scripts that talk JSON lines on
stdin/stdout, so nothing depends on pickling test functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tiers import gpu
from tiers.host import HostArena, copy_out, map_arena

CUDA_OK, CUDA_REASON = gpu.cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")]

torch = pytest.importorskip("torch", reason="the gpu tests need torch")

from connectors import cuda_copy as cc  # noqa: E402
from tests.test_cuda_copy_cpu import KINDS, NB, blank_like, make_layers, random_ids, ref_payload  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20

CHILD = r"""
import hashlib, json, sys
import msgpack, numpy as np, torch
from tiers import gpu

def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

pool = gpu.open_pool(gpu.IpcHandle.from_wire(msgpack.unpackb(bytes.fromhex(sys.stdin.readline()))))
target = torch.device(sys.argv[1]) if len(sys.argv) > 1 else pool.device
print(json.dumps({"ok": True, "device": str(pool.device)}), flush=True)
for line in sys.stdin:
    task = json.loads(line)
    if task["op"] == "quit":
        break
    sha = []
    for extents, seed in task["blocks"]:
        n = sum(length for _, length in extents)
        if task["op"] == "write":
            src = torch.from_numpy(pattern(seed, n)).to(pool.device)
            gpu.copy_runs(pool, src, gpu.plan_runs(extents, [[0, n]]))
        else:
            dst = torch.empty(n, dtype=torch.uint8, device=target)
            gpu.copy_runs(dst, pool, gpu.plan_runs([[0, n]], extents))
            sha.append(hashlib.sha256(dst.cpu().numpy().tobytes()).hexdigest())
    torch.cuda.synchronize()
    print(json.dumps({"ok": True, "sha": sha}), flush=True)
"""


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sha(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


class Child:
    """An engine-like process that opened the pool by IPC."""

    def __init__(self, pool: "gpu.GpuPool", *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.send_line(msgpack.packb(pool.export_ipc().to_wire()).hex())
        self.hello = self.reply()

    def send_line(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def send(self, op: str, blocks=()) -> None:
        self.send_line(json.dumps({"op": op, "blocks": list(blocks)}))

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child died (rc={self.proc.wait(timeout=60)})")
        return json.loads(line)

    def close(self) -> None:
        self.send("quit")
        assert self.proc.wait(timeout=120) == 0


@pytest.fixture
def pool():
    p = gpu.GpuPool("cuda:0", 64 * MiB, 64 * 1024)
    yield p
    torch.cuda.synchronize()


def fragmented(alloc, free, nbytes: int, n: int) -> list:
    """n blocks of 2 * nbytes in a pool with 2n holes of nbytes: each spans several holes."""
    spacers = [alloc(nbytes) for _ in range(4 * n)]
    for s in spacers[::2]:
        free(s)
    return [alloc(2 * nbytes) for _ in range(n)]


# -- IPC ------------------------------------------------------------------------------
def test_second_process_reads_identical_bytes_by_ipc(pool):
    blocks = fragmented(pool.allocate, pool.free, 200_000, 4)
    assert all(len(e) > 1 for e in blocks)
    payloads = [pattern(i, sum(n for _, n in e)) for i, e in enumerate(blocks)]
    for e, p in zip(blocks, payloads):
        pool.write(e, p.tobytes())
    child = Child(pool)
    assert child.hello["device"] == "cuda:0"
    child.send("read", [(e, 0) for e in blocks])
    assert child.reply()["sha"] == [sha(p) for p in payloads]
    # and the other way round: what the child writes, the daemon reads
    target = pool.allocate(123_457)
    child.send("write", [(target, 99)])
    child.reply()
    assert pool.read(target) == pattern(99, 123_457).tobytes()
    child.close()


@pytest.mark.skipif(CUDA_OK and torch.cuda.device_count() < 2, reason="needs two GPUs for peer-to-peer")
def test_engine_on_another_gpu_reads_the_pool_peer_to_peer(pool):
    block = pool.allocate(1_000_000)
    pool.write(block, pattern(5, 1_000_000).tobytes())
    child = Child(pool, "cuda:1")
    child.send("read", [(block, 0)])
    assert child.reply()["sha"] == [sha(pattern(5, 1_000_000))]
    child.close()


# -- pinned arena <-> GPU ---------------------------------------------------------------
@pytest.fixture
def arena(tmp_path):
    root = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    a = HostArena(os.path.join(root, f"kvstore-test-gpu-{os.getpid()}"), 32 * MiB, 64 * 1024)
    yield a
    a.close()


def test_arena_gpu_copies_through_registered_memory_are_identical(arena):
    client = map_arena(arena.path, arena.capacity_bytes)  # the engine's own mapping
    pinned = gpu.pin_host(client)
    assert pinned.pinned, pinned.reason
    assert pinned.tensor.is_pinned()
    src = fragmented(arena.allocate, arena.free, 300_000, 6)
    assert all(len(e) > 1 for e in src)
    total = sum(n for e in src for _, n in e)
    data = pattern(1, total)
    pos = 0
    for e in src:
        size = sum(n for _, n in e)
        arena.write(e, data[pos : pos + size])
        pos += size
    flat_src = [x for e in src for x in e]
    back = arena.allocate(total)
    stream = gpu.TransferStream("cuda:0")
    staging = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    with stream.submit():
        gpu.copy_runs(staging, pinned.tensor, gpu.plan_runs([[0, total]], flat_src))
        gpu.copy_runs(pinned.tensor, staging, gpu.plan_runs(back, [[0, total]]))
        done = stream.record()
    stream.synchronize(done)
    assert stream.is_done(done)
    assert sha(staging.cpu().numpy()) == sha(data)
    assert sha(copy_out(arena.buf, back)) == sha(data)
    pinned.unpin()
    assert not pinned.tensor.is_pinned()


# -- gather/scatter on CUDA layouts -------------------------------------------------------
@pytest.mark.parametrize("target", ["pinned_host", "gpu_pool"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_and_layerwise_load_on_cuda_layouts(kind, target):
    layout, ref_layers = make_layers(kind, seed=21)
    _, layers = make_layers(kind, seed=21, device="cuda:0")
    kv = cc.paged_kv(layers, NB)
    ids = random_ids(6, seed=22)
    if target == "pinned_host":
        flat = torch.zeros(16 * kv.block_bytes, dtype=torch.uint8).pin_memory()
    else:
        flat = torch.zeros(16 * kv.block_bytes, dtype=torch.uint8, device="cuda:0")
    slots = random.Random(3).sample(range(16), len(ids))
    extents = [[[s * kv.block_bytes, kv.block_bytes]] for s in slots]
    copier = cc.StreamedCopier("cuda:0")
    ticket = copier.save(kv, ids, flat, extents)
    ticket.fence_source()  # the next forward may overwrite the blocks only after the gather
    ticket.synchronize()
    assert ticket.ready()
    host = flat.cpu()
    for b, s in zip(ids, slots):
        got = host[s * kv.block_bytes : (s + 1) * kv.block_bytes]
        assert torch.equal(got, ref_payload(ref_layers, layout, b)), f"block {b}"

    _, dst = blank_like(kind, device="cuda:0")
    dst_ids = random_ids(6, seed=23)
    ticket = copier.load(cc.paged_kv(dst, NB), dst_ids, flat, extents, layerwise=True)
    for layer in range(len(dst)):
        ticket.wait_layer(layer)  # what wait_for_layer_load does: the GPU waits, the host does not
    torch.cuda.current_stream().synchronize()
    dst_cpu = [t.cpu() for t in dst]
    for b_src, b_dst in zip(ids, dst_ids):
        assert torch.equal(ref_payload(dst_cpu, layout, b_dst), ref_payload(ref_layers, layout, b_src))
    assert not any(ref_payload(dst_cpu, layout, b).any() for b in set(range(NB)) - set(dst_ids))


# -- stress ---------------------------------------------------------------------------------
def test_stress_ipc_readers_and_writers_in_other_processes(pool):
    """Two writer and two reader processes work on the two halves of the pool in turn:
    in round r writers fill half r % 2 while readers check what was committed to the
    other half in round r - 1."""
    halves = [[pool.allocate(random.Random(i).randrange(10_000, 400_000)) for i in range(h, 40, 2)] for h in (0, 1)]
    writers, readers = [Child(pool) for _ in range(2)], [Child(pool) for _ in range(2)]
    committed: dict[int, list] = {}
    try:
        for r in range(8):
            mine = halves[r % 2]
            seeds = [1000 * r + i for i in range(len(mine))]
            for k, w in enumerate(writers):
                w.send("write", [(e, s) for e, s in list(zip(mine, seeds))[k::2]])
            if r >= 1:
                prev_blocks, prev_seeds = committed[(r - 1) % 2]
                for rd in readers:
                    rd.send("read", [(e, 0) for e in prev_blocks])
            for w in writers:
                w.reply()
            if r >= 1:
                want = [sha(pattern(s, sum(n for _, n in e))) for e, s in zip(prev_blocks, prev_seeds)]
                for rd in readers:
                    assert rd.reply()["sha"] == want, f"round {r}"
            committed[r % 2] = (mine, seeds)  # commit only after every writer answered
    finally:
        for c in writers + readers:
            c.close()
    assert pool.check([e for half in halves for e in half]) == []


def test_stress_concurrent_copier_threads(arena):
    """Threads save and load through their own side streams into disjoint arena
    extents and disjoint KV blocks; every round trip must be byte-identical."""
    layout, ref_layers = make_layers("shared_LBNHC", seed=31)
    _, layers = make_layers("shared_LBNHC", seed=31, device="cuda:0")
    kv = cc.paged_kv(layers, NB)
    pinned = gpu.pin_host(map_arena(arena.path, arena.capacity_bytes))
    ids_all = random_ids(12, seed=32)
    errors: list[str] = []
    lock = threading.Lock()

    def arena_alloc(n: int):
        with lock:
            return arena.allocate(n)

    def worker(k: int) -> None:
        try:
            copier = cc.StreamedCopier("cuda:0")
            ids = ids_all[k::4]
            extents = [arena_alloc(kv.block_bytes) for _ in ids]
            for _ in range(20):
                copier.save(kv, ids, pinned.tensor, extents).synchronize()
                for b, e in zip(ids, extents):
                    if sha(copy_out(arena.buf, e)) != sha(ref_payload(ref_layers, layout, b).numpy()):
                        errors.append(f"thread {k}: block {b} differs")
                copier.load(kv, ids, pinned.tensor, extents).synchronize()
        except Exception as exc:  # surfaced below: a thread cannot fail the test itself
            errors.append(f"thread {k}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    torch.cuda.synchronize()
    for t_ref, t in zip(ref_layers, layers):  # loads wrote back what saves read: unchanged
        assert torch.equal(t.cpu(), t_ref)
    pinned.unpin()
