"""Benchmark the GPU path against plain torch copies of the same bytes, in one run.

- h2d: shared-memory arena (pinned with cudaHostRegister) -> paged GPU KV cache
  through `StreamedCopier.load` (coalesced H2D runs into a staging buffer, then
  one scatter per layer), vs a plain `copy_` of a pinned torch tensor holding
  the same bytes into a GPU tensor. Ratio: h2d_vs_pinned_copy (goal >= 0.8).
- ipc: a GPU-tier pool owned by another process (the daemon's role), opened here
  by CUDA IPC, -> this process's buffer with `copy_runs` over the blocks'
  extents, vs a plain device-to-device `copy_` of the same bytes between two
  tensors of this process. Ratio: ipc_vs_d2d (goal >= 0.8).
- ipc_to_paged (for information): pool -> paged KV through the copier. That is
  two passes over the bytes (runs into staging, then scatter), so expect about
  half of d2d until a fused gather-scatter kernel exists.

Blocks are shaped like Llama-3-8B (32 layers x 8 KV heads x 128 x bf16 x 16
tokens = 2 MiB) and go to random, non-contiguous block ids. Times are wall
clock around synchronized runs, median of --iters. Without CUDA it prints why
(`{"skipped": reason}` with --json) and exits 2.

    python tools/bench/bench_gpu.py [--json] [--blocks 256] [--layout LBNHC] [--fragment]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiers import gpu  # noqa: E402

OWNER = r"""
import json, sys
import msgpack, torch
from tiers import gpu
capacity, page, block_bytes, n, fragment = (int(x) for x in sys.argv[1:6])
pool = gpu.GpuPool("cuda:0", capacity, page)
spacers = [pool.allocate(block_bytes // 2) for _ in range(n)] if fragment else []
for s in spacers[::2]:
    pool.free(s)
extents = [pool.allocate(block_bytes) for _ in range(n)]
pool.buf.random_(0, 256)
torch.cuda.synchronize()
print(json.dumps({"handle": msgpack.packb(pool.export_ipc().to_wire()).hex(), "extents": extents}), flush=True)
sys.stdin.readline()  # the pool lives until the engine side is done
"""


def timed(fn, iters: int) -> float:
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_kv(layout: str, num_blocks: int, args) -> list:
    """Per-layer KV tensors as vLLM builds them (one allocation for LBHNC/LBNHC)."""
    import torch

    L, H, N, D = args.layers, args.kv_heads, args.block_tokens, args.head_size
    if layout == "LBHNC":
        raw = torch.zeros(L, num_blocks, H, N, 2 * D, dtype=torch.bfloat16, device="cuda:0")
        return [raw[i] for i in range(L)]
    if layout == "LBNHC":  # flash-attn's physical order, seen through the logical [B, H, N, 2D] view
        raw = torch.zeros(L, num_blocks, N, H, 2 * D, dtype=torch.bfloat16, device="cuda:0")
        return [raw[i].permute(0, 2, 1, 3) for i in range(L)]
    return [torch.zeros(2, num_blocks, N, H, D, dtype=torch.bfloat16, device="cuda:0") for _ in range(L)]


def bench_h2d(args, kv, ids) -> dict:
    import torch

    from tiers.host import HostArena, map_arena

    n, bb, page = len(ids), kv.block_bytes, args.page_kib * 1024
    capacity = 2 * n * -(-bb // page) * page  # room for the blocks and the spacers between them
    if shutil.disk_usage("/dev/shm").free < capacity:
        raise SystemExit(f"bench_gpu: /dev/shm has less than the {capacity >> 20} MiB the arena needs; lower --blocks")
    arena = HostArena(f"/dev/shm/kvstore-bench-gpu-{os.getpid()}", capacity, page)
    try:
        spacers = [arena.allocate(bb // 2) for _ in range(n)] if args.fragment else []
        for s in spacers[::2]:
            arena.free(s)
        extents = [arena.allocate(bb) for _ in range(n)]
        pinned = gpu.pin_host(map_arena(arena.path, arena.capacity_bytes))
        copier = _copier()
        ours = timed(lambda: copier.load(kv, ids, pinned.tensor, extents).synchronize(), args.iters)
        host = torch.empty(n * bb, dtype=torch.uint8).pin_memory()
        dev = torch.empty(n * bb, dtype=torch.uint8, device="cuda:0")
        plain = timed(lambda: dev.copy_(host, non_blocking=True), args.iters)
        runs = len(gpu.plan_runs([[0, n * bb]], [x for e in extents for x in e]))
        was_pinned, why_not = pinned.pinned, pinned.reason
        pinned.unpin()
    finally:
        arena.close()
    return {
        "arena_pinned": was_pinned,
        "arena_pin_reason": why_not,
        "h2d_runs": runs,
        "h2d_gbps": n * bb / ours / 1e9,
        "pinned_copy_gbps": n * bb / plain / 1e9,
        "h2d_vs_pinned_copy": plain / ours,
    }


def bench_ipc(args, kv, ids) -> dict:
    import msgpack
    import torch

    n, bb, page = len(ids), kv.block_bytes, args.page_kib * 1024
    capacity = 2 * n * -(-bb // page) * page
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(capacity), str(page), str(bb), str(n), str(int(args.fragment))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        hello = json.loads(owner.stdout.readline())
        pool = gpu.open_pool(gpu.IpcHandle.from_wire(msgpack.unpackb(bytes.fromhex(hello["handle"]))))
        extents = hello["extents"]
        runs = gpu.plan_runs([[0, n * bb]], [x for e in extents for x in e])
        dst = torch.empty(n * bb, dtype=torch.uint8, device="cuda:0")
        ours = timed(lambda: gpu.copy_runs(dst, pool, runs), args.iters)
        src = torch.empty_like(dst).random_(0, 256)
        plain = timed(lambda: dst.copy_(src), args.iters)
        copier = _copier()
        paged = timed(lambda: copier.load(kv, ids, pool, extents).synchronize(), args.iters)
        del pool
        torch.cuda.synchronize()
    finally:
        owner.stdin.write("done\n")
        owner.stdin.flush()
        owner.wait(timeout=120)
    return {
        "ipc_runs": len(runs),
        "ipc_gbps": n * bb / ours / 1e9,
        "d2d_gbps": n * bb / plain / 1e9,
        "ipc_vs_d2d": plain / ours,
        "ipc_to_paged_gbps": n * bb / paged / 1e9,
        "ipc_to_paged_vs_d2d": plain / paged,
    }


def _copier():
    from connectors.cuda_copy import StreamedCopier

    return StreamedCopier("cuda:0")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--blocks", type=int, default=256, help="blocks per transfer (2 MiB each by default)")
    p.add_argument("--layout", choices=["LBHNC", "LBNHC", "2BNHD"], default="LBNHC")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--page-kib", type=int, default=256)
    p.add_argument("--fragment", action="store_true", help="interleave holes so blocks are not adjacent")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)

    ok, reason = gpu.cuda_available()
    if not ok:
        print(json.dumps({"skipped": reason}) if args.json else f"bench_gpu: skipped, no CUDA: {reason}")
        return 2

    import torch

    from connectors.cuda_copy import paged_kv

    kv = paged_kv(make_kv(args.layout, 2 * args.blocks, args), 2 * args.blocks)
    ids = random.Random(0).sample(range(2 * args.blocks), args.blocks)
    result = {
        "device": torch.cuda.get_device_name(0),
        "layout": args.layout,
        "fused": kv.fused is not None,
        "blocks": args.blocks,
        "block_bytes": kv.block_bytes,
        "fragment": args.fragment,
        **bench_h2d(args, kv, ids),
        **bench_ipc(args, kv, ids),
        "goals": {"h2d_vs_pinned_copy": 0.8, "ipc_vs_d2d": 0.8},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
