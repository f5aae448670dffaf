"""Benchmark the connector's GPU copy path against the plain copy of the same bytes, in one run.

What is timed is what the vLLM worker runs: a copy plan (connectors/copy_plan.py)
built from the engine's KV geometry and the store's extents, submitted with
`CudaTransfers` (connectors/cuda_copy.py) on a side stream after the forward's
stream, until its done event completes (wall clock around submit + finish: the
submission's Python cost counts). The limits are plain `copy_` calls of the same
number of bytes, contiguous, in the same run: device to device for the GPU pool,
pinned host to device (and back) for the arena.

Shapes: Llama-3-8B blocks (32 layers, 8 KV heads, head size 128, bf16):
16-token blocks (2 MiB) and 128-token blocks (16 MiB), each in a block-outermost
layout (BLHNC, what the connector asks vLLM for: one piece per block) and a
layer-outer one (LBHNC: one piece per block and layer). Blocks go to random,
non-contiguous engine block ids, from and to random, non-contiguous pages of a
GPU pool owned by another process (opened by CUDA IPC, as an engine opens the
daemon's) and of a shared-memory arena registered with cudaHostRegister.

Results (`--json` prints one object):
- `cases`: per (block tokens, layout, direction, store tier, executor): GB/s, the
  limit's GB/s, and `vs_limit` (goal >= 0.9 for the default executor);
- `step_load`: an 8k-token prompt's load (512 or 64 blocks) from each tier with the
  default executor: ms and `x_plain_copy` (goal <= 1.1);
- `interference`: a bf16 8192^3 GEMM loop's slowdown on the forward stream while
  ~10 GB of loads from the arena run beside it, per executor (goal <= 5% for the
  default executor, "dma");
- every transfer's bytes are checked against the source after its timed runs.

`--device cpu` runs the same code with the host executor and no IPC (a smoke test
of this script on machines without CUDA); without CUDA and without it, the script
prints why and exits 2.

    python tools/bench/bench_gpu.py [--json] [--quick] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tiers import gpu  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE = 32, 8, 128
PROMPT_TOKENS = 8192
GOALS = {"vs_limit": 0.9, "step_load_x_plain_copy": 1.1, "interference_slowdown": 0.05}

OWNER = r"""
import json, sys
import msgpack, torch
from tiers import gpu
pool = gpu.GpuPool(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
pool.buf.random_(0, 256)
torch.cuda.synchronize()
print(json.dumps({"handle": msgpack.packb(pool.export_ipc().to_wire()).hex()}), flush=True)
sys.stdin.readline()  # the pool lives until the benchmark is done with it
"""


def block_bytes(block_tokens: int) -> int:
    return LAYERS * KV_HEADS * block_tokens * 2 * HEAD_SIZE * 2


def make_kv(layout: str, num_blocks: int, block_tokens: int, device: str) -> list:
    """Per-layer [blocks, heads, tokens, 2 * head] bf16 views over one allocation, as vLLM builds them."""
    import torch

    shape = (KV_HEADS, block_tokens, 2 * HEAD_SIZE)
    if layout == "BLHNC":
        raw = torch.empty(num_blocks, LAYERS, *shape, dtype=torch.bfloat16, device=device)
        views = [raw[:, i] for i in range(LAYERS)]
    elif layout == "LBHNC":
        raw = torch.empty(LAYERS, num_blocks, *shape, dtype=torch.bfloat16, device=device)
        views = [raw[i] for i in range(LAYERS)]
    else:
        raise ValueError(layout)
    raw.view(torch.uint8).random_(0, 256)
    return views


def scattered_pages(num_pages_total: int, page: int, n: int, bb: int, rng: random.Random) -> list:
    """n blocks over random, distinct pages: each block's extents are its runs of adjacent pages."""
    per_block = -(-bb // page)
    pages = rng.sample(range(num_pages_total), n * per_block)
    out = []
    for i in range(n):
        runs, left = [], bb
        for p in pages[i * per_block:(i + 1) * per_block]:
            length = min(page, left)
            left -= length
            if runs and runs[-1][0] + runs[-1][1] == p * page and runs[-1][1] % page == 0:
                runs[-1][1] += length
            else:
                runs.append([p * page, length])
        out.append(runs)
    return out


class Stores:
    """The two store tiers an engine copies from and to: a GPU pool (another process's, by IPC) and
    the pinned arena; on `--device cpu` both are host buffers."""

    def __init__(self, device: str, nbytes: int) -> None:
        import torch

        from tiers.host import HostArena

        self.device, self.owner = device, None
        self.page = 256 << 10
        self.nbytes = nbytes
        self.arena = HostArena(f"/dev/shm/kvstore-bench-gpu-{os.getpid()}", nbytes, self.page, prefault=True)
        self.arena.buf[:] = 0
        self.pinned = gpu.pin_host(self.arena.buf) if device != "cpu" else None
        if device == "cpu":
            self.pool = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
            return
        env = {**os.environ, "PYTHONPATH": REPO}
        self.owner = subprocess.Popen([sys.executable, "-c", OWNER, device, str(nbytes), str(self.page)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        import msgpack

        hello = json.loads(self.owner.stdout.readline())
        self.pool = gpu.open_pool(gpu.IpcHandle.from_wire(msgpack.unpackb(bytes.fromhex(hello["handle"]))))

    def base(self, tier: str) -> int:
        return self.pool.data_ptr() if tier == "pool" else int(self.arena.buf.ctypes.data)

    def host_tensor(self):
        import torch

        return torch.from_numpy(self.arena.buf)

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.unpin()
        self.pool = None
        if self.owner is not None:
            self.owner.stdin.write("done\n")
            self.owner.stdin.flush()
            self.owner.wait(timeout=120)
        self.arena.close()


def transfers_for(device: str, executor: str, regions: list):
    """CudaTransfers with one executor forced, or on CPU the host transfers over `regions`."""
    if device == "cpu":
        from connectors.cpu_copy import CpuExecutor, CpuTransfers

        cpu = CpuExecutor(threads=1)
        cpu.set_regions("all", regions)
        return CpuTransfers(cpu)
    from connectors.cuda_copy import make_transfers

    return make_transfers(device, executor)


def sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def timed(device: str, fn, iters: int) -> float:
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify(kv, geom, stores, tier: str, ids: list, extents: list, to_kv: bool) -> None:
    """Engine blocks hold exactly the bytes of their extents: the first and last block of the transfer and
    six others at random (every block would move gigabytes off the GPU per case)."""
    import torch

    from connectors.copy_plan import build_plan

    flat = stores.pool if tier == "pool" else stores.host_tensor()
    sample = {0, len(ids) - 1} | set(random.Random(len(ids)).sample(range(len(ids)), min(6, len(ids))))
    for i in sorted(sample):
        one = build_plan(geom, [ids[i]], [extents[i]], 0, to_kv=True)
        store_bytes = torch.cat([flat[o:o + n].cpu() for o, n in extents[i]])
        kv_bytes = torch.cat([_read_kv(kv, int(a), int(n)) for a, n in zip(one.dst, one.size)])
        if not torch.equal(store_bytes, kv_bytes):
            raise SystemExit(f"bench_gpu: block {ids[i]} differs from its {tier} extents after a "
                             f"{'load' if to_kv else 'save'}")


def _read_kv(kv, addr: int, n: int):
    """n bytes of KV memory at `addr` (inside one of the views' allocation)."""
    import torch

    base = kv[0].untyped_storage().data_ptr()
    storage = torch.empty(0, dtype=torch.uint8, device=kv[0].device).set_(kv[0].untyped_storage())
    return storage[addr - base: addr - base + n].cpu()


def bench_case(args, stores, block_tokens: int, layout: str, executors: list[str]) -> tuple[list, dict]:
    import torch

    from connectors.copy_plan import build_plan, kv_geometry

    device, bb = args.device, block_bytes(block_tokens)
    n = max(2, min(args.blocks_bytes // bb, PROMPT_TOKENS // block_tokens))
    num_blocks = 2 * n
    kv = make_kv(layout, num_blocks, block_tokens, device)
    geom = kv_geometry(kv, num_blocks)
    rng = random.Random(block_tokens)
    ids = rng.sample(range(num_blocks), n)
    out, step = [], {}
    limits = _limits(device, stores, n * bb, args.iters)
    for tier in ("pool", "arena"):
        extents = scattered_pages(stores.nbytes // stores.page, stores.page, n, bb, rng)
        base = stores.base(tier)
        regions = [stores.arena.buf, stores.pool.numpy(), _storage_array(kv)] if device == "cpu" else []
        for executor in executors:
            transfers = transfers_for(device, executor, regions)
            for to_kv in (True, False):
                plan = build_plan(geom, ids, extents, base, to_kv=to_kv)
                run = (lambda p=plan: transfers.load(p).finish()) if to_kv else (lambda p=plan: transfers.save(p).finish())
                seconds = timed(device, run, args.iters)
                verify(kv, geom, stores, tier, ids, extents, to_kv)
                limit = limits[(tier, "load" if to_kv else "save")]
                row = {"block_tokens": block_tokens, "layout": layout, "direction": "load" if to_kv else "save",
                       "tier": tier, "executor": executor, "blocks": n, "pieces": len(plan),
                       "gbps": n * bb / seconds / 1e9, "limit_gbps": n * bb / limit / 1e9, "vs_limit": limit / seconds}
                out.append(row)
                if to_kv and executor == executors[0]:
                    step[f"{tier}_{block_tokens}tok_{layout}"] = {"ms": seconds * 1e3, "x_plain_copy": seconds / limit}
            transfers.close()
    del kv
    if device != "cpu":
        torch.cuda.empty_cache()
    return out, step


def _storage_array(kv):
    """The host executor's view of the KV allocation (`--device cpu`)."""
    from connectors.cpu_copy import storage_bytes

    return storage_bytes(kv[0])


def _limits(device: str, stores, nbytes: int, iters: int) -> dict:
    """Seconds of the plain copies of `nbytes`: d2d (pool), pinned H2D (arena load) and D2H (arena save)."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(dev)
    host = stores.host_tensor()[:nbytes]
    d2d = timed(device, lambda: other.copy_(dev, non_blocking=True), iters)
    h2d = timed(device, lambda: dev.copy_(host, non_blocking=True), iters)
    d2h = timed(device, lambda: host.copy_(dev, non_blocking=True), iters)
    return {("pool", "load"): d2d, ("pool", "save"): d2d, ("arena", "load"): h2d, ("arena", "save"): d2h}


def interference(args, stores, executors: list[str]) -> dict:
    """A bf16 GEMM loop on the forward stream, alone and with ~10 GB of arena loads on the side stream."""
    import torch

    from connectors.copy_plan import build_plan, kv_geometry

    device = args.device
    size = 8192 if not args.quick else 2048
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b, c = torch.randn_like(a), torch.empty_like(a)
    bb = block_bytes(16)
    n = max(2, min(args.blocks_bytes // bb, 512))
    kv = make_kv("BLHNC", 2 * n, 16, device)
    geom = kv_geometry(kv, 2 * n)
    extents = scattered_pages(stores.nbytes // stores.page, stores.page, n, bb, random.Random(9))
    plan = build_plan(geom, random.Random(10).sample(range(2 * n), n), extents, stores.base("arena"), to_kv=True)
    loads = max(1, int(args.stream_gb * 1e9 // (n * bb)))

    def gemms(reps: int = 40) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):
        gemms()
    alone = statistics.median(gemms() for _ in range(5))
    out = {"gemm_alone_ms": alone, "loads_gb": loads * n * bb / 1e9}
    for executor in executors:
        transfers = transfers_for(device, executor, [])
        beside = []
        for _ in range(5):
            torch.cuda.synchronize()
            tickets = [transfers.load_layers([plan], [0]) for _ in range(loads)]  # the forward does not wait
            beside.append(gemms())
            for t in tickets:
                t.finish()
        out[f"{executor}_slowdown"] = statistics.median(beside) / alone - 1
        transfers.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--stream-gb", type=float, default=10.0, help="loads beside the GEMM loop")
    args = p.parse_args(argv)
    if args.device != "cpu":
        ok, reason = gpu.cuda_available()
        if not ok:
            print(json.dumps({"skipped": reason}) if args.json else f"bench_gpu: skipped, no CUDA: {reason}")
            return 2
    args.blocks_bytes = (64 << 20) if args.quick else (1 << 30)
    if args.quick:
        args.iters = min(args.iters, 3)
    import torch

    executors = ["dma", "kernel"] if args.device != "cpu" else ["cpu"]
    stores = Stores(args.device, 3 * args.blocks_bytes)
    result = {"device": torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu",
              "goals": GOALS, "cases": [], "step_load": {}}
    try:
        for block_tokens in (16, 128):
            for layout in ("BLHNC", "LBHNC"):
                rows, step = bench_case(args, stores, block_tokens, layout, executors)
                result["cases"] += rows
                result["step_load"].update(step)
        if args.device != "cpu":
            result["interference"] = interference(args, stores, executors)
    finally:
        stores.close()
    default = [r for r in result["cases"] if r["executor"] == executors[0]]
    result["worst_default_vs_limit"] = min(r["vs_limit"] for r in default)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"device: {result['device']}")
        for r in result["cases"]:
            print(f"{r['block_tokens']:>4} tok {r['layout']} {r['direction']:<4} {r['tier']:<5} {r['executor']:<6} "
                  f"{r['pieces']:>6} pieces {r['gbps']:8.2f} GB/s  limit {r['limit_gbps']:8.2f}  x{r['vs_limit']:.3f}")
        for k, v in result["step_load"].items():
            print(f"step load {k}: {v['ms']:.2f} ms, {v['x_plain_copy']:.3f}x the plain copy")
        for k, v in result.get("interference", {}).items():
            print(f"interference {k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
