"""Benchmark: a fleet of vLLM OpenAI servers behind a router, with and without kvstore, on a multi-turn,
multi-tenant workload derived from the Mooncake conversation trace (tools/traces/).

Per arm, from cold: N vLLM OpenAI servers (SmolLM2-135M, float32 by default, CPU, eager
engine, 1 OpenMP thread each, block size = --block-tokens), a fresh kvstore
daemon for the kvstore arms (every engine's connector on it, kv_both), and
`kvstore proxy --engine ...` (server/pd_proxy.py, router mode) in front. Arms:

* a: round-robin, vLLM prefix caching only
* b: session affinity (x-session-affinity = the session id), prefix caching only
* c: round-robin + kvstore
* d: affinity + kvstore
* e_b / e_d: as b / d, but engine 1 is SIGKILLed when the middle request is sent
  (or at --kill-at-s) and restarted on the same port at once (cold, ~30-60 s to come up);
  the router's health checks skip it while it is down. Hit ratio is reported in
  windows by arrival: before the kill, while it is down, after it is back.

Workload (`tools/bench/serving_workload.py`, seeded, no vLLM needed): the trace's sessions are
keyed by their second hash_id (every request of the trace starts with hash_id
0, a shared first block; the block after it opens a conversation and later
turns of the conversation extend the same prefix). Sessions with at least
--min-turns requests are taken in order of first appearance, all their turns
in the trace's arrival order, up to --requests requests. Each hash_id becomes
a fixed random block of --block-tokens token ids (512 trace tokens -> 32 by
default), so equal hash_id prefixes give equal token prefixes; the last block
is cut in proportion to input_length; prompts longer than --max-blocks blocks
keep their first --max-blocks (the prefix tree is unchanged). Tenants: each
session belongs to one of --tenants tenants (seeded hash of the session id),
and the trace's shared block 0 becomes that tenant's system prompt of
--system-blocks blocks. Arrival times are the trace's timestamps compressed to
--duration-s. Requests are sent open-loop at those times, as token ids in
`prompt`, greedy, --max-tokens tokens with ignore_eos, streamed.

Per arm: prompt tokens, local prefix-cache hits and external (connector) hits
from each engine's own /metrics (vllm:prompt_tokens_total,
vllm:prefix_cache_hits_total, vllm:external_prefix_cache_hits_total; a killed
engine's counters are read just before the kill and added), computed = prompt
- local hits - external hits; per request the engine's
usage.prompt_tokens_details.cached_tokens (local + external); client-side TTFT
p50/p90/p99 (first streamed token) and requests/s (requests / time from the
first send to the last answer). Every arm's generated token ids are compared
with arm a's for the same request.

    python tools/bench/bench_serving.py [--arms a,b,c,d,e] [--requests 150] [--json out.json] [--plot docs/x.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.tools.bench.serving_report import compare_outputs, hit_ratio, pct, report  # noqa: E402
from kvstore.tools.bench.serving_workload import (  # noqa: E402
    TRACE, Request, affinity_split, build_workload, kv_bytes_per_token, load_trace, simulate, workload_stats)

AFFINITY_HEADER = "x-session-affinity"
MODEL_NAME = "smol"
METRICS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
           "vllm:generation_tokens_total", "vllm:num_preemptions_total")


# -- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for m in re.finditer(r"^(vllm:[A-Za-z0-9_:]+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        try:
            out[m.group(1)] += float(m.group(2))
        except ValueError:
            pass
    return dict(out)


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` on a fixed port (own process group: a kill takes its
    EngineCore process too)."""

    def __init__(self, args, model: str, kvt: dict | None, workdir: str, name: str, port: int) -> None:
        from kvstore.tools.harness.vllm_helpers import base_env

        self.args, self.model, self.kvt, self.workdir, self.name, self.port = args, model, kvt, workdir, name, port
        self.base_env = base_env
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.dead_counters: dict[str, float] = defaultdict(float)  # counters of killed incarnations

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", a.dtype, "--block-size", str(a.block_tokens), "--max-model-len", str(a.max_model_len),
               "--kv-cache-memory-bytes", str(a.engine_kv_mib << 20), "--enforce-eager", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--max-num-seqs", str(a.max_num_seqs),
               "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--seed", "0",
               "--uvicorn-log-level", "warning"]
        if self.kvt:
            cmd += ["--kv-transfer-config", json.dumps(self.kvt)]
        tmp = tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.workdir)
        env = self.base_env(tmp, threads=1, multiprocess=False)
        self.starts += 1
        self.log = open(os.path.join(self.workdir, f"{self.name}-{self.starts}.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 400) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {open(self.log.name).read()[-4000:]}")
            try:
                http_get(self.url + "/v1/models", timeout=2)
                return time.monotonic() - t0
            except Exception:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s; see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http_get(self.url + "/metrics"))

    def counters(self) -> dict[str, float]:
        live = self.metrics()
        return {k: live.get(k, 0.0) + self.dead_counters.get(k, 0.0) for k in set(live) | set(self.dead_counters)}

    def kill(self) -> None:
        """SIGKILL the server's process group, its counters read just before and kept."""
        for k, v in self.metrics().items():
            self.dead_counters[k] += v
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc:
            self.log.close()


class Router:
    def __init__(self, urls: list[str], workdir: str, health_interval_s: float = 0.5,
                 health_timeout_s: float = 3.0, load_bound: float = 0.0) -> None:
        from kvstore.tools.harness.vllm_helpers import base_env

        self.port = free_port()
        cmd = [sys.executable, "-m", "kvstore.tools.cli", "proxy", "--port", str(self.port),
               "--health-interval-s", str(health_interval_s), "--connect-timeout-s", str(health_timeout_s),
               "--load-bound", str(load_bound)]
        for u in urls:
            cmd += ["--engine", u]
        self.log = open(os.path.join(workdir, "router.log"), "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(workdir), stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                http_get(self.url + "/health", timeout=2)
                return
            except Exception:
                time.sleep(0.2)
        raise RuntimeError("router did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.log.close()


# -- client -------------------------------------------------------------------------------------
async def send_one(session, url: str, req: Request, args, affinity: bool, t_start: float) -> dict:
    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    headers = {AFFINITY_HEADER: req.session} if affinity else {}
    tries, last_err = 0, ""
    while tries < args.retries:
        tries += 1
        t0 = time.monotonic()
        ttft = None
        text, token_ids, usage, done = [], [], None, False
        try:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    last_err = f"{resp.status}: {(await resp.text())[:200]}"
                    await asyncio.sleep(1.0)
                    continue
                buf = b""
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        line = event.decode().strip()
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            continue
                        obj = json.loads(data)
                        for ch in obj.get("choices") or []:
                            if ttft is None and (ch.get("text") or ch.get("token_ids")):
                                ttft = time.monotonic() - t0
                            text.append(ch.get("text") or "")
                            token_ids += ch.get("token_ids") or []
                        if obj.get("usage"):
                            usage = obj["usage"]
        except Exception as exc:  # the engine died under us: try again (the router then skips it)
            last_err = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(1.0)
            continue
        if not done:
            last_err = "stream cut short"
            await asyncio.sleep(1.0)
            continue
        t1 = time.monotonic()
        details = (usage or {}).get("prompt_tokens_details") or {}
        return {"idx": req.idx, "ok": True, "tries": tries, "sent_s": t0 - t_start, "done_s": t1 - t_start,
                "ttft_s": ttft, "text": "".join(text), "token_ids": token_ids,
                "prompt_tokens": (usage or {}).get("prompt_tokens", len(req.prompt)),
                "cached_tokens": details.get("cached_tokens")}
    return {"idx": req.idx, "ok": False, "tries": tries, "error": last_err}


async def drive(url: str, reqs: list[Request], args, affinity: bool, on_half=None) -> tuple[list[dict], float]:
    """Send every request at its arrival time; `on_half(t)` is called once, at the first arrival at or past
    --kill-at-s (or, when that is 0, the arrival of the middle request)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t_start = time.monotonic()
        half = args.kill_at_s or (reqs[len(reqs) // 2].arrival_s if reqs else 0)
        tasks = []
        fired = False
        for r in reqs:
            delay = r.arrival_s - (time.monotonic() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            if on_half and not fired and r.arrival_s >= half:
                fired = True
                on_half(time.monotonic() - t_start)
            tasks.append(asyncio.create_task(send_one(session, url, r, args, affinity, t_start)))
        results = await asyncio.gather(*tasks)
        return list(results), time.monotonic() - t_start


# -- arms ---------------------------------------------------------------------------------------
ARMS = {
    "a": ("round-robin, prefix caching only", False, False, False),
    "b": ("affinity, prefix caching only", True, False, False),
    "c": ("round-robin + kvstore", False, True, False),
    "d": ("affinity + kvstore", True, True, False),
    "e_b": ("affinity, prefix caching only, engine 1 killed and restarted", True, False, True),
    "e_d": ("affinity + kvstore, engine 1 killed and restarted", True, True, True),
}


def run_arm(arm: str, reqs: list[Request], args, model: str, root: str) -> dict:
    from kvstore.tools.harness.vllm_helpers import connector_config, start_daemon

    label, affinity, kvstore, restart = ARMS[arm]
    workdir = tempfile.mkdtemp(prefix=f"arm-{arm}-", dir=root)
    daemon = start_daemon(workdir, host_bytes=args.store_bytes) if kvstore else None
    kvt = connector_config(daemon.socket_path) if kvstore else None
    servers = [Server(args, model, kvt, workdir, f"engine{i}", free_port()) for i in range(args.engines)]
    router = None
    events: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        for s in servers:
            s.start()
        startup = [s.wait_ready() for s in servers]
        print(f"[{arm}] {len(servers)} engines up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        router = Router([s.url for s in servers], workdir, health_timeout_s=args.health_timeout_s,
                        load_bound=args.load_bound)
        base = [s.metrics() for s in servers]  # zero after a cold start, but read them anyway

        restarter = None

        def on_half(t: float) -> None:
            nonlocal restarter
            victim = servers[1 % len(servers)]

            def cycle() -> None:
                events["kill_s"] = t
                victim.kill()
                victim.start()
                victim.wait_ready()
                events["back_s"] = t + (time.monotonic() - t_kill)

            t_kill = time.monotonic()
            restarter = threading.Thread(target=cycle)
            restarter.start()

        results, wall = asyncio.run(drive(router.url, reqs, args, affinity, on_half if restart else None))
        if restarter:
            restarter.join()
        counters = [s.counters() for s in servers]
    finally:
        if router:
            router.stop()
        for s in servers:
            s.stop()
        if daemon:
            daemon.stop()
    tot = {k: sum(c.get(k, 0.0) - b.get(k, 0.0) for c, b in zip(counters, base)) for k in METRICS}
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    prompt = tot["vllm:prompt_tokens_total"]
    local, ext = tot["vllm:prefix_cache_hits_total"], tot["vllm:external_prefix_cache_hits_total"]
    first_send = min((r["sent_s"] for r in ok), default=0.0)
    last_done = max((r["done_s"] for r in ok), default=wall)
    out = {
        "arm": arm, "label": label, "affinity": affinity, "kvstore": kvstore, "restart": restart,
        "load_bound": args.load_bound,
        "requests": len(reqs), "ok": len(ok), "failed": len(results) - len(ok),
        "retried": sum(1 for r in ok if r["tries"] > 1),
        "engine_startup_s": [round(x, 1) for x in startup],
        "prompt_tokens": int(prompt), "local_hit_tokens": int(local), "external_hit_tokens": int(ext),
        "computed_tokens": int(prompt - local - ext),
        "reused_frac": round((local + ext) / prompt, 4) if prompt else None,
        "preemptions": int(tot["vllm:num_preemptions_total"]),
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1), "ttft_p90_ms": round(pct(ttft, 0.9) * 1000, 1),
        "ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1),
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1000, 1) if ttft else None,
        "wall_s": round(wall, 1), "req_per_s": round(len(ok) / max(last_done - first_send, 1e-9), 3),
        "hit_ratio_requests": hit_ratio(ok), "metrics": tot, "events": events,
        "engines": [s.url for s in servers],
        "per_engine_metrics": [{k: c.get(k, 0.0) - b.get(k, 0.0) for k in METRICS} for c, b in zip(counters, base)],
        "affinity_split": affinity_split(reqs, [s.url for s in servers]) if affinity else None,
        "per_request": [{k: r.get(k) for k in ("idx", "ok", "tries", "sent_s", "done_s", "ttft_s", "prompt_tokens",
                                                "cached_tokens", "token_ids", "text", "error")} for r in results],
    }
    if restart and "kill_s" in events:
        back = events.get("back_s", float("inf"))
        sent = {r["idx"]: r for r in ok}
        win = {"before": [], "down": [], "after": []}
        for r in reqs:
            res = sent.get(r.idx)
            if not res:
                continue
            w = "before" if r.arrival_s < events["kill_s"] else ("down" if r.arrival_s < back else "after")
            win[w].append(res)
        out["windows"] = {k: {"requests": len(v), "hit_ratio": hit_ratio(v),
                              "ttft_p50_ms": round(pct([x["ttft_s"] for x in v if x["ttft_s"]], 0.5) * 1000, 1)
                              if v else None} for k, v in win.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="a,b,c,d,e", help="a,b,c,d,e (e = e_b and e_d)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per trace block (512 in the trace)")
    ap.add_argument("--max-blocks", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--system-blocks", type=int, default=4)
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=180.0, help="the trace's arrival times compressed to this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32",
                    help="float32: on CPUs without AVX-512 (this box) bf16 matmuls take a ~5x slower path")
    ap.add_argument("--engine-kv-mib", type=int, default=256, help="each engine's own KV cache")
    ap.add_argument("--store-bytes", default="2GiB", help="kvstore daemon host tier")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the longest prompt + max tokens, rounded up")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--kill-at-s", type=float, default=0.0,
                    help="arm e: kill engine 1 at the first arrival at or after this time (0: the middle request's)")
    ap.add_argument("--health-timeout-s", type=float, default=3.0,
                    help="the router's health-check timeout (a loaded engine answers /health slowly)")
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--load-bound", type=float, default=1.25,
                    help="the router's bounded-load affinity (kvstore proxy --load-bound, same default; 0: pure "
                         "rendezvous hashing, as in the first documented run)")
    ap.add_argument("--json", default="", help="write every number (per request too) to this file")
    ap.add_argument("--plot", default="", help="write a PNG here")
    ap.add_argument("--stats-only", action="store_true", help="print the workload's statistics and exit")
    ap.add_argument("--from-json", default="",
                    help="no run: report (table, outputs, restart windows, --plot) from these --json files, "
                         "comma-separated; a later file's arm replaces an earlier one's")
    args = ap.parse_args()
    if args.from_json:
        merged: dict[str, dict] = {}
        for path in args.from_json.split(","):
            for a in json.load(open(path))["arms"]:
                merged[a["arm"]] = a
        arms = [merged[k] for k in ARMS if k in merged]
        report(arms, args.plot)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop engines, router and daemon on the way out
    reqs = build_workload(load_trace(args.trace), args.requests, args.block_tokens, args.max_blocks, args.seed,
                          args.tenants, args.system_blocks, args.min_turns, args.duration_s)
    stats = workload_stats(reqs, args.block_tokens)
    print(json.dumps({"workload": stats}), file=sys.stderr, flush=True)
    if args.stats_only:
        local = (args.engine_kv_mib << 20) // kv_bytes_per_token(args.dtype)
        for arm, (label, aff, kv, _) in ARMS.items():
            if not arm.startswith("e"):
                print(arm, label, json.dumps(simulate(reqs, args.engines, args.block_tokens, local, aff, kv)))
        return
    if not args.max_model_len:
        args.max_model_len = int(math.ceil((stats["max_prompt"] + args.max_tokens + 1) / 256) * 256)
    from kvstore.tools.harness.vllm_helpers import build_model

    model = build_model("smollm2")
    root = tempfile.mkdtemp(prefix="bench-serving-")
    arms = []
    for a in args.arms.split(","):
        for name in (["e_b", "e_d"] if a == "e" else [a]):
            res = run_arm(name, reqs, args, model, root)
            arms.append(res)
            brief = {k: v for k, v in res.items() if k not in ("per_request", "metrics")}
            print(json.dumps(brief), file=sys.stderr, flush=True)
            if args.json:  # after every arm: a cut-short run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "workload": stats, "arms": arms,
                               "outputs": compare_outputs(arms) if len(arms) > 1 else {}}, f)
    report(arms, args.plot)


if __name__ == "__main__":
    main()
