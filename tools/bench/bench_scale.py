"""Scale benchmark: how the daemon's memory, lookups, per-block work and restart grow with the blocks it indexes.

For each size N (10^4, 10^5, 10^6, 10^7 blocks; `--max-blocks` stops at N) one
daemon in its own process (the default policy unless `--policy`) is filled
with N blocks of 4 KiB in chains of `--chain` (512): a host tier of
min(N, `--host-blocks`) blocks over a disk tier that holds the rest, both on
4 KiB pages, so that 10^6 blocks take 4 GiB of disk and the index, not the
bytes, is what grows. The host tier keeps the newest chains; its victims move
down to the disk tier. Then, against that daemon:

- `rss_bytes_per_block`: the daemon's anonymous resident memory (`RssAnon`:
  not the arena, which is shared memory, nor LMDB's file maps) after the fill
  less before it, over N; `staging_held_bytes`: what of it the disk tier's
  staging buffers hold (a fixed budget, trimmed to 64 MiB once idle);
- `lookup_p50_ms` / `lookup_p99_ms`: single-client `lookup`s of 32 blocks, a
  random 32-block piece of a random chain each (every block present, in the
  host or the disk tier), `--lookups` of them; with Mooncake installed, the
  same number of `batch_is_exist` calls of 32 keys against a
  `mooncake_master` holding N keys, interleaved one by one
  (`lookups_vs_mooncake`: our lookups per second over theirs); the client
  polls for each reply for `--client-spin-us` before it sleeps (KVClient's
  `spin_us`, `client_spin_us` in the row; Mooncake's client does not poll);
- `read_us_per_block`: bench_control_plane's read, a `lookup` of every
  `--batch` blocks then one pipelined `get_into` of them, of chains the host
  tier holds; median of `--rounds` rounds, wall microseconds per block;
- `write_full_us_per_block`: a pipelined `put` of new chains into the full
  daemon, `--batch` per request (every request evicts from the host tier into
  the disk tier, which evicts in turn); median of the rounds;
  `write_full_disk`: the disk tier's block writes, fsyncs and backpressure
  waits (a demotion that waited for the disk writer to free staging room)
  during those rounds;
- with `--churn F`, `rss_bytes_per_block_churned`: the same memory figure
  once F x N more blocks (new chains, `churn_blocks`, in `churn_s`) have been
  written through the full daemon, each evicting one: what the policies
  remember of evicted blocks (their ghost tables, up to 16 x the resident
  blocks) is in it, as in a daemon that has run for a while; meanwhile a second
  client looks up 32-block pieces of the sample chains, one every 10 ms, each
  timed from when it was due (`churn_lookups`, `churn_lookup_p50_ms` / `_p99_ms` / `_p999_ms` / `_max_ms`:
  what an engine's lookups wait while the daemon replaces its blocks);
- `gc_longest_pause_ms` / `gc_full_collections`: the daemon's longest cyclic
  collection (its event loop stopped meanwhile) and its full collections,
  over the fill, the measures and the churn, and `gc_pauses` per generation
  (server/daemon.py `GcPauses`); `loop_stalls`: the turns that held its event
  loop 50 ms or more (how many, their total, the longest, and where the latest
  ones past 100 ms were seen: server/stalls.py);
- `restart_s`: SIGTERM -> the old daemon has exited -> the new one prints its
  ready line (`stop_s` + `start_s`), with `kept_at_ready` / `kept` / `sampled`:
  blocks of a sample of chains found right after the ready line (a lookup of
  each chain in turn, `kept_at_ready_s` in all, after one chain held whole
  before the stop alone: `first_lookup_ms`, `first_lookup_hits` of
  `first_lookup_sampled`, as an engine's first request), found once
  the daemon's background recovery is done (`recovered_s` after the start,
  from the ready line to the log line of the disk tier's recovery), against
  found before the stop; `rss_bytes_per_block_restarted`: the restarted
  daemon's anonymous memory per indexed block once its recovery is done, over
  the first daemon's baseline as `rss_bytes_per_block` is, and
  `rss_bytes_per_block_recovering` the most it held while it recovered
  (sampled every 0.1 s until the disk tier's log line): what a restart needs
  beyond what the daemon it replaces held; `all_found_s`: from the start to
  when the sample's chains are all found again (looked up every 0.1 s
  meanwhile: a request adopts what it names, from the records read or, while
  the disk still scans them, from its index one by one, so this is soon after
  the ready line, long before the recovery ends); `recovering_lookups` and their `_p50_ms` ... `_max_ms`:
  another client's lookups meanwhile, as during the churn (above), what an
  engine's lookups wait while the daemon adopts its blocks in steps, and
  `recovering_loop_stalls` the restarted daemon's `loop_stalls` until then;
- `disk_recovery_s`: once that daemon is gone too, the disk tier opened and
  recovered into a store in this process (its index read, every record
  adopted into the block index and its policy; the host arena is not adopted
  here, so the disk blocks under a host block are orphans and freed);
- `memory_parts`: that store's bytes per indexed block, part by part (the
  index's table, entries and keys, the tiers' locations, each policy's table,
  records, history and experts: tools/bench/block_memory.py), over its
  `memory_parts_blocks`: what the resident figure above is made of.

Then a line per goal of the scale work (met or not, with the figure and, for
memory, its largest parts).

With `--json` the last line is a JSON list, one object per size. The disk
tier's folder is made under `KVSTORE_BENCH_DIR` (default: the system's temp
folder); 10^6 blocks take a few minutes and ~5 GiB there, 10^7 ten times that.

    python tools/bench/bench_scale.py [--json] [--max-blocks 1000000] [--policy attention] [--host-blocks 65536]
        [--lookups 3000] [--batch 512] [--rounds 3] [--churn 0] [--event-loop auto] [--client-spin-us 100] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from kvstore.client import SPIN_US, KVClient  # noqa: E402
from kvstore.config import EVENT_LOOPS  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from kvstore.tools.harness.daemon_proc import DaemonProc, start_daemon  # noqa: E402

BLOCK_BYTES = 4096
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
NS = Namespace("bench-scale", "bf16", 1, 1, 128, 16, BLOCK_BYTES)
LOOKUP = 32  # blocks per lookup
SAMPLE_CHAINS = 256  # chains whose hashes are kept for the lookups and the restart's check
SEGMENT_KEYS = 1 << 19  # keys a mooncake_master segment takes here (its allocator refused the 2^20-th: "insufficient space")


def chain_hashes(seed: int, c: int, length: int) -> list[bytes]:
    """The hashes of chain `c` of one seed: the same every time they are asked for."""
    tokens = np.random.default_rng([seed, c]).integers(0, 2**31, size=length * 16)
    return hash_blocks(tokens, 16)


def chain_lengths(n: int, chain: int) -> list[int]:
    return [min(chain, n - c) for c in range(0, n, chain)]


def put_chains(client: KVClient, ns: str, seed: int, lengths: list[int], batch: int, payload: np.ndarray,
               first: int = 0) -> int:
    """Put chains `first`.. of `seed` (their lengths given), each one `put` of `batch` blocks a request."""
    stored = 0
    for i, length in enumerate(lengths):
        hs = chain_hashes(seed, first + i, length)
        stored += client.put(ns, [(h, p, payload) for h, p in zip(hs, [None] + hs[:-1])], chunk=batch)
    return stored


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes of a process (/proc/<pid>/status, RssAnon)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


def settled(stats: dict) -> bool:
    """Every host placement record with its checksum, and every disk write, is done."""
    host, disk = stats["tiers"]["host"], stats["tiers"].get("disk", {})
    return (host.get("pending_records", 0) == 0 and host.get("unchecked_records", 0) == 0
            and disk.get("pending_writes", 0) == 0)


def poll_until(done, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not {what} in time")
        time.sleep(0.1)


def wait_settled(client: KVClient, timeout_s: float = 600) -> None:
    poll_until(lambda: settled(client.stats()), "write its records down", timeout_s)


def write_config(folder: str, n: int, host_blocks: int, policy: str, event_loop: str = "auto") -> tuple[str, int, int]:
    """A TOML config for a daemon of n blocks: (its path, host blocks, disk blocks). The host tier's
    size is given on the command line (start_daemon's flags override the file)."""
    host = min(n, host_blocks)
    disk = max(n - host, 1024)
    path = os.path.join(folder, "kvstore.toml")
    with open(path, "w") as f:
        f.write(f'policy = "{policy}"\n[disk]\npath = "{os.path.join(folder, "disk")}"\n'
                f'capacity = {disk * BLOCK_BYTES}\npage_size = {BLOCK_BYTES}\n'
                f'[server]\nevent_loop = "{event_loop}"\n')
    return path, host, disk


def lookups(client: KVClient, ns: str, samples: list[list[bytes]], iters: int, mooncake: object,
            mc_keys: list[list[str]] | None) -> dict:
    """32-block lookups of random pieces of the sample chains; interleaved with Mooncake's when given."""
    rng = random.Random(1)
    ours, theirs = [], []
    for i in range(iters + 200):  # the first 200 of each warm up
        c = rng.randrange(len(samples))
        start = rng.randrange(0, max(1, len(samples[c]) - LOOKUP + 1))
        piece = samples[c][start : start + LOOKUP]
        t0 = time.perf_counter()
        hits = client.lookup(ns, piece).hits
        t1 = time.perf_counter()
        if hits != len(piece):
            raise SystemExit(f"a lookup found {hits} of {len(piece)} blocks the daemon holds")
        if mooncake is not None:
            keys = mc_keys[c][start : start + LOOKUP]  # type: ignore[index]
            t2 = time.perf_counter()
            present = mooncake.batch_is_exist(keys)
            t3 = time.perf_counter()
            if list(present) != [1] * len(keys):
                raise SystemExit("mooncake_master is missing keys it was given")
            if i >= 200:
                theirs.append(t3 - t2)
        if i >= 200:
            ours.append(t1 - t0)
    q = statistics.quantiles(ours, n=100)
    out = {"lookup_p50_ms": statistics.median(ours) * 1e3, "lookup_p99_ms": q[98] * 1e3,
           "lookups_per_s": len(ours) / sum(ours)}
    if theirs:
        qm = statistics.quantiles(theirs, n=100)
        out.update(mooncake_p50_ms=statistics.median(theirs) * 1e3, mooncake_p99_ms=qm[98] * 1e3,
                   mooncake_per_s=len(theirs) / sum(theirs), lookups_vs_mooncake=out["lookups_per_s"] * sum(theirs) / len(theirs))
    return out


def host_chains(client: KVClient, ns: str, seed: int, lengths: list[int], want: int) -> list[list[bytes]]:
    """Whole chains the host tier holds, newest first, until `want` blocks."""
    out: list[list[bytes]] = []
    got = 0
    for c in range(len(lengths) - 1, -1, -1):
        hs = chain_hashes(seed, c, lengths[c])
        found = client.lookup(ns, hs)
        if found.hits == len(hs) and all(t == "host" for t in found.tiers):
            out.append(hs)
            got += len(hs)
            if got >= want:
                break
    return out


class LookupsMeanwhile:
    """A second client looking up 32-block pieces of the sample chains, one every EVERY_S (open loop: each
    timed from when it was due, so one that waits behind another counts its wait), in a process of its
    own as an engine is (a thread of this one would wait for this process's GIL behind the churn's
    writer), while the body of the `with` runs (the churn's writes): what an engine's lookups wait while
    the daemon replaces its blocks, collector pauses included (`summary`: p50, p99, p99.9, the longest,
    and how many)."""

    EVERY_S = 0.01

    def __init__(self, socket_path: str, ns: str, samples: list[list[bytes]], spin_us: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._ready = ctx.Event(), ctx.Event()
        self._took, theirs = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_look_up_until, name="bench-scale-lookups", daemon=True,
                                 args=(socket_path, ns, samples, spin_us, self.EVERY_S, self._ready, self._stop, theirs))
        self.took: list[tuple[float, float]] = []

    def __enter__(self) -> LookupsMeanwhile:
        self._proc.start()
        if not self._ready.wait(60):
            self._proc.kill()
            raise RuntimeError("the lookup client did not connect")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._took.poll(120):
            self.took = self._took.recv()
        self._proc.join(10)

    def summary(self, prefix: str) -> dict:
        """Percentiles of the lookups' times from when each was due (`<prefix>_p50_ms` ...), and of their
        own round trips (`<prefix>_service_p50_ms` ...): where the first are much longer, the lookup
        client itself waited for a core."""
        if len(self.took) < 100:
            return {f"{prefix}s": len(self.took)}
        out: dict = {f"{prefix}s": len(self.took)}
        for name, times in (("", [t[0] for t in self.took]), ("_service", [t[1] for t in self.took])):
            q = statistics.quantiles(times, n=1000)
            out.update({f"{prefix}{name}_p50_ms": round(statistics.median(times) * 1e3, 3),
                        f"{prefix}{name}_p99_ms": round(q[989] * 1e3, 3),
                        f"{prefix}{name}_p999_ms": round(q[998] * 1e3, 3),
                        f"{prefix}{name}_max_ms": round(max(times) * 1e3, 3)})
        return out


def _look_up_until(socket_path: str, ns: str, samples: list[list[bytes]], spin_us: float, every_s: float,
                    ready, stop, took) -> None:
    """`LookupsMeanwhile`'s process: look up until `stop` is set, then send the times (s: from when each
    was due, and its round trip) through `took`."""
    rng, out = random.Random(2), []
    with KVClient(socket_path, name="bench-scale-lookups", timeout_s=600, spin_us=spin_us) as client:
        ready.set()
        due = time.perf_counter()
        while not stop.is_set():
            chain = samples[rng.randrange(len(samples))]
            start = rng.randrange(0, max(1, len(chain) - LOOKUP + 1))
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            began = time.perf_counter()
            client.lookup(ns, chain[start : start + LOOKUP])  # (evicted blocks are misses: timed the same)
            end = time.perf_counter()
            out.append((end - due, end - began))
            due += every_s
    took.send(out)


def reads(client: KVClient, ns: str, chains: list[list[bytes]], batch: int, rounds: int) -> float:
    """Median over rounds of wall microseconds per block of a lookup of every `batch` blocks, then a get_into."""
    hashes = [h for hs in chains for h in hs]
    out = np.empty((len(hashes), BLOCK_BYTES), dtype=np.uint8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        hits = sum(client.lookup(ns, hashes[i : i + batch]).hits for i in range(0, len(hashes), batch))
        got = client.get_into(ns, hashes, out, chunk=batch)
        times.append((time.perf_counter() - t0) / len(hashes) * 1e6)
        if hits != len(hashes) or not all(got):
            raise SystemExit("a read missed blocks the host tier holds")
    return statistics.median(times)


def mooncake_with(n: int, seed: int, lengths: list[int], sample_ids: list[int], tmp: str, ns: str):
    """A mooncake_master holding n keys (the blocks' names) in segments of at most SEGMENT_KEYS, one client
    a segment (the first one puts and looks up), and the sample chains' keys: (master, clients, keys, "");
    (None, None, None, why) where Mooncake cannot load or take them."""
    try:
        from kvstore.tiers.remote import RemoteUnavailable, load_mooncake, master_binary

        mc = load_mooncake()
        master_binary()
    except (ImportError, RemoteUnavailable) as exc:
        return None, None, None, f"no Mooncake client here: {exc}"
    from kvstore.tools.harness.remote_env import Master

    master = Master(log_path=os.path.join(tmp, "master.log")).start()
    stores: list = []

    def failed(why: str) -> tuple:
        for s in stores:
            s.close()
        master.kill()
        return None, None, None, why

    segments = -(-n // SEGMENT_KEYS)
    per = -(-n // segments)  # (the keys spread evenly over the segments)
    for _ in range(segments):
        stores.append(mc.MooncakeDistributedStore())
        rc = stores[-1].setup("127.0.0.1", "P2PHANDSHAKE", max(64 << 20, per * 128), 16 << 20, "tcp", "",
                              f"127.0.0.1:{master.port}")
        if rc != 0:
            return failed(f"Mooncake setup failed (code {rc})")
    store, value = stores[0], b"\0" * 64
    keys_of = lambda c: [f"kvstore/v1/{ns}/{h.hex()}" for h in chain_hashes(seed, c, lengths[c])]  # noqa: E731
    for c in range(len(lengths)):
        keys = keys_of(c)
        for i in range(0, len(keys), 512):
            part = keys[i : i + 512]
            rcs = store.put_batch(part, [value] * len(part))
            if rcs != 0 and (not isinstance(rcs, list) or any(rcs)):
                return failed("Mooncake put_batch failed")
    return master, stores, [keys_of(c) for c in sample_ids], ""


def disk_recovery(folder: str, disk_blocks: int, policy: str) -> dict:
    """Seconds to open the disk tier left in `folder` and recover it into a store (this process), and where
    that store's memory a block goes (block_memory.py), the blocks it measured."""
    from kvstore.store import TieredStore
    from kvstore.tools.bench.block_memory import parts
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.host import HostArena

    host = HostArena(f"/dev/shm/kvstore-bench-scale-{os.getpid()}", 64 * BLOCK_BYTES, BLOCK_BYTES, prefault=False)
    t0 = time.perf_counter()
    disk = DiskTier(os.path.join(folder, "disk"), disk_blocks * BLOCK_BYTES, BLOCK_BYTES)
    store = TieredStore([host, disk], policy=policy)
    wait = getattr(store, "wait_recovered", None)  # a store that recovers in the background
    if wait is not None:
        wait()
    elapsed = time.perf_counter() - t0
    resting = getattr(store, "resting", None)  # (the blocks at rest, as the daemon's sweep leaves them)
    if resting is not None:
        resting.sweep(len(resting.arrived))
    try:
        return {"disk_recovery_s": round(elapsed, 3),
                "memory_parts_blocks": len(store.index.entries) + len(resting or ()),
                "memory_parts": parts(store) if store.index.entries else {}}
    finally:
        store.close(persist=False)
        host.close()


def run_size(tmp: str, n: int, args: argparse.Namespace) -> dict:
    folder = tempfile.mkdtemp(dir=tmp)
    config, host_blocks, disk_blocks = write_config(folder, n, args.host_blocks, args.policy, args.event_loop)
    lengths = chain_lengths(n, args.chain)
    payload = np.ones(BLOCK_BYTES, np.uint8)
    rng = random.Random(n)
    sample_ids = sorted(rng.sample(range(len(lengths)), min(SAMPLE_CHAINS, len(lengths))))
    row: dict = {"blocks": n, "host_blocks": host_blocks, "disk_blocks": disk_blocks, "policy": args.policy,
                 "event_loop": args.event_loop, "client_spin_us": args.client_spin_us}
    # The socket in a short folder of its own: under a long KVSTORE_BENCH_DIR (or a test's temporary
    # folder) its path would pass AF_UNIX's limit.
    sockets = tempfile.mkdtemp(prefix="kvs-")
    flags = dict(host_bytes=str(host_blocks * BLOCK_BYTES), page_bytes=str(BLOCK_BYTES), admin=False, disk=True,
                 socket_path=os.path.join(sockets, "d.sock"))
    d: DaemonProc = start_daemon(folder, "--config", config, **flags)
    try:
        with KVClient(d.socket_path, name="bench-scale", timeout_s=600, spin_us=args.client_spin_us) as client:
            ns = client.register(NS)
            time.sleep(0.5)  # the disk writer prefaults its staging buffers for the namespace
            rss0 = rss_anon(d.proc.pid)
            t0 = time.perf_counter()
            stored = put_chains(client, ns, 1, lengths, args.batch, payload)
            row["fill_s"] = round(time.perf_counter() - t0, 1)
            wait_settled(client)
            st = client.stats()
            row["indexed_blocks"] = st["blocks"]
            if stored != n or st["blocks"] != n:
                raise SystemExit(f"the daemon holds {st['blocks']} of {n} blocks ({stored} stored)")
            row["rss_bytes_per_block"] = round((rss_anon(d.proc.pid) - rss0) / n, 1)
            row["staging_held_bytes"] = st["tiers"]["disk"].get("staging_held_bytes", 0)  # in that RSS, not per block
            samples = [chain_hashes(1, c, lengths[c]) for c in sample_ids]
            master = mc_stores = None
            mc_keys = None
            if args.mooncake:
                master, mc_stores, mc_keys, why = mooncake_with(n, 1, lengths, sample_ids, folder, ns)
                if why:
                    row["mooncake_skipped"] = why
            try:
                row.update(lookups(client, ns, samples, args.lookups, mc_stores[0] if mc_stores else None, mc_keys))
            finally:
                for mc_store in mc_stores or ():
                    mc_store.close()
                if master is not None:
                    master.kill()
            read_blocks = max(args.batch, min(8192, host_blocks // 2) // args.batch * args.batch)
            chains = host_chains(client, ns, 1, lengths, read_blocks)
            row["read_us_per_block"] = round(reads(client, ns, chains, args.batch, args.rounds), 2)
            write_blocks = read_blocks
            disk0 = client.stats()["tiers"]["disk"]
            times = []
            for r in range(args.rounds):
                t = time.perf_counter()
                if put_chains(client, ns, 100 + r, chain_lengths(write_blocks, args.chain), args.batch, payload) \
                        != write_blocks:
                    raise SystemExit("a full-tier write stored fewer blocks than it put")
                times.append((time.perf_counter() - t) / write_blocks * 1e6)
            row["write_full_us_per_block"] = round(statistics.median(times), 2)
            disk1 = client.stats()["tiers"]["disk"]
            row["write_full_disk"] = {k: disk1.get(k, 0) - disk0.get(k, 0)  # what the disk tier did meanwhile
                                      for k in ("writes", "fsyncs", "backpressure_waits")}
            wait_settled(client)
            if args.churn:  # written through: the policies' history fills, as a long-running daemon's does
                t0 = time.perf_counter()
                with LookupsMeanwhile(d.socket_path, ns, samples, args.client_spin_us) as meanwhile:
                    row["churn_blocks"] = put_chains(client, ns, 200, chain_lengths(int(args.churn * n), args.chain),
                                                     args.batch, payload)
                row["churn_s"] = round(time.perf_counter() - t0, 1)
                row.update(meanwhile.summary("churn_lookup"))
                wait_settled(client)
                held = client.stats()["blocks"]
                row["rss_bytes_per_block_churned"] = round((rss_anon(d.proc.pid) - rss0) / held, 1)
            stats = client.stats()
            if "event_loop_stalls" in stats:  # (server/stalls.py)
                row["loop_stalls"] = stats["event_loop_stalls"]
            pauses = stats.get("gc", {}).get("pauses")
            if pauses:
                row["gc_longest_pause_ms"] = max(p["longest_ms"] for p in pauses)
                row["gc_full_collections"] = pauses[2]["collections"]
                row["gc_pauses"] = pauses  # per generation: collections, longest_ms, total_s
            found = [client.lookup(ns, hs).hits for hs in samples]
            before = sum(found)
            first = next((hs for hs, hits in zip(samples, found) if hits == len(hs)), samples[0])  # (one held whole)
        t0 = time.perf_counter()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=600)
        stop_s = time.perf_counter() - t0
        d.cleanup(keep_arena=True)
        log = os.path.join(folder, "restart.log")
        t1 = time.perf_counter()
        d = start_daemon(folder, "--config", config, "--log-level", "INFO", name=d.name, log_path=log, **flags)
        start_s = time.perf_counter() - t1
        with KVClient(d.socket_path, name="bench-scale", timeout_s=600, spin_us=args.client_spin_us) as client:
            ns = client.register(NS)
            t2 = time.perf_counter()
            first_hits = client.lookup(ns, first).hits  # one chain, as an engine's first request
            first_s = time.perf_counter() - t2
            kept_at_ready = sum(client.lookup(ns, hs).hits for hs in samples)
            kept_at_ready_s = time.perf_counter() - t2
            peak, found_s = rss_anon(d.proc.pid), None
            with LookupsMeanwhile(d.socket_path, ns, samples, args.client_spin_us) as meanwhile:
                while "disk tier: recovered" not in open(log).read():  # (the moment the log line is written)
                    time.sleep(0.1)
                    peak = max(peak, rss_anon(d.proc.pid))
                    if found_s is None and sum(client.lookup(ns, hs).hits for hs in samples) == before:
                        found_s = time.perf_counter() - t1
            recovered_s = time.perf_counter() - t1
            row.update(meanwhile.summary("recovering_lookup"))
            kept = sum(client.lookup(ns, hs).hits for hs in samples)
            poll_until(lambda: "recovery" not in client.stats(), "finish its recovery")  # (after its log line)
            stats = client.stats()
            blocks = stats["blocks"]
            if "event_loop_stalls" in stats:
                row["recovering_loop_stalls"] = stats["event_loop_stalls"]
            restarted = (rss_anon(d.proc.pid) - rss0) / blocks  # (the first daemon's baseline)
        row.update(stop_s=round(stop_s, 3), start_s=round(start_s, 3), restart_s=round(stop_s + start_s, 3),
                   kept_at_ready=kept_at_ready, kept_at_ready_s=round(kept_at_ready_s, 3),
                   first_lookup_ms=round(first_s * 1e3, 2), first_lookup_hits=first_hits,
                   first_lookup_sampled=len(first), kept=kept, sampled=before, recovered_s=round(recovered_s, 3),
                   rss_bytes_per_block_restarted=round(restarted, 1),
                   rss_bytes_per_block_recovering=round((peak - rss0) / blocks, 1),
                   all_found_s=round(found_s if found_s is not None else recovered_s, 3))
    finally:
        d.stop(timeout=600)
        shutil.rmtree(sockets, ignore_errors=True)
    row.update(disk_recovery(folder, disk_blocks, args.policy))
    return row


def goals(rows: list[dict]) -> list[str]:
    """A line per goal, judged at the largest size run (lookups against the smallest's)."""
    top, base = rows[-1], rows[0]
    at = f"at {top['blocks']:,} blocks"

    def line(met: bool | None, text: str) -> str:
        return f"  [{'not run' if met is None else 'met' if met else 'NOT met'}] {text}"

    largest = sorted(((v, k) for k, v in top.get("memory_parts", {}).items() if k != "total"), reverse=True)[:4]
    out = ["goals:", line(top["rss_bytes_per_block"] <= 200, f"<= 200 B of daemon memory a block {at}: "
                      f"{top['rss_bytes_per_block']:.0f} B; largest parts " + ", ".join(f"{k} {v:.0f}" for v, k in largest))]
    ratio = top["lookup_p99_ms"] / base["lookup_p99_ms"]
    out.append(line(ratio <= 1.2 if len(rows) > 1 else None, f"32-block lookup p99 {at} within 1.2x of at "
                    f"{base['blocks']:,}: " + (f"{ratio:.2f}x" if len(rows) > 1 else "one size run")))
    vs = [r["lookups_vs_mooncake"] for r in rows if "lookups_vs_mooncake" in r]
    out.append(line(min(vs) >= 1.2 if vs else None, "lookups >= 1.2x mooncake_master's: "
                    + (", ".join(f"{v:.2f}x" for v in vs) if vs else "no mooncake_master in this run")))
    parts = ("the default policy's bookkeeping and the store core, per block in Python: bench_control_plane.py's goal "
             "lines split them against LRU in one run")
    read, write, disk = top["read_us_per_block"], top["write_full_us_per_block"], top.get("write_full_disk") or {}
    out.append(line(read <= 4, f"reads <= 4 us a block {at}: {read:.2f} us" + ("" if read <= 4 else f" ({parts})")))
    out.append(line(write <= 8, f"full-tier writes <= 8 us a block {at}: {write:.1f} us" + ("" if write <= 8 else
                    f" (each also demotes a block into the disk tier and evicts one from it: {disk.get('writes', 0):,} "
                    f"disk writes and {disk.get('fsyncs', 0):,} fsyncs in these rounds; the rest is {parts})")))
    slowest = max(r["restart_s"] for r in rows)
    out.append(line(slowest < 1, f"restart (stop to serving) < 1 s at every size: {slowest:.3f} s at most"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="the last line is a JSON list, one object per size")
    ap.add_argument("--max-blocks", type=int, default=SIZES[-1], help="stop at this many blocks")
    ap.add_argument("--min-blocks", type=int, default=SIZES[0], help="start at this many blocks")
    ap.add_argument("--policy", default="attention")
    ap.add_argument("--host-blocks", type=int, default=65536, help="the host tier's blocks at most (4 KiB each)")
    ap.add_argument("--chain", type=int, default=512, help="blocks per chain")
    ap.add_argument("--batch", type=int, default=512, help="blocks per request")
    ap.add_argument("--lookups", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client-spin-us", type=float, default=SPIN_US,
                    help="how long the client polls for a reply before it sleeps (KVClient spin_us; 0: it sleeps)")
    ap.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                    help="the daemon's [server] event_loop")
    ap.add_argument("--churn", type=float, default=0.0,
                    help="after the per-block figures, write this many times N more blocks through the full "
                         "daemon and report its memory per indexed block again")
    ap.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                    help="no lookups against mooncake_master")
    args = ap.parse_args(argv)
    sizes = [n for n in SIZES if args.min_blocks <= n <= args.max_blocks]
    if not sizes:
        ap.error(f"--max-blocks must be at least {SIZES[0]}")
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_DIR")) as tmp:
        for n in sizes:
            row = run_size(tmp, n, args)
            rows.append(row)
            if not args.json:
                print(row, flush=True)
    for line in goals(rows):
        print(line)
    if not args.json:
        base = rows[0]
        for row in rows[1:]:
            print(f"{row['blocks']:>10,} blocks: lookup p99 {row['lookup_p99_ms'] / base['lookup_p99_ms']:.2f}x "
                  f"of {base['blocks']:,}'s, restart {row['restart_s']:.2f} s, "
                  f"{row['rss_bytes_per_block']:.0f} B a block")
    else:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
