"""Disk-tier bandwidth: demotion (host -> disk) and promotion (disk -> host) vs `dd` O_DIRECT.

    python -m kvstore.tools.bench.bench_disk [--dir .cache/bench_disk] [--blocks 256] [--block-bytes 2MiB] [--repeat 3]
        [--page-bytes 64KiB] [--compression PROFILE] [--json]

In one run, on the same folder, for each repeat:
  - dd write:  dd if=/dev/zero of=DIR/dd.bin bs=BLOCK count=N oflag=direct
  - dd read:   dd if=DIR/dd.bin of=/dev/null bs=BLOCK iflag=direct
  - demotion:  a [host, disk] TieredStore whose host arena holds N blocks (N roots), all evicted to disk
               (`Placement.make_room` on the host tier: memcpy to staging, O_DIRECT writes, fdatasync,
               LMDB commits), timed until `flush()` returns, i.e. until every block is durable; the disk
               tier's pages are `--page-bytes` (its default; a block takes whole pages, so blocks smaller
               than a page do not sit on adjacent pages)
  - promotion: acquire + `await prepare_read` of all N blocks in batches of 32 (allocate host
               pages, O_DIRECT read, xxh3 verify), then release
Reported: the median GB/s of each, and write_vs_dd / read_vs_dd, the median over the repeats of
the ratio store / dd measured in the same repeat (the disk of a shared VM drifts between repeats).

`--compression PROFILE` (a codec profile name: built-in `k4v2`, ..., or a file in
tools/bench/profiles) adds, in each repeat, the same demotion and promotion
three more times on blocks of SmolLM2-135M's shape (30 layers, 3 KV heads,
head 64, bf16, `--codec-block-tokens` tokens, the CUDA HNC layout) holding bf16
normal values: once exact, and twice with `[compression] disk = true` and the
namespace opted in (encoded on the disk tier's encoder threads, decoded in the
reader thread):
  - every block encoded (`exact_when_busy = false`: demotions wait for the
    encoders): `codec_write_vs_exact`, `codec_read_vs_exact`;
  - the default (`exact_when_busy = true`: a block demoted while the encoders
    are behind is stored exact): `keepup_write_vs_exact`,
    `keepup_read_vs_exact`, and `keepup_encoded_share`, the share of the blocks
    stored encoded, `keepup_disk_ratio`, their KV bytes over their disk bytes;
    then the compaction of the exact ones once the disk is idle
    (kvstore/compaction.py): `keepup_compaction_s`, `keepup_compacted_share`
    (encoded after it); the promotion reads the compacted blocks.
All count KV bytes, the blocks' own (decoded) size; the `_vs_exact` figures are
medians of per-repeat ratios to the exact arm's KV bytes per second;
`codec_ratio` is an encoded block's logical / stored bytes (headers and scales
counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

from kvstore.codec import from_float32
from kvstore.compression import Compression, decode_into
from kvstore.config import CompressionConfig, parse_size
from kvstore.store import TieredStore
from kvstore.keys import Namespace, block_key
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostArena


def _figure(gbps: float) -> float:
    """A rate to four significant digits (a small run on a busy machine is well under 0.001 GB/s, not 0)."""
    return float(f"{gbps:.4g}")


def dd(args: list[str], nbytes: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return nbytes / (time.perf_counter() - t0) / 1e9


PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def codec_namespace(block_tokens: int, profile: str = "") -> Namespace:
    """SmolLM2-135M's KV shape, opted into `profile` when given."""
    L, H, D = 30, 3, 64
    return Namespace("bench-smollm2", "bfloat16", L, H, D, block_tokens, L * H * block_tokens * 2 * D * 2,
                     layout="cuda/LBHNC", codec=profile)


def store_round(folder: str, n: int, block_bytes: int, ns: Namespace | None = None, compress: bool = False,
                exact_when_busy: bool = False, page: int = 64 << 10) -> tuple[float, float, dict]:
    """(demotion GB/s, promotion GB/s, info) of n blocks; `ns` (its block size), `compress` and
    `exact_when_busy`: the codec arms, counted in the blocks' own bytes; `page`: the disk tier's page."""
    if ns is None:
        ns = Namespace("bench", "bf16", 1, 1, 64, 16, block_bytes)
        payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    else:
        block_bytes = ns.block_bytes
        payload = from_float32(np.random.default_rng(0).standard_normal(block_bytes // 2, np.float32), "bfloat16")
    host = HostArena(f"/dev/shm/kvstore-bench-disk-{uuid.uuid4().hex[:8]}", n * block_bytes, block_bytes)
    shutil.rmtree(folder, ignore_errors=True)
    disk = DiskTier(folder, (n + 1) * -(-block_bytes // page) * page, page_bytes=page, decoder=decode_into)
    store = TieredStore([host, disk], compression=Compression(CompressionConfig(
        disk=compress, profile_dir=PROFILES, exact_when_busy=exact_when_busy)))
    try:
        ns_id = store.register_namespace(ns)
        hashes = [i.to_bytes(16, "little") for i in range(1, n + 1)]
        for h in hashes:
            (e,) = store.reserve(ns_id, [(h, None)], "bench")
            host.write(e.location, payload)
            store.commit(ns_id, [h], "bench")
        disk.wait_formatted()  # steady state: every slot written once (see tiers/disk.py, Formatting)
        t0 = time.perf_counter()
        store.placement.make_room("host", lambda: host.used_bytes)  # demote everything
        store.flush()
        write_gbps = n * block_bytes / (time.perf_counter() - t0) / 1e9
        assert store.stats()["tiers"]["disk"]["blocks"] == n
        info: dict = {}
        if compress:  # the blocks the demotion stored encoded; with exact_when_busy, the compaction encodes the rest
            encoded = sum(r["blocks"] for r in disk.stats()["compressed"].values())
            assert exact_when_busy or encoded == n, "not every block was stored encoded"
            stored = store.compression.codec(ns).stored_bytes
            info["encoded_share"] = encoded / n
            info["disk_ratio"] = n * block_bytes / (encoded * stored + (n - encoded) * block_bytes)
            if exact_when_busy:  # (kvstore/compaction.py)
                t0 = time.perf_counter()
                asyncio.run(store.compactor.run_until_idle())
                info["compaction_s"] = time.perf_counter() - t0
                compacted = sum(r["blocks"] for r in disk.stats()["compressed"].values())
                info["compacted_share"] = compacted / n
                assert store.shared.counters["disk_compacted"] == compacted - encoded

        async def promote_all() -> None:
            for i in range(0, n, 32):
                part = hashes[i : i + 32]
                entries = store.pin(ns_id, part, "bench", prefix=False)
                got = await store.prepare_read(entries, "bench")
                assert all(e is not None and e.tier == "host" for e in got), "a promotion failed"
                store.release(ns_id, part, "bench")

        t0 = time.perf_counter()
        asyncio.run(promote_all())
        read_gbps = n * block_bytes / (time.perf_counter() - t0) / 1e9
        sample = store.index.entries[block_key(ns_id, hashes[n // 2])]
        if not compress:
            assert np.array_equal(np.frombuffer(host.read(sample.location), np.uint8), payload)
        assert store.check() == []
        info.update(direct_io=disk.direct, direct_io_fallback_reason=disk.direct_reason)
        rows = disk.stats()["compressed"].values()
        if compress and rows:
            info["codec_ratio"] = round(sum(r["logical_bytes"] for r in rows) / sum(r["stored_bytes"] for r in rows), 3)
        return write_gbps, read_gbps, info
    finally:
        store.close(persist=False)
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".cache/bench_disk", help="folder on the disk under test")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", default="2MiB")
    p.add_argument("--page-bytes", default="64KiB", help="the disk tier's page (its default: 64KiB)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--compression", default="", metavar="PROFILE",
                   help="add the exact and compressed arms on SmolLM2-shaped blocks with this codec profile")
    p.add_argument("--codec-block-tokens", type=int, default=128, help="tokens per block of the codec arms")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    block = parse_size(args.block_bytes, "--block-bytes")
    page = parse_size(args.page_bytes, "--page-bytes")
    if page <= 0 or page % 4096:
        p.error("--page-bytes must be a positive multiple of 4KiB (O_DIRECT)")
    n = args.blocks
    os.makedirs(args.dir, exist_ok=True)
    dd_file = os.path.join(args.dir, "dd.bin")
    runs: dict[str, list[float]] = {"dd_write": [], "dd_read": [], "write": [], "read": []}
    info: dict = {}
    codec_info: dict = {}
    for _ in range(args.repeat):
        runs["dd_write"].append(dd(["if=/dev/zero", f"of={dd_file}", f"bs={block}", f"count={n}", "oflag=direct"], n * block))
        runs["dd_read"].append(dd([f"if={dd_file}", "of=/dev/null", f"bs={block}", "iflag=direct"], n * block))
        os.unlink(dd_file)
        w, r, info = store_round(os.path.join(args.dir, "tier"), n, block, page=page)
        runs["write"].append(w)
        runs["read"].append(r)
        if args.compression:
            codec_info = codec_arms(os.path.join(args.dir, "tier"), n, args, runs)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "block_bytes": block,
        "page_bytes": page,
        "blocks": n,
        "repeat": args.repeat,
        "write_gbps": _figure(med["write"]),
        "read_gbps": _figure(med["read"]),
        "dd_write_gbps": _figure(med["dd_write"]),
        "dd_read_gbps": _figure(med["dd_read"]),
        "write_vs_dd": round(statistics.median(w / d for w, d in zip(runs["write"], runs["dd_write"])), 3),
        "read_vs_dd": round(statistics.median(r / d for r, d in zip(runs["read"], runs["dd_read"])), 3),
        "runs_gbps": {k: [_figure(x) for x in v] for k, v in runs.items()},
        **info,
    }
    if args.compression:
        result.update(codec_summary(runs, med, args, codec_info))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{n} blocks of {block} B on pages of {page} B, median of {args.repeat} repeats "
              "(GB/s; ratios per repeat):")
        print(f"  demotion  {result['write_gbps']:.2f}   dd oflag=direct {result['dd_write_gbps']:.2f}   "
              f"write_vs_dd {result['write_vs_dd']:.2f}")
        print(f"  promotion {result['read_gbps']:.2f}   dd iflag=direct {result['dd_read_gbps']:.2f}   "
              f"read_vs_dd {result['read_vs_dd']:.2f}")
        print(f"  direct I/O: {info.get('direct_io')} {info.get('direct_io_fallback_reason', '')}")
        if args.compression:
            c = result["codec"]
            print(f"  {c['block_bytes']} B SmolLM2 blocks, KV GB/s, {c['profile']} at {c['codec_ratio']}x on disk "
                  "(every block encoded):")
            print(f"    demotion  exact {c['write_exact_gbps']:.2f}  compressed {c['write_gbps']:.2f}  "
                  f"codec_write_vs_exact {c['codec_write_vs_exact']:.2f}")
            print(f"    promotion exact {c['read_exact_gbps']:.2f}  compressed {c['read_gbps']:.2f}  "
                  f"codec_read_vs_exact {c['codec_read_vs_exact']:.2f}")
            print(f"  exact_when_busy (the default): {c['keepup_encoded_share']:.0%} of the blocks encoded, "
                  f"{c['keepup_disk_ratio']:.2f}x on disk:")
            print(f"    demotion  {c['keepup_write_gbps']:.2f}  keepup_write_vs_exact {c['keepup_write_vs_exact']:.2f}")
            print(f"    compaction of the rest once idle: {c['keepup_compaction_s']:.2f} s, then "
                  f"{c['keepup_compacted_share']:.0%} encoded")
            print(f"    promotion {c['keepup_read_gbps']:.2f}  keepup_read_vs_exact {c['keepup_read_vs_exact']:.2f}")
    return 0


def codec_arms(folder: str, n: int, args, runs: dict) -> dict:
    """One repeat of the exact and compressed arms on SmolLM2-shaped blocks, appended to `runs`."""
    ns = codec_namespace(args.codec_block_tokens, args.compression)
    codec = Compression(CompressionConfig(disk=True, profile_dir=PROFILES)).codec(ns)
    block = np.zeros(ns.block_bytes, np.uint8)  # the codec's loops compile at their first use: not in a timed round
    decode_into(codec.encode(block), [block])
    w, r, _ = store_round(folder, n, 0, ns, compress=False)
    runs.setdefault("codec_exact_write", []).append(w)
    runs.setdefault("codec_exact_read", []).append(r)
    w, r, info = store_round(folder, n, 0, ns, compress=True)
    runs.setdefault("codec_write", []).append(w)
    runs.setdefault("codec_read", []).append(r)
    w, r, keepup = store_round(folder, n, 0, ns, compress=True, exact_when_busy=True)
    runs.setdefault("keepup_write", []).append(w)
    runs.setdefault("keepup_read", []).append(r)
    runs.setdefault("keepup_encoded_share", []).append(keepup["encoded_share"])
    runs.setdefault("keepup_disk_ratio", []).append(keepup["disk_ratio"])
    runs.setdefault("keepup_compaction_s", []).append(keepup["compaction_s"])
    runs.setdefault("keepup_compacted_share", []).append(keepup["compacted_share"])
    return info


def codec_summary(runs: dict, med: dict, args, info: dict) -> dict:
    ratio = lambda a, b: round(statistics.median(x / y for x, y in zip(runs[a], runs[b])), 3)  # noqa: E731
    return {"codec": {
        "profile": args.compression,
        "block_bytes": codec_namespace(args.codec_block_tokens).block_bytes,
        "codec_ratio": info["codec_ratio"],
        "write_exact_gbps": round(med["codec_exact_write"], 3),
        "write_gbps": round(med["codec_write"], 3),
        "read_exact_gbps": round(med["codec_exact_read"], 3),
        "read_gbps": round(med["codec_read"], 3),
        "codec_write_vs_exact": ratio("codec_write", "codec_exact_write"),
        "codec_read_vs_exact": ratio("codec_read", "codec_exact_read"),
        "keepup_write_gbps": round(med["keepup_write"], 3),
        "keepup_read_gbps": round(med["keepup_read"], 3),
        "keepup_write_vs_exact": ratio("keepup_write", "codec_exact_write"),
        "keepup_read_vs_exact": ratio("keepup_read", "codec_exact_read"),
        "keepup_encoded_share": round(med["keepup_encoded_share"], 3),
        "keepup_disk_ratio": round(med["keepup_disk_ratio"], 3),
        "keepup_compaction_s": round(med["keepup_compaction_s"], 3),
        "keepup_compacted_share": round(med["keepup_compacted_share"], 3),
    }}


if __name__ == "__main__":
    sys.exit(main())
