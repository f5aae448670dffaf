"""Benchmark: the remote tier through two daemons vs Mooncake's own Python client, same run, same payloads.

Two "hosts" are network namespaces joined by a veth pair (as tools/harness/remote_env.py
makes them; root needed, else the run stops with the reason), a real
`mooncake_master` runs on host A. Payload: `--blocks` blocks of `--block-bytes`
(default 128 x 2 MiB) in one namespace.

Arms (medians over `--repeats`, fresh keys for every put):
* peer put: a Mooncake client process on host A, `batch_put_from_multi_buffers` of the
  payload from a registered buffer (one replica, preferred in its own segment,
  as the daemon publishes), one call;
* daemon put: a local client puts the blocks into daemon A's arena; timed until
  daemon A reports all of them published (write-behind, batched);
* peer get: a Mooncake client process on host B, `batch_get_into` of the peer
  keys into a registered buffer, one call;
* daemon get: a local client of daemon B acquires the blocks (one batched
  existence query, one batched fetch into B's arena, header and xxh3 verified),
  i.e. they are ready for an engine to read; then releases them and removes
  B's local copies so the next repeat fetches again.
Ratios are peer time / daemon time (>= 1 would mean the daemon adds nothing).

`--compression PROFILE` (a codec profile: built-in `k4v2`, ..., or a file in
tools/bench/profiles): both daemons run with `[compression] remote = true`, and
each repeat adds the daemon put and get of `--blocks` SmolLM2-shaped blocks
(bf16 normal values, `--codec-block-tokens` tokens each) twice: in a namespace
that did not opt in (exact) and in one that opted into PROFILE (published
encoded by A's put thread, decoded by B's get thread). Reported in KV bytes
(the blocks' own size) per second, and compressed / exact.

`--link-rate RATE` (tc's units, e.g. 10gbit) shapes the veth pair like a NIC of
that speed; unshaped it runs at memory speed, faster than any network.

`--vllm`: TTFT of a prompt (default 8000 tokens) on an engine of host B when
the prefix is: cold (no connector), a remote hit (an engine on host A computed
it; B's daemon fetches it from the cluster), a host hit (the same prefix again,
now in B's arena). One OpenMP thread per engine, SmolLM2-135M, block size 128.

    python tools/bench/bench_remote.py [--blocks 128] [--block-bytes 2MiB] [--repeats 5] [--vllm]
        [--compression PROFILE] [--link-rate 10gbit] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from kvstore.config import parse_size  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tools.harness.remote_env import Master, limit_link, make_hosts, remote_config, remove_hosts  # noqa: E402
from kvstore.tools.harness.daemon_proc import start_daemon  # noqa: E402

PEER = r"""
import json, sys, time, mmap, ctypes
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvstore.tiers.remote import load_mooncake
mc = load_mooncake()
role, master, n, size = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = mc.MooncakeDistributedStore()
import socket
host, port = master.split("//")[-1].split(":")
with socket.create_connection((host, int(port))) as probe:
    me = probe.getsockname()[0]
repeats = int(sys.argv[6])
seg = n * size * (repeats + 1) + (64 << 20) if role == "put" else 64 << 20
assert s.setup(me, "P2PHANDSHAKE", seg, 64 << 20, "tcp", "", f"{host}:{port}") == 0
buf = mmap.mmap(-1, n * size)
arr = np.frombuffer(buf, dtype=np.uint8)
arr[:] = np.random.default_rng(0).integers(0, 256, arr.size, dtype=np.uint8)
assert s.register_buffer(arr.ctypes.data, arr.nbytes) == 0
cfg = mc.ReplicateConfig(); cfg.replica_num = 1; cfg.prefer_alloc_in_same_node = True
ptrs = [arr.ctypes.data + i * size for i in range(n)]
print("READY", flush=True)
for line in sys.stdin:
    cmd, tag = line.split()
    keys = [f"peer/{tag}/{i}" for i in range(n)]
    t0 = time.perf_counter()
    if cmd == "put":
        # (batch_put_from answers -600 with prefer_alloc_in_same_node; the multi-buffer form does not)
        codes = s.batch_put_from_multi_buffers(keys, [[p] for p in ptrs], [[size]] * n, cfg)
        ok = all(c == 0 for c in codes) or sorted(set(codes))
    else:
        got = s.batch_get_into(keys, ptrs, [size] * n)
        ok = all(g == size for g in got) or sorted(set(got))
    print(json.dumps({"s": time.perf_counter() - t0, "ok": ok}), flush=True)
"""


class Peer:
    def __init__(self, prefix: tuple, role: str, master: str, n: int, size: int, repeats: int) -> None:
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", PEER, str(REPO), role, master, str(n), str(size),
                                      str(repeats)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        assert self.proc.stdout.readline().startswith("READY")  # type: ignore[union-attr]

    def run(self, cmd: str, tag: str) -> float:
        self.proc.stdin.write(f"{cmd} {tag}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        r = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        if r["ok"] is not True:
            raise RuntimeError(f"Mooncake's own {cmd} failed: codes {r['ok']}")
        return r["s"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def chain(ns_block_bytes: int, seed: int, n: int):
    from kvstore.keys import hash_blocks

    hs = hash_blocks(np.arange(n * 16) + seed * 1_000_000, 16)
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, ns_block_bytes, dtype=np.uint8) for _ in range(n)]
    return hs, [None] + hs[:-1], payloads


def published(client) -> int:
    """Over the daemon's socket (its admin port is in another network namespace)."""
    return client.stats()["counters"].get("remote_published_blocks", 0)


def daemon_round(ca, cb, ns: str, hs: list, parents: list, payloads: list, check: bool) -> tuple[float, float]:
    """(put s, get s) of one chain through the daemons: A's put until published, B's acquire from the
    cluster; then B forgets its copies, so the next round fetches again."""
    n = len(hs)
    before = published(ca)
    t0 = time.perf_counter()
    assert ca.put(ns, list(zip(hs, parents, payloads))) == n
    while published(ca) < before + n:
        time.sleep(0.0005)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ext = cb.acquire(ns, hs)
    get_s = time.perf_counter() - t0
    assert all(e is not None for e in ext), "daemon B did not get every block"
    if check:  # the bytes are right (checked once, outside the timing)
        got = cb.get(ns, hs[:4])
        assert all(np.array_equal(g, p) for g, p in zip(got, payloads[:4]))
    cb.release(ns, hs)
    cb.remove(ns, hs[:1])
    return put_s, get_s


def codec_rounds(args, ca, cb, out: dict) -> dict:
    """The exact and compressed arms on SmolLM2-shaped blocks (`--compression`), appended to `out`."""
    from kvstore.codec import from_float32
    from kvstore.compression import Compression
    from kvstore.config import CompressionConfig
    from kvstore.tools.bench.bench_disk import PROFILES, codec_namespace

    spec = {"exact": codec_namespace(args.codec_block_tokens), "codec": codec_namespace(args.codec_block_tokens,
                                                                                       args.compression)}
    codec = Compression(CompressionConfig(remote=True, profile_dir=PROFILES)).codec(spec["codec"])
    size = spec["exact"].block_bytes
    rng = np.random.default_rng(7)
    payloads = [from_float32(rng.standard_normal(size // 2, np.float32), "bfloat16") for _ in range(args.blocks)]
    for r in range(args.repeats):
        for arm, ns_def in spec.items():
            ns = ca.register(ns_def)
            cb.register(ns_def)
            hs, parents, _ = chain(16, 1000 + r * 2 + (arm == "codec"), args.blocks)
            put_s, get_s = daemon_round(ca, cb, ns, hs, parents, payloads, check=arm == "exact" and r == 0)
            out.setdefault(f"{arm}_put_s", []).append(put_s)
            out.setdefault(f"{arm}_get_s", []).append(get_s)
    gb = args.blocks * size / 1e9
    med = {k: statistics.median(out[k]) for k in ("exact_put_s", "exact_get_s", "codec_put_s", "codec_get_s")}
    return {"profile": args.compression, "block_bytes": size, "codec_ratio": round(size / codec.stored_bytes, 3),
            "put_exact_kv_GBps": gb / med["exact_put_s"], "put_kv_GBps": gb / med["codec_put_s"],
            "get_exact_kv_GBps": gb / med["exact_get_s"], "get_kv_GBps": gb / med["codec_get_s"],
            "put_vs_exact": med["exact_put_s"] / med["codec_put_s"],
            "get_vs_exact": med["exact_get_s"] / med["codec_get_s"]}


def transfers(args, a, b, master, da, db) -> dict:
    n, size = args.blocks, args.block_bytes
    ns_def = Namespace("bench-remote", "bfloat16", 1, 1, 1, 16, size)
    peer_a = Peer(a.prefix, "put", master.url, n, size, args.repeats)
    peer_b = Peer(b.prefix, "get", master.url, n, size, args.repeats)
    out: dict[str, list[float]] = {"peer_put_s": [], "daemon_put_s": [], "peer_get_s": [], "daemon_get_s": []}
    try:
        with da.client(timeout_s=120) as ca, db.client(timeout_s=120) as cb:
            ns = ca.register(ns_def)
            cb.register(ns_def)
            for r in range(args.repeats):
                out["peer_put_s"].append(peer_a.run("put", f"r{r}"))
                out["peer_get_s"].append(peer_b.run("get", f"r{r}"))
                hs, parents, payloads = chain(size, r, n)
                put_s, get_s = daemon_round(ca, cb, ns, hs, parents, payloads, check=r == 0)
                out["daemon_put_s"].append(put_s)
                out["daemon_get_s"].append(get_s)
            codec = codec_rounds(args, ca, cb, out) if args.compression else None
    finally:
        peer_a.close()
        peer_b.close()
    res = {k: statistics.median(v) for k, v in out.items()}
    res["all"] = out
    gb = n * size / 1e9
    res["peer_put_GBps"], res["daemon_put_GBps"] = gb / res["peer_put_s"], gb / res["daemon_put_s"]
    res["peer_get_GBps"], res["daemon_get_GBps"] = gb / res["peer_get_s"], gb / res["daemon_get_s"]
    res["put_vs_mooncake"] = res["peer_put_s"] / res["daemon_put_s"]
    res["get_vs_mooncake"] = res["peer_get_s"] / res["daemon_get_s"]
    if codec is not None:
        res["codec"] = codec
    return res


def vllm_ttft(args, work: str, da, db) -> dict:
    from kvstore.tools.harness.vllm_helpers import build_model, connector_config, corpus_text, engine_spec, run_engine, tokenize
    from kvstore.tools.bench.bench_vllm import BLOCK, TAIL

    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(80000))
    while len(ids) < (args.repeats + 3) * args.length + 2000:
        ids = ids + ids
    n = args.length

    def one(p, label, reset=True):
        return {"prompts": [{"ids": p}], "max_tokens": 1, "reset_prefix_cache": reset, "label": label}

    def engine(runs, daemon=None):
        kvt = connector_config(daemon.socket_path) if daemon is not None else None
        spec = engine_spec(model, runs, dtype="bfloat16", block_size=BLOCK, kv_cache_memory_bytes=1 << 30,
                           max_model_len=8192, max_num_batched_tokens=8192, kv_transfer_config=kvt)
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return run_engine(spec, work, threads=1, timeout_s=3000, env_extra=env)

    prompts = [ids[i * n : (i + 1) * n] for i in range(args.vllm_repeats)]
    tails = [p[:-TAIL] + ids[-TAIL - 1 - i : -1 - i] for i, p in enumerate(prompts)]
    warm_p = ids[-n - 1500 : -1500]
    warm = [one(warm_p, "warm"), one(warm_p[:-TAIL] + ids[:TAIL], "warm")]
    cold_runs = warm + [one(p, "cold") for p in prompts[:1]]
    cold = engine(cold_runs)
    engine(warm + [one(p, "save") for p in prompts], da)  # host A computes and publishes
    with da.client() as ca:
        want, deadline = ca.stats()["blocks"], time.monotonic() + 120
        while published(ca) < want and time.monotonic() < deadline:
            time.sleep(0.2)
    runs = list(warm)
    for t in tails:
        runs += [one(t, "remote"), one(t, "host")]  # first from the cluster, then from B's own arena
    load = engine(runs, db)

    def walls(res, spec, label):
        return [r["wall_s"] for r, s in zip(res.runs, spec) if s["label"] == label]

    cached = [r["outputs"][0]["num_cached_tokens"] for r, s in zip(load.runs, runs) if s["label"] == "remote"]
    with db.client() as cb:
        promotions = cb.stats()["counters"].get("remote_promotions", 0)
    out = {"prompt_tokens": n, "ttft_cold_s": statistics.median(walls(cold, cold_runs, "cold")),
           "ttft_remote_hit_s": statistics.median(walls(load, runs, "remote")),
           "ttft_host_hit_s": statistics.median(walls(load, runs, "host")),
           "all_remote_hit_s": walls(load, runs, "remote"), "all_host_hit_s": walls(load, runs, "host"),
           "remote_cached_tokens": cached, "expected_cached_tokens": (n - 1) // BLOCK * BLOCK,
           "remote_promotions": promotions}
    out["remote_hit_vs_cold"] = out["ttft_remote_hit_s"] / out["ttft_cold_s"]
    out["remote_hit_vs_host_hit"] = out["ttft_remote_hit_s"] / out["ttft_host_hit_s"]
    return out


def codec_block_bytes(args) -> int:
    from kvstore.tools.bench.bench_disk import codec_namespace

    return codec_namespace(args.codec_block_tokens).block_bytes


def bench(args) -> dict:
    import pytest

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        hosts = make_hosts()
    except pytest.skip.Exception as exc:
        raise SystemExit(f"bench_remote: {exc}") from None
    a, b = hosts
    if args.link_rate:
        limit_link(hosts, args.link_rate)
    master = Master(a.prefix, a.addr, log_path=work / "master.log").start()
    daemons = []
    try:
        seg = max(args.blocks * args.block_bytes * (args.repeats + 1), 1 << 30)
        if args.compression:  # room for the exact arm's SmolLM2 blocks too
            seg += args.blocks * codec_block_bytes(args) * (args.repeats + 1)
        cfg = remote_config(work / "remote.toml", master, segment_size=seg, transfer_timeout=120.0)
        if args.compression:
            from kvstore.tools.bench.bench_disk import PROFILES

            with open(cfg, "a") as f:
                f.write(f"[compression]\nremote = true\nprofile_dir = {json.dumps(PROFILES)}\n")
        host_bytes = str(max(4 * args.blocks * args.block_bytes, 2 << 30))
        for name, h in (("benchA", a), ("benchB", b)):
            daemons.append(start_daemon(work, "--config", cfg, name=name, prefix=h.prefix, host_bytes=host_bytes,
                                        page_bytes="256KiB", log_path=str(work / f"{name}.log")))
        da, db = daemons
        res = {"blocks": args.blocks, "block_bytes": args.block_bytes, "repeats": args.repeats,
               "link": f"veth between two network namespaces, TCP, {args.link_rate or 'unshaped'}", **transfers(args, a, b, master, da, db)}
        if args.vllm:
            res["vllm"] = vllm_ttft(args, str(work), da, db)
        return res
    finally:
        for d in daemons:
            d.stop()
        master.kill()
        remove_hosts(hosts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-bytes", type=lambda v: parse_size(v, "--block-bytes"), default=2 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vllm", action="store_true", help="also TTFT of an engine on host B: cold, remote hit, host hit")
    p.add_argument("--length", type=int, default=8000, help="--vllm prompt tokens")
    p.add_argument("--vllm-repeats", type=int, default=3, help="--vllm prompts (one remote and one host hit each)")
    p.add_argument("--compression", default="", metavar="PROFILE",
                   help="add exact and compressed daemon arms on SmolLM2-shaped blocks with this codec profile")
    p.add_argument("--codec-block-tokens", type=int, default=128, help="tokens per block of the codec arms")
    p.add_argument("--link-rate", default="", help="shape the link between the hosts (tc rate, e.g. 10gbit)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = bench(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{args.blocks} x {args.block_bytes >> 10} KiB over {res['link']}")
        for op in ("put", "get"):
            print(f"  {op}: Mooncake's client {res[f'peer_{op}_GBps']:.2f} GB/s, through the daemons "
                  f"{res[f'daemon_{op}_GBps']:.2f} GB/s -> {res[f'{op}_vs_mooncake']:.2f}x")
        if "codec" in res:
            c = res["codec"]
            print(f"  {c['block_bytes'] >> 10} KiB SmolLM2 blocks, {c['profile']} at {c['codec_ratio']}x, KV GB/s: put "
                  f"{c['put_exact_kv_GBps']:.2f} exact, {c['put_kv_GBps']:.2f} compressed ({c['put_vs_exact']:.2f}x); "
                  f"get {c['get_exact_kv_GBps']:.2f} exact, {c['get_kv_GBps']:.2f} compressed ({c['get_vs_exact']:.2f}x)")
        if "vllm" in res:
            v = res["vllm"]
            print(f"  vLLM {v['prompt_tokens']} tokens on host B: cold {v['ttft_cold_s'] * 1000:.0f} ms, remote hit "
                  f"{v['ttft_remote_hit_s'] * 1000:.0f} ms, host hit {v['ttft_host_hit_s'] * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
