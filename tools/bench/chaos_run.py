"""Chaos run: real vLLM CPU engines with the kvstore connector and one daemon, under preemption, aborts,
injected load failures and a daemon SIGKILLed and restarted mid-run; then the oracles.

    python tools/bench/chaos_run.py [--requests 96] [--engines plain,ngram_async,async]
        [--kill-at 0.3,0.6] [--seed 0] [--fail-loads 0.3] [--control] [--json OUT] [--workdir DIR] [--keep]

What runs (all SmolLM2-135M, float32, block size 32, eager, in-process engines
with one OpenMP thread each; tools/harness/chaos_engine.py):

* engines with the connector (`kv_both`, `fail_loads` and `fail_saves` at seeded rates) and a
  KV cache of `kv_blocks` blocks with chunked prefill, so that they preempt
  all the time; profiles: `plain` (loads copied beside the forward),
  `ngram_async` (ngram speculative decoding, loads reported as asynchronous:
  requests wait in WAITING_FOR_REMOTE_KVS), `async`, `ngram`;
* a workload of shared prefixes (tools/bench/chaos_workload.py): system prompts,
  multi-turn sessions spread over the engines, one-shot prompts, some with
  prompt_logprobs, a quarter aborted at a chosen moment;
* the daemon (host tier `host_bytes`, no disk) SIGKILLed when the engines
  have finished `kill_at` of their requests, and restarted `down_s` later
  under the same name (it re-adopts the arena);
* the baseline: every request an engine finished, served alone (one request at
  a time) by an engine without the connector with the same speculative config,
  float32, prefix caching off, chunked prefill with the same token budget. In
  float32 the token at which a prefill is split (a prefix hit, a chunk, a
  preemption) did not change a greedy output in this workload; `--control`
  checks that on each run: the same engines and workload without the
  connector, compared with the same baseline;
* the store-bytes reference: the baseline engines copy the KV of a sample of
  stored blocks out of their paged caches (chaos_engine.py's capture), from the
  prefill of a baseline request whose prompt begins with the block's tokens, or
  else from a prefill of those tokens of its own (`capture_plan`, one per
  sequence, none a prefix of another) in the least loaded baseline. The
  report's `wall_s` says how long each baseline took.

The oracles are tools/bench/chaos_oracles.py; `run_chaos` returns the report
(also printed as JSON with `--json`). Planted bugs (`ChaosConfig.plant`,
tools/harness/chaos_plants.py) show each oracle failing (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.client import KVClient  # noqa: E402
from kvstore.keys import ExtraKeys, hash_blocks  # noqa: E402
from kvstore.tools.bench import chaos_oracles as oracles  # noqa: E402
from kvstore.tools.bench.chaos_workload import WorkloadConfig, build_workload  # noqa: E402
from kvstore.tools.harness.chaos_procs import Daemon, EngineProc, anon_rss, wait_all  # noqa: E402
from kvstore.tools.harness.vllm_helpers import build_model, connector_config, corpus_text, tokenize  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROFILES = {  # engine profile -> (speculative config, load_async)
    "plain": (None, False), "async": (None, True), "ngram": (NGRAM, False), "ngram_async": (NGRAM, True),
}
ALL_ORACLES = ("outputs", "stored_bytes", "daemon_state", "rss", "reuse")
# How often the run samples every process's memory (and looks at the engines): an engine of the short planted
# runs is busy for under a second, and the rss oracle judges a process on three samples at least.
RSS_EVERY_S = 0.1


@dataclass(frozen=True)
class ChaosConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engines: tuple = ("plain", "ngram_async")
    model: str = "smollm2"
    block_size: int = 32
    kv_blocks: int = 20  # the engines' KV cache, in blocks: small, so that they preempt
    max_num_batched_tokens: int = 96  # chunked prefill's token budget per step
    max_num_seqs: int = 12
    max_model_len: int = 640
    host_bytes: str = "128MiB"
    fail_loads: float = 0.3
    fail_saves: float = 0.05
    fault_seed: int = 1
    kill_at: tuple = (0.4,)  # progress fractions at which the daemon is SIGKILLed and restarted
    down_s: float = 2.0
    sample_blocks: int = 1000  # stored blocks checked against a fresh engine's KV (all, up to this many)
    control: bool = False
    plant: tuple = ()  # (engine index, bug name) pairs, tools/harness/chaos_plants.py
    oracles: tuple = ALL_ORACLES
    timeout_s: float = 1200.0


def block_bytes(model: str, block_size: int) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * block_size * 4  # float32


def engine_kwargs(cfg: ChaosConfig, model: str, profile: str, kvt: dict | None, serial: bool = False) -> dict:
    spec_cfg, _ = PROFILES[profile]
    kv = (256 << 20) if serial else (cfg.kv_blocks + 1) * block_bytes(model, cfg.block_size)
    # scheduler_reserve_full_isl off: a request is admitted when its first chunk fits, not its whole prompt
    # (vLLM's "KV cache thrashing with chunked prefill"): preemptions mid-prefill as well as in decode
    return dict(model=model, dtype="float32", block_size=cfg.block_size, kv_cache_memory_bytes=kv,
                max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=1 if serial else cfg.max_num_seqs, enable_prefix_caching=not serial,
                scheduler_reserve_full_isl=serial, kv_transfer_config=kvt, speculative_config=spec_cfg)


def run_engines(cfg: ChaosConfig, model: str, work, folder: Path, daemon: Daemon | None, report: dict) -> dict:
    """The chaos arm (with `daemon`) or the control arm (without): engines run the workload; with a daemon,
    it is killed and restarted at the configured progress; RSS is sampled throughout."""
    engines = []
    for i, profile in enumerate(cfg.engines):
        kvt = None
        if daemon is not None:
            kvt = connector_config(daemon.socket_path, fail_loads=cfg.fail_loads, fail_saves=cfg.fail_saves,
                                   fault_seed=cfg.fault_seed + i, load_async=PROFILES[profile][1])
        spec = {"engine": engine_kwargs(cfg, model, profile, kvt),
                "requests": [r.to_json() for r in work.for_engine(i)],
                "warmup": [r.to_json() for r in work.warmup if r.engine == i],
                "plant": [name for e, name in cfg.plant if e == i and daemon is not None]}
        engines.append(EngineProc(f"{i}-{profile}", folder / f"engine-{i}", spec).start())
    rss: dict[str, list] = {e.name: [] for e in engines}
    rss["daemon"] = []
    kills = list(cfg.kill_at) if daemon is not None else []
    snapshots: list[dict] = []

    def tick() -> None:
        now = time.time()
        for e in engines:
            if e.proc is not None and not e.idle:
                v = anon_rss(e.proc.pid)
                if v is not None:
                    rss[e.name].append((now, v))
        if daemon is not None and daemon.pid is not None:
            v = anon_rss(daemon.pid)
            if v is not None:
                rss["daemon"].append((now, v))
        done = [e.progress() for e in engines]
        if kills and sum(d for d, _ in done) >= kills[0] * sum(t for _, t in done):
            kills.pop(0)
            snapshots.append(daemon.kill_and_restart(cfg.down_s))
            rss["daemon"].append((time.time(), float("nan")))  # a new process from here

    wait_all(engines, cfg.timeout_s, tick, every_s=RSS_EVERY_S)
    (folder / "rss.json").write_text(json.dumps(rss))
    if daemon is not None:
        snapshots.append(daemon.snapshot("end"))  # engines idle, their connections open
        report["stored"] = sample_store(cfg, daemon, work, engines, model)
    for e in engines:
        e.release()
    return {"engines": {e.name: e.result() for e in engines}, "rss": rss, "snapshots": snapshots}


def sequences(work, results: dict, block_size: int) -> dict[bytes, tuple[list, int]]:
    """Stored-block hash -> (token ids of a sequence that contains it, block index): every request's
    prompt plus the tokens it generated (finished or aborted)."""
    known: dict[bytes, tuple[list, int]] = {}
    for r in work.requests + work.warmup:
        res = results.get(r.rid, {})
        seq = list(r.ids) + list(res.get("token_ids", []))
        for i, h in enumerate(hash_blocks(seq, block_size, ExtraKeys())):
            known.setdefault(bytes(h), (seq, i))
    return known


def sample_store(cfg: ChaosConfig, daemon: Daemon, work, engines: list, model: str) -> dict:
    """Pick stored blocks whose tokens are known, and copy their bytes out of the store."""
    results = {rid: res for e in engines for part in ("results", "warmup_results")
               for rid, res in e.result().get(part, {}).items()}
    known = sequences(work, results, cfg.block_size)
    with KVClient(daemon.socket_path) as c:
        rows = [r for r in c.call("blocks", limit=100_000)["blocks"] if r[5]]
        found = [(r[0], bytes(r[1])) for r in rows if bytes(r[1]) in known]
        rng = random.Random(cfg.workload.seed)
        picked = rng.sample(found, min(cfg.sample_blocks, len(found)))
        stored = {}
        for ns, h in picked:
            (arr,) = c.get(ns, [h])
            if arr is not None:
                stored[h] = bytes(arr)
    captures, picked = capture_plan([known[h] for h in stored], cfg.block_size)
    return {"blocks": len(rows), "known": len(found), "unknown": len(rows) - len(found), "captures": captures,
            "picked": [(h, chain, depth) for h, (chain, depth) in zip(stored, picked)], "bytes": stored}


def capture_plan(blocks: list[tuple[list, int]], block_size: int) -> tuple[list[list], list[tuple[int, int]]]:
    """The prefills that capture fresh KV for `blocks` ((sequence, block index) each): per sequence, its
    tokens up to its deepest sampled block, leaving out any that is a prefix of a longer one (its blocks
    are the longer one's at the same indices). Returns the captures' token lists and, per block, (capture,
    block index)."""
    upto: dict[tuple, tuple] = {}  # sequence -> its tokens up to its deepest sampled block
    for seq, depth in blocks:
        toks = tuple(seq[: (depth + 1) * block_size])
        if len(toks) > len(upto.get(tuple(seq), ())):
            upto[tuple(seq)] = toks
    kept: list[tuple] = []
    for toks in sorted(dict.fromkeys(upto.values()), key=len, reverse=True):  # stable: ties in order seen
        if not any(k[: len(toks)] == toks for k in kept):
            kept.append(toks)
    where = []
    for seq, depth in blocks:
        toks = tuple(seq[: (depth + 1) * block_size])
        where.append((next(j for j, k in enumerate(kept) if k[: len(toks)] == toks), depth))
    return [list(k) for k in kept], where


def run_baselines(cfg: ChaosConfig, model: str, work, arms: list[dict], folder: Path, stored: dict | None) -> dict:
    """Per profile, the finished requests served alone without the connector, and the captures of the
    sampled stored blocks' prefixes: a capture whose tokens begin a baseline request's prompt is taken from
    that request's prefill, the others are prefills of their own, each in the baseline with the fewest
    requests then (the same model's prefill in each). The captures, of every baseline, are the first
    profile's `captures` (`cap<j>.<block>`)."""
    profiles = list(dict.fromkeys(cfg.engines)) if "outputs" in cfg.oracles else [cfg.engines[0]]
    reqs: dict[str, list[dict]] = {}
    seen = set()
    for profile in profiles:
        reqs[profile] = []
        for arm in arms if "outputs" in cfg.oracles else []:
            for e_i, (name, res) in enumerate(arm["engines"].items()):
                if cfg.engines[e_i] != profile:
                    continue
                for r in work.for_engine(e_i):
                    key = (profile, _served_as(r))
                    if res["results"].get(r.rid, {}).get("outcome") == "finished" and key not in seen:
                        seen.add(key)
                        reqs[profile].append(dict(r.to_json(), abort=None, arrive_step=0))
    taken_from: dict[int, str] = {}  # capture -> the request whose prefill it is
    for j, toks in enumerate(stored["captures"] if stored else []):
        host = next((r for rs in reqs.values() for r in rs if r["ids"][: len(toks)] == toks), None)
        if host is None:  # into the baseline with the fewest requests so far
            host = {"rid": f"cap{j}", "engine": -1, "ids": toks, "max_tokens": 2, "arrive_step": 0, "kind": "capture"}
            min(reqs.values(), key=len).append(host)
        host["capture"] = True
        taken_from[j] = host["rid"]
    procs = []
    for profile in profiles:
        spec = {"engine": engine_kwargs(cfg, model, profile, None, serial=True), "requests": reqs[profile],
                "serial": True, "hold": False}
        procs.append(EngineProc(f"baseline-{profile}", folder / f"baseline-{profile}", spec).start())
    wait_all(procs, cfg.timeout_s, idle=False)
    out, blocks = {}, {}  # blocks: request id -> {block index: its KV}
    for p in procs:
        out[p.name.removeprefix("baseline-")] = p.result()
        kv = Path(str(p.out) + ".kv.npz")
        if kv.exists():
            import numpy as np

            with np.load(kv) as z:
                for key in z.files:  # "<rid>.<block>"
                    rid, i = key.rsplit(".", 1)
                    blocks.setdefault(rid, {})[i] = z[key]
    if stored:
        out[profiles[0]]["captures"] = {f"cap{j}.{i}": arr for j, rid in taken_from.items()
                                        for i, arr in blocks.get(rid, {}).items()}
    return out


def _served_as(r) -> tuple:
    """What a request alone is served as: requests equal in this are served once by a baseline."""
    return (tuple(r.ids), r.max_tokens, r.prompt_logprobs)


def check_stored(stored: dict, captures: dict) -> dict:
    import numpy as np

    samples = []
    picked = stored["picked"]
    f32 = lambda b: np.frombuffer(bytes(b), np.float32)  # noqa: E731
    for j, (h, chain, depth) in enumerate(picked):
        fresh = captures.get(f"cap{chain}.{depth}")
        if fresh is None:
            continue
        other_h, other_chain, other_depth = picked[(j + 1) % len(picked)]  # another block: the wrong-block scale
        other = captures.get(f"cap{other_chain}.{other_depth}") if other_h != h else None
        samples.append({"hash": h, "depth": depth, "stored": f32(stored["bytes"][h]), "fresh": f32(fresh),
                        "other": f32(other) if other is not None else None})
    return oracles.stored_bytes(samples)


def run_chaos(cfg: ChaosConfig, workdir: str | None = None, keep: bool = False) -> dict:
    """The whole run: chaos arm, (control arm), baselines, oracles. Returns the report."""
    folder = Path(tempfile.mkdtemp(prefix="chaos-", dir=workdir))
    t0 = time.time()
    model = build_model(cfg.model)
    work = build_workload(tokenize(model, corpus_text(120_000)), replace(cfg.workload, num_engines=len(cfg.engines)))
    daemon = Daemon(folder, cfg.host_bytes).start()
    report: dict = {"config": _jsonable(asdict(cfg)), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                    "workdir": str(folder)}
    try:
        chaos = run_engines(cfg, model, work, folder / "chaos", daemon, report)
        report["daemon_stats"] = chaos["snapshots"][-1]["stats"]
    finally:
        daemon.stop()
    t_chaos = time.time()
    arms = [chaos]
    control = run_engines(cfg, model, work, folder / "control", None, {}) if cfg.control else None
    if control is not None:
        arms.append(control)
    stored = report.pop("stored", None)
    need_baseline = "outputs" in cfg.oracles or "stored_bytes" in cfg.oracles
    baselines = run_baselines(cfg, model, work, arms, folder, stored if "stored_bytes" in cfg.oracles else None) \
        if need_baseline else {}
    report.update(summarize(cfg, work, chaos, daemon, stored))
    report["oracles"] = evaluate(cfg, work, chaos, daemon, baselines, stored)
    if control is not None:
        report["control"] = outputs_oracle(cfg, work, control, baselines)
    report["wall_s"] = {"total": time.time() - t0, "chaos_arm": t_chaos - t0,
                        **{f"baseline_{name}": {"startup": round(b["startup_s"], 1), "run": round(b["run_s"], 1),
                                                "requests": len(b["results"])} for name, b in baselines.items()}}
    report["ok"] = all(v["ok"] for v in report["oracles"].values())
    (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
    if not keep and report["ok"]:  # a failed run keeps its folder (logs, results, report) for a post-mortem
        shutil.rmtree(folder, ignore_errors=True)
    return report


def outputs_oracle(cfg: ChaosConfig, work, arm: dict, baselines: dict) -> dict:
    reqs, results, base = {}, {}, {}
    for e_i, res in enumerate(arm["engines"].values()):
        served = {}  # what the baseline served, by content (it served each once)
        for r in work.requests:
            if r.rid in baselines[cfg.engines[e_i]]["results"]:
                served[_served_as(r)] = baselines[cfg.engines[e_i]]["results"][r.rid]
        for r in work.for_engine(e_i):
            reqs[r.rid] = r.to_json()
            if r.rid in res["results"]:
                results[r.rid] = res["results"][r.rid]
            if _served_as(r) in served:
                base[r.rid] = served[_served_as(r)]
    return oracles.outputs(reqs, results, base)


def evaluate(cfg: ChaosConfig, work, chaos: dict, daemon: Daemon, baselines: dict, stored: dict | None) -> dict:
    verdicts = {}
    if "outputs" in cfg.oracles:
        verdicts["outputs"] = outputs_oracle(cfg, work, chaos, baselines)
    if "stored_bytes" in cfg.oracles:
        captures = baselines[cfg.engines[0]].get("captures", {})
        verdicts["stored_bytes"] = {**check_stored(stored, captures), "stored_blocks": stored["blocks"],
                                    "unknown_blocks": stored["unknown"]}
    if "daemon_state" in cfg.oracles:
        verdicts["daemon_state"] = oracles.daemon_state(chaos["snapshots"])
    engines = chaos["engines"]
    if "rss" in cfg.oracles:
        windows = {name: (e["started"], e["started"] + e["run_s"]) for name, e in engines.items()}
        series = {name: chaos["rss"][name] for name in engines}
        series["daemon"] = _last_process(chaos["rss"]["daemon"])
        start = min(s for s, _ in windows.values())
        windows["daemon"] = (max([start] + [t for t, _ in series["daemon"][:1]]), max(e for _, e in windows.values()))
        verdicts["rss"] = oracles.rss(series, windows)
    if "reuse" in cfg.oracles:
        verdicts["reuse"] = oracles.reuse({n: e["timeline"] for n, e in engines.items()},
                                          [r["ready"] for r in daemon.restarts])
    return verdicts


def _last_process(points: list) -> list:
    """The samples of the last daemon process (a NaN marks each restart)."""
    last = max((i for i, (_, v) in enumerate(points) if v != v), default=-1)
    return points[last + 1 :]


def summarize(cfg: ChaosConfig, work, chaos: dict, daemon: Daemon, stored: dict | None) -> dict:
    per_engine = {}
    for e_i, (name, res) in enumerate(chaos["engines"].items()):
        outcomes = [res["results"].get(r.rid, {}) for r in work.for_engine(e_i)]
        c = res["counters"]
        per_engine[name] = {
            "requests": len(outcomes), "finished": sum(o.get("outcome") == "finished" for o in outcomes),
            "aborted": sum(o.get("outcome") == "aborted" for o in outcomes),
            "abort_moments": _count(o.get("moment") for o in outcomes if o.get("outcome") == "aborted"),
            "prompt_logprobs_requests": sum(r.prompt_logprobs is not None for r in work.for_engine(e_i)),
            "preemptions": c.get("vllm:num_preemptions", 0), "steps": res["steps"], "run_s": res["run_s"],
            "loaded_blocks": res["connector"].get("worker_loaded_blocks", 0),
            "external_hit_tokens": c.get("vllm:external_prefix_cache_hits", 0),
            "local_hit_tokens": c.get("vllm:prefix_cache_hits", 0),
            "injected_load_failures": res["connector"].get("injected_load_failures", 0),
            "injected_save_failures": res["connector"].get("injected_save_failures", 0),
            "spec_accepted_tokens": c.get("vllm:spec_decode_num_accepted_tokens", 0),
        }
    stats = chaos["snapshots"][-1]["stats"] if chaos["snapshots"] else {}
    return {"requests": len(work.requests), "engines": per_engine, "restarts": len(daemon.restarts),
            "restart_times": daemon.restarts,
            "restart_snapshots": [{k: s["stats"].get(k) for k in ("sessions", "pinned_blocks", "reserved_blocks",
                                                                  "blocks")} for s in chaos["snapshots"][:-1]],
            "leaked_pins": stats.get("pinned_blocks"), "leaked_reservations": stats.get("reserved_blocks"),
            "present_misses": stats.get("present_misses", {}),
            "stored_blocks": stored["blocks"] if stored else None}


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--engines", default="plain,ngram_async,async")
    ap.add_argument("--kill-at", default="0.3,0.6", help="progress fractions at which the daemon is SIGKILLed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fail-loads", type=float, default=0.3)
    ap.add_argument("--control", action="store_true", help="also run the engines without the connector")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (logs, results)")
    args = ap.parse_args(argv)
    cfg = ChaosConfig(workload=WorkloadConfig(seed=args.seed, num_requests=args.requests,
                                              arrival_steps=max(40, args.requests)),
                      engines=tuple(args.engines.split(",")), fail_loads=args.fail_loads,
                      kill_at=tuple(float(x) for x in args.kill_at.split(",") if x), control=args.control)
    report = run_chaos(cfg, args.workdir, args.keep)
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
