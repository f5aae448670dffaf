"""Benchmark: time to first token when another engine process already computed the prefix.

SmolLM2-135M (bf16, block size 128) on CPU. For each prompt length (2k and
8k tokens by default) two prompts share everything but their last 16 tokens
(which lie in the final partial block, so every arm can reuse the same
floor((L-1)/128) blocks). Arms, all in the same run, every engine in its own
process with the same thread pinning (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU):

* cold: a fresh engine without a connector serves P (nothing cached);
* in-engine hit: the same engine then serves P' (vLLM's own prefix cache);
* kvstore: engine 1 with KVStoreConnector serves P (stores it; also timed:
  "cold_with_store"), then a fresh engine 2 serves P' (loads from the daemon);
* kvstore, whole-step copies (`--no-whole-step-arm` skips it): engine 2 again,
  with `layer_loads` off, so the load is copied whole before the forward instead
  of layer by layer beside it (connectors/vllm_worker.py); its paired ratio
  against its own in-engine hits shows what the layer-wise copy hides;
* example: the same with vLLM's ExampleConnector (safetensors files on disk).
* kvstore from disk (longest length only; `--no-disk-arm` skips it): a daemon
  whose host tier holds one prompt's blocks (`--disk-host-bytes`) over a disk
  tier. Engine 1 stores P and a second prompt F of the same length; a fresh
  engine 2 then alternates hits on P' and F': each hit finds its chain on
  disk (the previous hit's promotion demoted it) and the daemon promotes it
  (O_DIRECT reads) before the load. The daemon's disk-hit counter over engine
  2's run is reported as evidence that the hits came from disk (it also counts
  the warm-up prompts' hits: engine 1 stored them too).

Each engine first warms up on other tokens with every prefill shape the
measurements use (a cold prompt of each length and a hit on it). Repeats
reset vLLM's prefix cache before each measurement (the store and the disk
folder keep their data).
TTFT is the wall time of `LLM.generate` with max_tokens=1; reported values
are medians over the repeats.

Threads: 1 OpenMP thread per engine, unbound, by default. On the project's
2-core machines, shared with other work, 2 threads made every arm depend on
the other tenants (OpenMP barrier stalls of seconds were seen); 1 thread gave
stable medians. Whatever is chosen applies to every engine of the run.

    python tools/bench/bench_vllm.py [--lengths 2048,8000] [--repeats 5] [--threads 1] [--bind nobind] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.tools.harness.vllm_helpers import (  # noqa: E402
    build_model,
    connector_config,
    corpus_text,
    engine_spec,
    run_engine,
    start_daemon,
    tokenize,
)

BLOCK = 128
TAIL = 16


def prompts_for(ids: list[int], length: int) -> tuple[list[int], list[int]]:
    p = ids[:length]
    p2 = p[:-TAIL] + ids[length + 100 : length + 100 + TAIL]
    assert len(p2) == length and p2 != p
    return p, p2


def measure(model, workdir, runs, args, kvt=None):
    spec = engine_spec(
        model, runs, dtype="bfloat16", block_size=BLOCK, kv_cache_memory_bytes=1 << 30,
        max_model_len=8192, max_num_batched_tokens=8192, kv_transfer_config=kvt,
    )
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return run_engine(spec, workdir, threads=args.threads, timeout_s=1800, env_extra=env)


def one(ids, label, reset=False):
    return {"prompts": [{"ids": ids}], "max_tokens": 1, "reset_prefix_cache": reset, "label": label}


def by_label(result, runs: list[dict], label: str) -> list[dict]:
    return [r for r, spec in zip(result.runs, runs) if spec["label"] == label]


def plan(ids: list[int], args) -> dict[str, list[dict]]:
    """The runs of each kind of engine: baseline (cold + in-engine hit), save, load, and the disk arm."""
    top = max(args.lengths)
    pairs = {n: prompts_for(ids, n) for n in args.lengths}
    # warm-up: every prefill shape the measurements use (a cold prompt and a hit on it) on other tokens
    warm = []
    for n in args.lengths:
        w = ids[top + 1500 : top + 1500 + n]
        warm += [one(w, "warm", reset=True), one(w[:-TAIL] + ids[:TAIL], "warm")]
    base, save, load = list(warm), list(warm), list(warm)
    for n in args.lengths:
        p, p2 = pairs[n]
        for _ in range(args.cold_repeats):
            base += [one(p, f"cold{n}", reset=True), one(p2, f"local{n}")]
        save.append(one(p, f"save{n}", reset=True))
        for _ in range(args.repeats):  # an external hit, then the same prompt again: an in-engine hit, same engine
            load += [one(p2, f"hit{n}", reset=True), one(p2, f"local{n}")]
    # disk arm: P and F alternate, so each hit finds its chain demoted to disk by the other's promotion
    p, p2 = pairs[top]
    f, f2 = prompts_for(ids[top + 3000 :], top)
    dsave = list(warm) + [one(p, "dsaveP", reset=True), one(f, "dsaveF", reset=True)]
    dload = list(warm)
    for _ in range(args.repeats):
        dload += [one(p2, "dhit", reset=True), one(f2, "dhit", reset=True)]
    return {"base": base, "save": save, "load": load, "dsave": dsave, "dload": dload}


def run_arms(model: str, workdir: str, runs: dict, args) -> dict:
    """Engine results per arm, one engine process at a time."""
    out = {"base": measure(model, workdir, runs["base"], args)}
    daemon = start_daemon(workdir, host_bytes=args.host_bytes)
    try:
        kvt = connector_config(daemon.socket_path)
        out["kv_save"] = measure(model, workdir, runs["save"], args, kvt)
        out["kv_load"] = measure(model, workdir, runs["load"], args, kvt)
        if args.whole_step_arm:
            out["kv_load_whole"] = measure(model, workdir, runs["load"], args,
                                           connector_config(daemon.socket_path, layer_loads=False))
    finally:
        daemon.stop()
    if args.disk_arm:
        out.update(run_disk_arm(model, workdir, runs, args))
    disk = os.path.join(workdir, "example-store")
    os.makedirs(disk, exist_ok=True)
    ext = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": disk}}
    out["ex_save"] = measure(model, workdir, runs["save"], args, ext)
    out["ex_load"] = measure(model, workdir, runs["load"], args, ext)
    return out


def run_disk_arm(model: str, workdir: str, runs: dict, args) -> dict:
    """Store P and F, then alternate hits on them through a host tier that holds one of them."""
    daemon = start_daemon(workdir, host_bytes=args.disk_host_bytes, disk_bytes=args.disk_bytes)
    try:
        kvt = connector_config(daemon.socket_path)
        out = {"kv_dsave": measure(model, workdir, runs["dsave"], args, kvt)}
        before = _disk_hits(daemon)
        out["kv_dload"] = measure(model, workdir, runs["dload"], args, kvt)
        out["disk_hit_blocks"] = _disk_hits(daemon) - before
    finally:
        daemon.stop()
    return out


def _disk_hits(daemon) -> int:
    client = daemon.client()
    try:
        return int(client.stats()["tiers"]["disk"]["hits"])
    finally:
        client.close()


def summarize_disk(res: dict, runs: dict, top: dict, n: int) -> dict:
    walls = [x["wall_s"] for x in by_label(res["kv_dload"], runs["dload"], "dhit")]
    cached = [x["outputs"][0]["num_cached_tokens"] for x in by_label(res["kv_dload"], runs["dload"], "dhit")]
    e = {
        "prompt_tokens": n,
        "ttft_disk_hit_s": statistics.median(walls),
        "all_disk_hit_s": walls,
        "disk_cached_tokens": cached,
        "disk_hit_blocks": res["disk_hit_blocks"],
        "expected_disk_hit_blocks": len(walls) * ((n - 1) // BLOCK),
    }
    e["disk_hit_vs_cold"] = e["ttft_disk_hit_s"] / top["ttft_cold_s"]
    e["disk_hit_vs_host_hit"] = e["ttft_disk_hit_s"] / top["ttft_kvstore_hit_s"]
    e["disk_hit_vs_example"] = e["ttft_disk_hit_s"] / top["ttft_example_hit_s"]
    return e


def summarize_length(n: int, res: dict, runs: dict) -> dict:
    def walls(arm: str, kind: str, label: str) -> list[float]:
        return [x["wall_s"] for x in by_label(res[arm], runs[kind], label)]

    def med(arm: str, kind: str, label: str) -> float:
        return statistics.median(walls(arm, kind, label))

    def cached(arm: str, kind: str, label: str) -> list[int]:
        return [x["outputs"][0]["num_cached_tokens"] for x in by_label(res[arm], runs[kind], label)]

    e = {
        "ttft_cold_s": med("base", "base", f"cold{n}"),
        "ttft_inengine_hit_s": med("base", "base", f"local{n}"),
        "ttft_cold_with_store_s": med("kv_save", "save", f"save{n}"),
        "ttft_cold_with_example_s": med("ex_save", "save", f"save{n}"),
        "ttft_kvstore_hit_s": med("kv_load", "load", f"hit{n}"),
        "ttft_example_hit_s": med("ex_load", "load", f"hit{n}"),
        # paired: each connector's external hit against an in-engine hit of the same prompt in the same
        # engine process, right after it (insensitive to the other tenants of a shared machine)
        "kvstore_engine_inengine_hit_s": med("kv_load", "load", f"local{n}"),
        "example_engine_inengine_hit_s": med("ex_load", "load", f"local{n}"),
        "inengine_cached_tokens": cached("base", "base", f"local{n}"),
        "kvstore_cached_tokens": cached("kv_load", "load", f"hit{n}"),
        "example_cached_tokens": cached("ex_load", "load", f"hit{n}"),
        "expected_cached_tokens": (n - 1) // BLOCK * BLOCK,
        "all_cold_s": walls("base", "base", f"cold{n}"),
        "all_kvstore_hit_s": walls("kv_load", "load", f"hit{n}"),
        "all_example_hit_s": walls("ex_load", "load", f"hit{n}"),
    }
    if "kv_load_whole" in res:
        e["ttft_kvstore_whole_step_hit_s"] = med("kv_load_whole", "load", f"hit{n}")
        e["kvstore_whole_step_engine_inengine_hit_s"] = med("kv_load_whole", "load", f"local{n}")
        e["kvstore_whole_step_cached_tokens"] = cached("kv_load_whole", "load", f"hit{n}")
        e["all_kvstore_whole_step_hit_s"] = walls("kv_load_whole", "load", f"hit{n}")
        e["whole_step_hit_vs_inengine_paired"] = (e["ttft_kvstore_whole_step_hit_s"]
                                                  / e["kvstore_whole_step_engine_inengine_hit_s"])
    e["hit_vs_cold"] = e["ttft_kvstore_hit_s"] / e["ttft_cold_s"]
    e["hit_vs_example"] = e["ttft_kvstore_hit_s"] / e["ttft_example_hit_s"]
    e["hit_vs_inengine"] = e["ttft_kvstore_hit_s"] / e["ttft_inengine_hit_s"]
    e["hit_vs_inengine_paired"] = e["ttft_kvstore_hit_s"] / e["kvstore_engine_inengine_hit_s"]
    e["example_vs_inengine_paired"] = e["ttft_example_hit_s"] / e["example_engine_inengine_hit_s"]
    return e


def bench(args) -> dict:
    model = build_model("smollm2")
    args.workdir = tempfile.mkdtemp(prefix="bench-vllm-")
    ids = tokenize(model, corpus_text(80000))
    while len(ids) < 2 * max(args.lengths) + 3200:  # P, the warm-up prompts and the disk arm's F
        ids = ids + ids
    runs = plan(ids, args)
    res = run_arms(model, args.workdir, runs, args)
    results: dict = {"model": "SmolLM2-135M-Instruct bf16", "block_size": BLOCK, "threads": args.threads,
                     "bind": args.bind, "repeats": args.repeats, "cold_repeats": args.cold_repeats,
                     "lengths": {str(n): summarize_length(n, res, runs) for n in args.lengths}}
    top = results["lengths"][str(max(args.lengths))]
    results["ttft_hit_vs_cold_8k"] = top["hit_vs_cold"]
    results["ttft_vs_example_connector_8k"] = top["hit_vs_example"]
    results["ttft_vs_inengine_hit_8k"] = top["hit_vs_inengine"]
    results["ttft_vs_inengine_hit_paired_8k"] = top["hit_vs_inengine_paired"]
    results["example_vs_inengine_hit_paired_8k"] = top["example_vs_inengine_paired"]
    if "whole_step_hit_vs_inengine_paired" in top:
        results["whole_step_vs_inengine_hit_paired_8k"] = top["whole_step_hit_vs_inengine_paired"]
    if args.disk_arm:
        results["disk"] = summarize_disk(res, runs, top, max(args.lengths))
        results["ttft_disk_hit_vs_cold_8k"] = results["disk"]["disk_hit_vs_cold"]
        results["ttft_disk_hit_vs_host_hit_8k"] = results["disk"]["disk_hit_vs_host_hit"]
    return results


def table(results: dict) -> str:
    rows = ["| prompt tokens | cold | in-engine hit | kvstore hit | ExampleConnector hit | cold + kvstore saves "
            "| cold + Example saves | kvstore/cold | kvstore/Example | kvstore/in-engine (paired) "
            "| Example/in-engine (paired) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, e in results["lengths"].items():
        ms = lambda key: f"{e[key] * 1000:.0f} ms"  # noqa: E731
        rows.append(
            f"| {n} | {ms('ttft_cold_s')} | {ms('ttft_inengine_hit_s')} | {ms('ttft_kvstore_hit_s')} "
            f"| {ms('ttft_example_hit_s')} | {ms('ttft_cold_with_store_s')} | {ms('ttft_cold_with_example_s')} "
            f"| {e['hit_vs_cold']:.3f} | {e['hit_vs_example']:.3f} | {e['hit_vs_inengine_paired']:.3f} "
            f"| {e['example_vs_inengine_paired']:.3f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,8000", help="prompt lengths in tokens (max 8191)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per arm and length (medians reported)")
    p.add_argument("--cold-repeats", type=int, default=3, help="cold prefills per length (8k: ~40 s each)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every engine")
    p.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND for every engine")
    p.add_argument("--host-bytes", default="2GiB", help="daemon host tier")
    p.add_argument("--no-disk-arm", dest="disk_arm", action="store_false", help="skip the disk-tier hit arm")
    p.add_argument("--no-whole-step-arm", dest="whole_step_arm", action="store_false",
                   help="skip the arm that loads with layer_loads off (copied whole before the forward)")
    p.add_argument("--disk-host-bytes", default="200MiB",
                   help="host tier of the disk arm: room for one prompt's blocks, not two (8k: 62 x 2.95 MB)")
    p.add_argument("--disk-bytes", default="2GiB", help="disk tier of the disk arm")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work folder (engine logs, ExampleConnector files)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    results = bench(args)
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else table(results))
    for n, e in results["lengths"].items():
        if "whole_step_hit_vs_inengine_paired" in e and not args.json:
            print(f"\n{n} tokens, loads copied whole before the forward (layer_loads off): hit "
                  f"{e['ttft_kvstore_whole_step_hit_s'] * 1000:.0f} ms, paired vs in-engine "
                  f"{e['whole_step_hit_vs_inengine_paired']:.3f} (layer by layer: {e['hit_vs_inengine_paired']:.3f})")
    if "disk" in results and not args.json:
        d = results["disk"]
        print(f"\n{d['prompt_tokens']} tokens, hit from the disk tier: {d['ttft_disk_hit_s'] * 1000:.0f} ms "
              f"(vs cold {d['disk_hit_vs_cold']:.3f}, vs host-tier hit {d['disk_hit_vs_host_hit']:.3f}, "
              f"vs ExampleConnector {d['disk_hit_vs_example']:.3f}); disk hits {d['disk_hit_blocks']} blocks "
              f"of {d['expected_disk_hit_blocks']} loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
