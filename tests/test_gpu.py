"""The GPU path end to end: engine processes drive the connector's two sides (the code vLLM calls) with KV
tensors in vLLM's layouts, through a real daemon with a GPU tier, and a race test of the stream ordering.

Every flow runs twice: on "cuda:0" (marked `gpu`: CUDA KV tensors, the daemon's VRAM pools opened by IPC,
copies by vLLM's ops where vLLM is installed, else one cuMemcpyAsync per piece; skipped with the reason
where there is no CUDA, and the kernel's cases where vLLM's kernel is absent) and on
"cpu" (the GPU tier emulated in shared memory, host copies: the same handshake, routing, demotion and
restart logic, in CI). Engines are `tests/kv_engine.py` processes; a block's bytes are compared by
sha256 of its payload in the saving and the loading engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import wait_for
from kvstore.tiers import gpu
from kvstore.tools.harness import engine_fork
from kvstore.tools.harness.daemon_proc import ROOT

CUDA_OK, CUDA_REASON = gpu.cuda_available()
N = 16  # tokens per block (tests/kv_engine.py)
BLOCK = 8 * 4 * N * 2 * 64 * 2  # 128 KiB
DEVICES = [pytest.param("cpu", id="emulated"),
           pytest.param("cuda:0", id="cuda", marks=[pytest.mark.gpu,
                                                   pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")])]


def gpu_flags(device: str, blocks_per_device: int, devices: str = "0") -> list[str]:
    kind = ["--gpu-device", "cpu", "--gpu-devices", devices] if device == "cpu" else ["--gpu-devices", devices]
    return [*kind, "--gpu-bytes", str(blocks_per_device * BLOCK), "--gpu-page-bytes", str(BLOCK)]


def start_script(script: Path, argv: list[str]) -> tuple:
    """`script argv` from the repository root, forked from the engines' zygote (tools/harness/engine_fork.py:
    vLLM imported once) with one socket as its stdin and stdout, or, where the zygote cannot serve this
    environment, a subprocess with pipes. Returns (process, its stdin, its stdout, its stderr's file)."""
    err = tempfile.NamedTemporaryFile(prefix=f"{script.stem}-", suffix=".log", delete=False).name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = engine_fork.start(str(script), argv, str(ROOT), env, None, err, stdio=theirs)
        if proc is not None:
            return proc, ours.makefile("w"), ours.makefile("r"), err  # the files keep the socket open
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(script), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=f, text=True, cwd=ROOT, env=env)
    return proc, proc.stdin, proc.stdout, err


class EngineProc:
    """A `kv_engine` process (`start_script`); `ask` sends one request and returns its reply. It starts at once
    and is waited for at its first use, so that engines made one after another start side by side."""

    def __init__(self, socket_path: str, device: str, layout: str = "LBHNC", seed: int = 0, whole_step: bool = False):
        argv = [socket_path, "--device", device, "--layout", layout, "--seed", str(seed)] + \
            (["--whole-step"] if whole_step else [])
        self.proc, self._to, self._from, self._err = start_script(ROOT / "tests" / "kv_engine.py", argv)
        self._hello: dict | None = None

    def ready(self) -> dict:
        """The engine's hello, read once: waits for its start."""
        if self._hello is None:
            self._hello = self._reply()
            assert self._hello.get("ready"), self._hello
        return self._hello

    @property
    def block_outermost(self) -> bool:
        return self.ready()["block_outermost"]

    def _reply(self) -> dict:
        line = self._from.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise AssertionError(f"engine died (exit {code}):\n{Path(self._err).read_text()[-4000:]}")
        return json.loads(line)

    def _send(self, req: dict) -> None:
        self._to.write(json.dumps(req) + "\n")
        self._to.flush()

    def ask(self, op: str, tokens: list[int], ids: list[int]) -> dict:
        self.ready()
        self._send({"op": op, "tokens": tokens, "ids": ids})
        reply = self._reply()
        assert reply["ok"], reply
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self._send({"op": "quit"})
            assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for f in (self._to, self._from):
            try:
                f.close()
            except OSError:  # a pipe whose reader is gone
                pass
        Path(self._err).unlink(missing_ok=True)


@pytest.fixture
def engines():
    started: list[EngineProc] = []

    def make(*args, **kw) -> EngineProc:
        e = EngineProc(*args, **kw)
        started.append(e)
        return e

    yield make
    for e in started:
        e.kill()


def prompt(n_blocks: int, base: int) -> list[int]:
    return list(range(base, base + n_blocks * N + 3))


def check_same(saved: dict, loaded: dict, saved_ids: list[int], loaded_ids: list[int]) -> None:
    for a, b in zip(saved_ids, loaded_ids):
        assert loaded["sha"][str(b)] == saved["sha"][str(a)], f"block {a} -> {b}: other bytes"


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("device", DEVICES)
def test_engine_a_saves_into_the_gpu_tier_and_engine_b_loads_the_same_bytes(daemon_factory, engines, device, layout):
    d = daemon_factory(*gpu_flags(device, 16), page_bytes=str(BLOCK))
    a = engines(d.socket_path, device, layout, seed=1)
    b = engines(d.socket_path, device, layout, seed=2)
    assert a.block_outermost == (layout == "BLHNC")
    tokens = prompt(10, 1000)
    saved = a.ask("save", tokens, list(range(11)))
    assert len(saved["saved"]) == 10
    stats = d.stats()
    assert stats["counters"]["put_gpu_blocks"] == 10 and stats["tiers"]["gpu"]["blocks"] == 10
    loaded = b.ask("load", tokens[: 10 * N] + [5, 5, 5], list(range(30, 41)))
    assert loaded["hit"] == 10 * N and loaded["invalid"] == []
    check_same(saved, loaded, list(range(10)), list(range(30, 40)))
    a.close()
    b.close()
    assert d.stats()["pinned_blocks"] == 0 and d.check() == []


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_demoted_gpu_host_disk_and_promoted_back_are_byte_identical(daemon_factory, engines, device, tmp_path):
    disk = ["--disk-path", str(tmp_path / "disk"), "--disk-bytes", str(64 * BLOCK)]
    d = daemon_factory(*gpu_flags(device, 4, "0"), *disk, host_bytes=str(8 * BLOCK), page_bytes=str(BLOCK), disk=True)
    a = engines(d.socket_path, device, seed=3)
    b = engines(d.socket_path, device, seed=4)  # (it loads once A's blocks went down)
    prompts = [prompt(6, base) for base in (10_000, 20_000, 30_000)]
    saved = [a.ask("save", p, list(range(7 * i, 7 * i + 7))) for i, p in enumerate(prompts)]
    assert wait_for(lambda: d.stats()["tiers"]["disk"]["blocks"] > 0, timeout_s=20)  # pushed down two tiers
    counters = d.stats()["counters"]
    assert counters["gpu_demotions"] > 0
    for i, p in enumerate(prompts):
        loaded = b.ask("load", p[: 6 * N] + [9, 9, 9], list(range(40, 47)))
        assert loaded["hit"] == 6 * N and loaded["invalid"] == [], (i, loaded)
        check_same(saved[i], loaded, list(range(7 * i, 7 * i + 6)), list(range(40, 46)))
    assert d.stats()["counters"].get("promotions", 0) > 0  # some came back up from disk
    a.close()
    b.close()
    assert d.check() == []


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_engine_leaks_no_pool_page(daemon_factory, device, tmp_path):
    d = daemon_factory(*gpu_flags(device, 8), page_bytes=str(BLOCK))
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys, time\n"
        "from kvstore.client import KVClient\n"
        "from tests.kv_engine import namespace\n"
        "import xxhash\n"
        "c = KVClient(sys.argv[1])\n"
        "ns = c.register(namespace(sys.argv[2], 'LBHNC'))\n"
        "hs = [xxhash.xxh3_128_digest(bytes([i])) for i in range(4)]\n"
        "ext, at = c.reserve_at(ns, [(h, p) for h, p in zip(hs, [None] + hs[:-1])], 'gpu')\n"
        "print(at.count('gpu'), flush=True)\n"
        "time.sleep(120)\n")
    proc, _, out, err = start_script(script, [d.socket_path, device])
    try:
        assert int(out.readline() or Path(err).read_text()) == 4
        assert d.stats()["tiers"]["gpu"]["used_bytes"] == 4 * BLOCK
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_for(lambda: d.stats()["tiers"]["gpu"]["used_bytes"] == 0, timeout_s=20)
        assert d.stats()["reserved_blocks"] == 0 and d.check() == []
    finally:
        proc.kill()
        out.close()
        Path(err).unlink(missing_ok=True)


@pytest.mark.parametrize("device", DEVICES)
def test_after_a_daemon_restart_engines_reopen_the_pools(daemon_factory, engines, device):
    flags = gpu_flags(device, 16)
    d = daemon_factory(*flags, page_bytes=str(BLOCK), name="gpu-restart")
    a = engines(d.socket_path, device, seed=5)
    first = prompt(4, 40_000)
    a.ask("save", first, list(range(5)))
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=30)
    d = daemon_factory(*flags, page_bytes=str(BLOCK), name="gpu-restart")  # new pools, new handles
    second = prompt(4, 50_000)
    ids = list(range(10, 15))

    def saved_into_new_pools() -> bool:  # the engine's link reconnects after its retry interval
        a.ask("save", second, ids)
        return d.stats()["counters"].get("put_gpu_blocks", 0) >= 4

    assert wait_for(saved_into_new_pools, timeout_s=20)
    saved = a.ask("save", second, ids)  # (already stored: only the digests are wanted)
    b = engines(d.socket_path, device, seed=6)
    loaded = b.ask("load", second[: 4 * N] + [1, 1, 1], list(range(20, 25)))
    assert loaded["hit"] == 4 * N and loaded["invalid"] == []
    check_same(saved, loaded, ids[:4], list(range(20, 24)))
    a.close()
    b.close()
    assert d.check() == []


# -- ordering on the device ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")
@pytest.mark.parametrize("executor", ["dma", "kernel"])
@pytest.mark.parametrize("ordered", [True, False], ids=["with-event-waits", "waits-removed"])
def test_race_save_then_overwrite_and_load_then_read_beside_a_matmul(executor, ordered):
    """200 iterations each, every byte checked, with the forward's stream busy with matmuls:
    - save-then-overwrite: the forward writes a block, a save is submitted, the next forward overwrites it:
      the save must hold what the forward wrote (vLLM #45704, #52360);
    - load-then-read: the forward still reads a block when a load into it is submitted: the forward must
      read the old bytes (vLLM #47282).
    With the event waits the mismatches are 0; with them removed (`ordered=False`) the copies run ahead of
    the matmuls and the test shows mismatches: the waits are what keeps the bytes right."""
    import torch

    from kvstore.connectors import copy_plan as cp
    from kvstore.connectors.cuda_copy import Chooser, CudaTransfers, DmaExecutor
    from kvstore.tiers.gpu import pin_host

    dev = torch.device("cuda:0")
    nb, block = 8, BLOCK
    kv = torch.zeros(nb, block, dtype=torch.uint8, device=dev)  # one piece per block (block-outermost)
    geom = cp.kv_geometry([kv.view(nb, 8, block // 8)[:, i] for i in range(8)], nb)
    arena = torch.zeros(4 * block, dtype=torch.uint8).numpy()
    pinned = pin_host(arena)
    store = [[[int(arena.ctypes.data), block]]]  # one store slot, absolute address
    chooser = Chooser(DmaExecutor() if executor == "dma" else None, _kernel() if executor == "kernel" else None,
                      executor)
    transfers = CudaTransfers(dev, chooser, ordered=ordered)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    seen = torch.empty(block, dtype=torch.uint8, device=dev)
    bad_saves = bad_loads = 0
    try:
        for i in range(200):
            value, other = (2 * i) % 251 + 1, (2 * i + 1) % 251 + 1
            # save-then-overwrite: block 3 becomes `value` after the matmuls; then the save; then reuse
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)
            kv[3].fill_(value)
            ticket = transfers.save(cp.build_plan(geom, [3], store, 0, to_kv=False))
            kv[3].fill_(other)  # the next forward reuses the freed block
            assert (error := ticket.finish()) is None, f"the save failed: {error!r}"
            torch.cuda.synchronize()
            bad_saves += int((torch.from_numpy(arena[:block]) != value).any())
            # load-then-read: the forward reads block 5 (old bytes) behind matmuls; a load into it is submitted
            kv[5].fill_(value)
            arena[:block] = other
            torch.cuda.synchronize()
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)
            seen.copy_(kv[5])  # the forward's read, queued behind the matmuls
            ticket = transfers.load(cp.build_plan(geom, [5], store, 0, to_kv=True))
            assert (error := ticket.finish()) is None, f"the load failed: {error!r}"
            torch.cuda.synchronize()
            bad_loads += int((seen != value).any())
            assert bool((kv[5] == other).all()), "the load did not land"
    finally:
        pinned.unpin()
    if ordered:
        assert (bad_saves, bad_loads) == (0, 0)
    else:
        assert bad_saves + bad_loads > 0, "without the event waits the copies should overtake the forward"


def _kernel():
    """vLLM's Triton batch copy, or a skip saying why it is not here (the lent GPU machines have no vLLM)."""
    from kvstore.connectors.cuda_copy import KernelExecutor

    try:
        return KernelExecutor()
    except ImportError as exc:
        pytest.skip(f"vLLM's Triton batch copy is not available here: {exc}")


def _pieces(rng, sizes) -> tuple:
    """(offsets, sizes): pieces laid out at 16-byte aligned offsets, listed out of address order."""
    sizes = np.asarray(sizes, np.uint64)
    room = (sizes + np.uint64(15)) // np.uint64(16) * np.uint64(16)
    offsets = np.concatenate((np.zeros(1, np.uint64), np.cumsum(room)[:-1]))
    order = rng.permutation(sizes.size)
    return offsets[order], sizes[order]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")
@pytest.mark.parametrize("choice", ["dma", "kernel", "auto"])
def test_plans_of_any_piece_size_move_byte_exact_between_the_pinned_arena_and_the_device(choice):
    """Three plans, each loaded from a registered host buffer into device memory and saved back elsewhere:
    small pieces (8 B to 16 KiB, 8-byte multiples: the kernel's in "auto"), mixed ones up to 200 KiB, and
    odd sizes (1, 12, 4099 B) that only the copy engines may take."""
    import torch

    from kvstore.connectors import copy_plan as cp
    from kvstore.connectors.cuda_copy import make_transfers
    from kvstore.tiers.gpu import pin_host

    if choice == "kernel":
        _kernel()
    rng = np.random.default_rng(7)
    plans = {"small": _pieces(rng, rng.integers(1, 2049, 400) * 8),
             "mixed": _pieces(rng, np.concatenate([rng.integers(1, 25_601, 100) * 8, [200 << 10]])),
             "odd": _pieces(rng, [1, 12, 4099, 8, 40, 3])}
    total = max(int((o + n).max()) for o, n in plans.values())
    host = torch.from_numpy(rng.integers(0, 256, 2 * total, dtype=np.uint8))
    pinned = pin_host(host.numpy())
    assert pinned.pinned, pinned.reason
    dev = torch.zeros(total, dtype=torch.uint8, device="cuda:0")
    transfers = make_transfers("cuda:0", choice)
    chooser, ran = transfers.chooser, {}
    base_h, base_d = np.uint64(host.data_ptr()), np.uint64(dev.data_ptr())
    try:
        for name, (offsets, sizes) in plans.items():
            layer = np.zeros(sizes.size, np.int32)
            load = cp.CopyPlan(base_h + offsets, base_d + offsets, sizes, layer)
            save = cp.CopyPlan(base_d + offsets, base_h + np.uint64(total) + offsets, sizes, layer)
            ran[name] = (chooser.pick(load, True).name, chooser.pick(save, False).name)
            dev.zero_()
            assert transfers.load(load).finish() is None and transfers.save(save).finish() is None
            torch.cuda.synchronize()
            got_dev, got_back = dev.cpu(), host[total:]
            for o, n in zip(offsets.tolist(), sizes.tolist()):
                assert torch.equal(got_dev[o:o + n], host[o:o + n]), f"{name} load ({ran[name]}): piece at {o} +{n}"
                assert torch.equal(got_back[o:o + n], host[o:o + n]), f"{name} save ({ran[name]}): piece at {o} +{n}"
    finally:
        transfers.close()
        pinned.unpin()
    expected = {"dma": {k: ("dma", "dma") for k in plans},
                "kernel": {"small": ("kernel", "kernel"), "mixed": ("kernel", "kernel"), "odd": ("dma", "dma")},
                "auto": {"small": ("kernel" if chooser.kernel else "dma", "dma"), "mixed": ("dma", "dma"),
                         "odd": ("dma", "dma")}}[choice]
    assert ran == expected


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_REASON}")
def test_where_vllm_is_installed_the_copy_engines_run_through_its_op():
    """Where vLLM's CUDA build is importable its op must pass the probe: the fallback would hide a broken op."""
    import importlib.util

    from kvstore.connectors.cuda_copy import DmaExecutor

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM here: the connector's copy engines run one cuMemcpyAsync per piece")
    dma = DmaExecutor()
    assert dma.op_name == "vllm swap_blocks_batch", dma.fallback_reason
