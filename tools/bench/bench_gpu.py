"""Benchmark the connector's GPU copy path against the plain copy of the same bytes, in one run.

What is timed is what the vLLM worker runs: a copy plan (connectors/copy_plan.py)
built from the engine's KV geometry and the store's extents, submitted with
`CudaTransfers` (connectors/cuda_copy.py) on a side stream after the forward's
stream, until its done event completes (wall clock around submit + finish: the
submission's Python cost counts). The limits are plain `copy_` calls of the same
number of bytes, contiguous, in the same run: device to device for the GPU pool,
pinned host to device (and back) for the arena.

The executors are vLLM's: `dma` its `swap_blocks_batch` op, `kernel` its Triton
batch copy. `executors` in the result says what each runs on this machine: where
vLLM is not installed, `dma` is the connector's fallback (one `cuMemcpyAsync` per
piece) and `kernel` is absent (its cases are left out, saying why); each row's
`op` is what ran its plan.

Shapes: Llama-3-8B blocks (32 layers, 8 KV heads, head size 128, bf16):
16-token blocks (2 MiB) and 128-token blocks (16 MiB), each in a block-outermost
layout (BLHNC, what the connector asks vLLM for: one piece per block) and a
layer-outer one (LBHNC: one piece per block and layer). Blocks go to random,
non-contiguous engine block ids, from and to random, non-contiguous pages of a
GPU pool owned by another process (opened by CUDA IPC, as an engine opens the
daemon's) and of a shared-memory arena registered with cudaHostRegister.

Results (`--json` prints one object):
- `cases`: per (block tokens, layout, direction, store tier, executor): GB/s, the
  limit's GB/s, and `vs_limit` (goal >= 0.9 for the default executor, `dma`);
- `step_load`: an 8k-token prompt's load (512 or 64 blocks) from each tier with the
  default executor: ms and `x_plain_copy` (goal <= 1.1);
- `interference`: a bf16 8192^3 GEMM loop's slowdown on the forward stream while
  ~10 GB of loads from the arena run beside it, per executor (goal <= 5% for the
  default executor, "dma");
- `expand`: encoded blocks (k4v2, k8v4) expanded into a GPU pool by the daemon's
  expander, in KV bytes a second, and `x_exact_copy` against the pinned H2D copy
  of the same blocks exact (goal >= 1: a compressed hit delivers more KV bytes a
  second than an exact one);
- every transfer's bytes are checked: its destination is filled with a constant, one transfer runs, the
  bytes are compared with the source (`verify`), then it is timed; a transfer that fails or moves other
  bytes gives its row an `error` and the run goes on (`errors` counts them). The default executor's
  cases run first. `--out PATH` writes the JSON after every case.

`--device cpu` runs the same code with the host executor and no IPC (a smoke test
of this script on machines without CUDA); without CUDA and without it, the script
prints why and exits 2. It exits 1 when a case failed.

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
from kvstore.tiers import gpu  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE = 32, 8, 128
PROMPT_TOKENS = 8192
GOALS = {"vs_limit": 0.9, "step_load_x_plain_copy": 1.1, "interference_slowdown": 0.05, "expand_x_exact_copy": 1.0}

OWNER = r"""
import json, sys
import msgpack, torch
from kvstore.tiers import gpu
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

        from kvstore.tiers.host import HostArena

        self.device, self.owner = device, None
        self.page = 256 << 10
        self.nbytes = nbytes
        self.arena = HostArena(f"/dev/shm/kvstore-bench-gpu-{os.getpid()}", nbytes, self.page, prefault=True)
        self.arena.buf[:] = 0
        self.pinned = gpu.pin_host(self.arena.buf) if device != "cpu" else None
        if device == "cpu":
            self.pool = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
            return
        self.owner = subprocess.Popen([sys.executable, "-c", OWNER, device, str(nbytes), str(self.page)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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


def transfers_for(device: str, executor: str, regions: list, stores=None):
    """CudaTransfers with one executor forced (the kernel only while the arena is registered, as in the
    worker), or on CPU the host transfers over `regions`."""
    if device == "cpu":
        from kvstore.connectors.cpu_copy import CpuExecutor, CpuTransfers

        cpu = CpuExecutor(threads=1)
        cpu.set_regions("all", regions)
        return CpuTransfers(cpu)
    from kvstore.connectors.cuda_copy import make_transfers

    transfers = make_transfers(device, executor)
    transfers.chooser.host_mapped = bool(stores is not None and stores.pinned is not None and stores.pinned.pinned)
    return transfers


def copy_ops() -> dict:
    """What each CUDA executor runs on this machine (vLLM's op, the per-piece fallback), or why none."""
    from kvstore.connectors.cuda_copy import DmaExecutor, KernelExecutor

    out = {}
    for name, make in (("dma", DmaExecutor), ("kernel", KernelExecutor)):
        try:
            executor = make()
        except (ImportError, RuntimeError) as exc:
            out[name] = {"op": None, "why": str(exc)}
            continue
        why = getattr(executor, "fallback_reason", "")
        out[name] = {"op": executor.op_name, **({"why": why} if why else {})}
    return out


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


class CaseFailed(Exception):
    """A case's transfer failed or moved other bytes: recorded in its row, the other cases go on."""


SCRAMBLE = 0x5A  # what a checked block's destination holds before the verified run


def checked_blocks(ids: list) -> list[int]:
    """The blocks a case checks: the first and last of the transfer and six others at random (every block
    would move gigabytes off the GPU per case)."""
    return sorted({0, len(ids) - 1} | set(random.Random(len(ids)).sample(range(len(ids)), min(6, len(ids)))))


def block_parts(kv, geom, stores, tier: str, ids: list, extents: list, i: int) -> tuple[list, list]:
    """Block i of a transfer as (its store extents, its pieces of KV memory): tensor slices, in one order."""
    from kvstore.connectors.copy_plan import build_plan

    flat = stores.pool if tier == "pool" else stores.host_tensor()
    one = build_plan(geom, [ids[i]], [extents[i]], 0, to_kv=True)
    base = kv[0].untyped_storage().data_ptr()
    memory = _kv_bytes(kv)
    return ([flat[o:o + n] for o, n in extents[i]],
            [memory[int(a) - base:int(a) - base + int(n)] for a, n in zip(one.dst, one.size)])


def scramble(kv, geom, stores, tier: str, ids: list, extents: list, to_kv: bool) -> None:
    """Before the verified run: the checked blocks' source gets fresh random bytes and their destination
    SCRAMBLE, so a transfer that did not run, ran short or read the wrong place fails `verify` (the
    bytes an earlier case left cannot pass for this one's)."""
    for i in checked_blocks(ids):
        store_parts, kv_parts = block_parts(kv, geom, stores, tier, ids, extents, i)
        source, destination = (store_parts, kv_parts) if to_kv else (kv_parts, store_parts)
        for part in source:
            part.random_(0, 256)
        for part in destination:
            part.fill_(SCRAMBLE)


def verify(kv, geom, stores, tier: str, ids: list, extents: list, to_kv: bool) -> None:
    """The checked blocks hold the same bytes in the engine's KV and in their extents (after `scramble`
    and one transfer)."""
    import torch

    for i in checked_blocks(ids):
        store_parts, kv_parts = block_parts(kv, geom, stores, tier, ids, extents, i)
        if not torch.equal(torch.cat([p.cpu() for p in store_parts]), torch.cat([p.cpu() for p in kv_parts])):
            raise CaseFailed(f"block {ids[i]} differs from its {tier} extents after a {'load' if to_kv else 'save'}")


def _kv_bytes(kv):
    """The whole KV allocation as one uint8 tensor."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=kv[0].device).set_(kv[0].untyped_storage())


def bench_case(args, stores, block_tokens: int, layout: str, executor: str, step_loads: bool) -> tuple[list, dict]:
    """Every (tier, direction) of one shape with one executor: a row each, with `error` where the transfer
    failed or moved other bytes (the other rows go on). `step_loads`: record the loads as step loads."""
    import torch

    from kvstore.connectors.copy_plan import build_plan, kv_geometry

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
        transfers = transfers_for(device, executor, regions, stores)
        try:
            for to_kv in (True, False):
                plan = build_plan(geom, ids, extents, base, to_kv=to_kv)
                row = {"block_tokens": block_tokens, "layout": layout, "direction": "load" if to_kv else "save",
                       "tier": tier, "executor": executor, "blocks": n, "pieces": len(plan)}
                if device != "cpu":  # what really runs the plan (a forced kernel still refuses what it cannot take)
                    row["op"] = transfers.chooser.pick(plan, to_kv).op_name
                out.append(row)

                def run(p=plan, load=to_kv) -> None:
                    error = (transfers.load(p) if load else transfers.save(p)).finish()
                    if error is not None:
                        raise CaseFailed(f"the transfer failed: {error!r}") from error

                try:
                    scramble(kv, geom, stores, tier, ids, extents, to_kv)
                    sync(device)
                    run()
                    sync(device)
                    verify(kv, geom, stores, tier, ids, extents, to_kv)
                    seconds = timed(device, run, args.iters)
                except Exception as exc:  # recorded; a CUDA error may leave the context unusable: later rows say so
                    row["error"] = repr(exc)
                    continue
                limit = limits[(tier, "load" if to_kv else "save")]
                row.update(gbps=n * bb / seconds / 1e9, limit_gbps=n * bb / limit / 1e9, vs_limit=limit / seconds)
                if to_kv and step_loads:
                    step[f"{tier}_{block_tokens}tok_{layout}"] = {"ms": seconds * 1e3, "x_plain_copy": seconds / limit}
        finally:
            transfers.close()
    del kv
    if device != "cpu":
        torch.cuda.empty_cache()
    return out, step


def _storage_array(kv):
    """The host executor's view of the KV allocation (`--device cpu`)."""
    from kvstore.connectors.cpu_copy import storage_bytes

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

    from kvstore.connectors.copy_plan import build_plan, kv_geometry

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
        transfers = transfers_for(device, executor, [], stores)
        beside = []
        try:
            for _ in range(5):
                torch.cuda.synchronize()
                tickets = [transfers.load_layers([plan], [0]) for _ in range(loads)]  # the forward does not wait
                beside.append(gemms())
                errors = [e for e in (t.finish() for t in tickets) if e is not None]
                if errors:
                    raise CaseFailed(f"{len(errors)} of {len(tickets)} loads failed: {errors[0]!r}")
            out[f"{executor}_slowdown"] = statistics.median(beside) / alone - 1
        except Exception as exc:
            out[f"{executor}_error"] = repr(exc)
        finally:
            transfers.close()
    return out


def expansion(args, blocks: int) -> dict:
    """Encoded blocks expanded into a GPU pool by the daemon's expander (kvstore/gpu_decode.py: staged in
    pinned memory, one copy to the device, the Triton kernel into the pages), against the pinned H2D copy
    of the same blocks exact, in KV bytes delivered a second. Llama-3-8B blocks of 16 tokens, HNC."""
    import numpy as np
    import torch

    from kvstore.codec import BlockLayout, Budget, decode, encode, from_float32
    from kvstore.gpu_decode import GpuExpander

    device = args.device
    layout = BlockLayout(LAYERS, KV_HEADS, 16, HEAD_SIZE, "bfloat16", "HNC")
    bb = layout.block_bytes
    rng = np.random.default_rng(0)
    payloads = [from_float32(rng.standard_normal(bb // 2, np.float32), "bfloat16") for _ in range(blocks)]
    host = torch.empty(blocks * bb, dtype=torch.uint8, pin_memory=device != "cpu")
    host.numpy()[:] = np.concatenate(payloads)
    dev = torch.empty(blocks * bb, dtype=torch.uint8, device=device)
    exact_s = timed(device, lambda: dev.copy_(host, non_blocking=True), args.iters)
    out: dict = {"blocks": blocks, "block_bytes": bb, "exact_gbps": blocks * bb / exact_s / 1e9}
    tier = gpu.GpuTier([gpu.GpuPool(device, blocks * bb, bb)])
    try:
        expand = GpuExpander(tier)
        for name, budget in (("k4v2", Budget.uniform(layout, 4, 2)), ("k8v4", Budget.uniform(layout, 8, 4))):
            blobs = [encode(p, layout, budget) for p in payloads]
            items = [([[i * bb, bb]], blob) for i, blob in enumerate(blobs)]
            try:
                tier.pools[0].buf.fill_(SCRAMBLE)
                if expand(items) != [True] * blocks:
                    raise CaseFailed("the expander refused a block")
                for i in checked_blocks(list(range(blocks))):
                    if tier.read([[i * bb, bb]]) != decode(blobs[i], layout).tobytes():
                        raise CaseFailed(f"block {i} differs from the CPU decoder's")
                t = timed(device, lambda: expand(items), args.iters)
                out[name] = {"ratio": bb / blobs[0].size, "gbps": blocks * bb / t / 1e9, "x_exact_copy": exact_s / t}
            except Exception as exc:
                out[f"{name}_error"] = repr(exc)
    finally:
        tier.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--stream-gb", type=float, default=10.0, help="loads beside the GEMM loop")
    p.add_argument("--out", default=None, help="also write the JSON here, after every case")
    args = p.parse_args(argv)
    if args.device != "cpu":
        ok, reason = gpu.cuda_available()
        if not ok:
            print(json.dumps({"skipped": reason}) if args.json else f"bench_gpu: skipped, no CUDA: {reason}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"skipped": reason}, f)
            return 2
    args.blocks_bytes = (64 << 20) if args.quick else (1 << 30)
    if args.quick:
        args.iters = min(args.iters, 3)
    import torch

    result = {"device": torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu",
              "goals": GOALS, "cases": [], "step_load": {}, "interference": {}}
    if args.device == "cpu":
        executors = ["cpu"]
    else:  # the executors this machine has: vLLM's ops where vLLM is installed (see `executors` for which)
        result["executors"] = copy_ops()
        executors = [e for e in ("dma", "kernel") if result["executors"][e]["op"]]
    stores = Stores(args.device, 3 * args.blocks_bytes)

    def written() -> None:  # after every case: a run cut short by its time limit still leaves its results
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(args.out + ".tmp", args.out)

    try:
        # The default executor's cases first, then the kernel's: a fault in one (a CUDA error can leave the
        # context unusable) does not take the default's figures with it.
        for executor in executors:
            for block_tokens in (16, 128):
                for layout in ("BLHNC", "LBHNC"):
                    rows, step = bench_case(args, stores, block_tokens, layout, executor, executor in ("dma", "cpu"))
                    result["cases"] += rows
                    result["step_load"].update(step)
                    written()
            if args.device != "cpu":
                result["interference"].update(interference(args, stores, [executor]))
                written()
        if args.device != "cpu":  # (on CPU the kernel runs interpreted: tests/test_gpu_decode.py checks it there)
            result["expand"] = expansion(args, 8 if args.quick else 64)
            written()
    finally:
        stores.close()
    default = [r for r in result["cases"] if r["executor"] == "dma" or args.device == "cpu"]
    failed = sum("error" in r for r in result["cases"]) + sum(k.endswith("_error") for k in result["interference"]) \
        + sum(k.endswith("_error") for k in result.get("expand", {}))
    result["errors"] = failed + (not default)  # no copy engines at all: neither vLLM's op nor cuda.bindings
    result["worst_default_vs_limit"] = min((r.get("vs_limit", 0.0) for r in default), default=0.0)
    written()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"device: {result['device']}")
        for name, what in result.get("executors", {}).items():
            print(f"{name}: {what['op'] or 'unavailable'}" + (f" ({what['why']})" if "why" in what else ""))
        for r in result["cases"]:
            what = (f"{r['gbps']:8.2f} GB/s  limit {r['limit_gbps']:8.2f}  x{r['vs_limit']:.3f}" if "error" not in r
                    else f"FAILED: {r['error']}")
            print(f"{r['block_tokens']:>4} tok {r['layout']} {r['direction']:<4} {r['tier']:<5} {r['executor']:<6} "
                  f"{r['pieces']:>6} pieces {what}" + (f"  [{r['op']}]" if "op" in r else ""))
        for k, v in result["step_load"].items():
            print(f"step load {k}: {v['ms']:.2f} ms, {v['x_plain_copy']:.3f}x the plain copy")
        for k, v in result.get("interference", {}).items():
            print(f"interference {k}: {v:.3f}" if isinstance(v, float) else f"interference {k}: {v}")
        for k, v in result.get("expand", {}).items():
            print(f"expand {k}: {v}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
