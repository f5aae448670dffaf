"""Stop-to-serving time and blocks kept across a daemon restart with a full host tier.

For each case: start a daemon (own process, host tier `--host-gib`, pages of
256 KiB or the block's size if smaller, optionally a disk tier as large), fill
the host tier with chains of `--block-kib` blocks (2 MiB: a Llama-8B-shaped
16-token block; 64 KiB makes 16,384 blocks a GiB; distinct bytes per block) and
wait until the daemon has recorded
everything (host placement records with their checksums, which a restart then
verifies; disk writes), stop it (SIGTERM or kill -9),
start it again under the same name, and report:

- stop_s: signal -> the old process has exited (a SIGTERM without a kept
  arena writes the host tier down to the disk tier here);
- start_s: new process -> its "ready" line (a kept arena's records are read,
  and its blocks adopted, before it where there are at most 4,096 of them,
  else after it, while the daemon serves; no block's bytes are read before
  it: each is verified before its first read, or in the background);
- stop_to_serving_s: stop_s + start_s;
- kept_at_ready: blocks found by a lookup right after the ready line;
  recovered_s: from the ready line until the daemon has adopted every block
  (its stats show no recovery in progress);
- kept: blocks the new daemon holds then (lookup), and where (host, disk);
- read_back_s: `get` of every block (chains of 64, root first), all verified byte-identical.

Cases: `before` is `--no-persistent-host` (the arena is removed at stop, what
the daemon did before the arena was kept), `after` the default (kept arena).

    python tools/bench/bench_restart.py [--host-gib 4] [--block-kib 2048] [--json] [--cases before,after] [--disk]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from kvstore.client import KVClient  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from kvstore.tools.harness.daemon_proc import start_daemon  # noqa: E402

MiB = 1 << 20
CHAIN = 64


def namespace(block: int) -> Namespace:
    """16-token blocks of `block` bytes: 8 KV heads of 128, bf16, block // 64 KiB layers."""
    return Namespace("bench-restart", "bf16", block // (64 << 10), 8, 128, 16, block)


def payload(base: np.ndarray, i: int) -> np.ndarray:
    out = base.copy()
    out[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return out


def fill(client: KVClient, ns: str, n: int, base: np.ndarray) -> list[list[bytes]]:
    """n blocks in chains of CHAIN, each block `base` with its number in its first 8 bytes."""
    chains = []
    for c in range(0, n, CHAIN):
        hs = hash_blocks(np.arange(min(CHAIN, n - c) * 16) + c * 1000, 16)
        blocks = [(h, p, payload(base, c + j)) for j, (h, p) in enumerate(zip(hs, [None] + hs[:-1]))]
        if client.put(ns, blocks) != len(hs):
            raise SystemExit("the host tier did not take every block: lower --host-gib")
        chains.append(hs)
    return chains


def settled(stats: dict) -> bool:
    """Every placement record, with its checksum, and every disk write is done (what a kill keeps)."""
    host, disk = stats["tiers"]["host"], stats["tiers"]["disk"]
    return (host.get("pending_records", 0) == 0 and host.get("unchecked_records", 0) == 0
            and disk.get("pending_writes", 0) == 0)


def run_case(tmp: str, case: str, sig: int, host_gib: float, disk: bool, block: int) -> dict:
    folder = tempfile.mkdtemp(dir=tmp)
    host = str(int(host_gib * 1024) * MiB)
    page = str(min(block, 256 << 10))
    extra = ["--no-persistent-host"] if case == "before" else []
    if disk:
        extra += ["--disk-path", os.path.join(folder, "disk"), "--disk-bytes", host]
    d = start_daemon(folder, *extra, host_bytes=host, page_bytes=page, disk=disk)
    n = int(host_gib * 1024) * MiB // block
    base = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
    NS = namespace(block)
    try:
        with KVClient(d.socket_path, timeout_s=120) as c:
            ns = c.register(NS)
            chains = fill(c, ns, n, base)
            while not settled(c.stats()):
                time.sleep(0.05)
        t0 = time.perf_counter()
        d.proc.send_signal(sig)
        d.proc.wait(timeout=600)
        stop_s = time.perf_counter() - t0
        d.cleanup(keep_arena=True)
        t1 = time.perf_counter()
        d = start_daemon(folder, *extra, host_bytes=host, page_bytes=page, disk=disk, name=d.name)
        ready = time.perf_counter()
        start_s = ready - t1
        with KVClient(d.socket_path, timeout_s=120) as c:
            ns = c.register(NS)
            at_ready = sum(c.lookup(ns, hs).hits for hs in chains)
            while "recovery" in c.stats():
                time.sleep(0.01)
            recovered_s = time.perf_counter() - ready
            tiers = [t for hs in chains for t in c.lookup(ns, hs).tiers]
            t2 = time.perf_counter()
            out = np.empty((CHAIN, block), dtype=np.uint8)
            for ci, hs in enumerate(chains):
                found = c.get_into(ns, hs, out[: len(hs)])
                for j in range(len(hs)):
                    i = ci * CHAIN + j
                    if found[j] and (int.from_bytes(out[j, :8].tobytes(), "little") != i
                                     or not np.array_equal(out[j, 8:], base[8:])):
                        raise SystemExit(f"block {i} came back with different bytes")
            read_s = time.perf_counter() - t2
            problems = d.check()
        return {
            "case": case, "signal": signal.Signals(sig).name, "disk": disk, "host_gib": host_gib, "blocks": n,
            "block_bytes": block, "stop_s": round(stop_s, 3), "start_s": round(start_s, 3),
            "stop_to_serving_s": round(stop_s + start_s, 3), "kept_at_ready": at_ready,
            "recovered_s": round(recovered_s, 3), "kept": len(tiers), "kept_host": tiers.count("host"), "kept_disk": tiers.count("disk"),
            "read_back_s": round(read_s, 3), "check_problems": len(problems),
        }
    finally:
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host-gib", type=float, default=4.0)
    ap.add_argument("--block-kib", type=int, default=2048, help="block size, a multiple of 64 KiB")
    ap.add_argument("--cases", default="before,after")
    ap.add_argument("--signals", default="TERM,KILL")
    ap.add_argument("--disk", action="store_true", help="also run each case with a disk tier as large as the host tier")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.block_kib <= 0 or args.block_kib % 64:
        ap.error("--block-kib must be a positive multiple of 64")
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_DIR")) as tmp:
        for disk in ([False, True] if args.disk else [False]):
            for case in args.cases.split(","):
                for name in args.signals.split(","):
                    row = run_case(tmp, case, getattr(signal, f"SIG{name}"), args.host_gib, disk, args.block_kib << 10)
                    rows.append(row)
                    if not args.json:
                        print(row, flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
