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
* example: the same with vLLM's ExampleConnector (safetensors files on disk).

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

    python tools/bench_vllm.py [--lengths 2048,8000] [--repeats 5] [--threads 1] [--bind nobind] [--json] [--keep]
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.vllm_helpers import (  # noqa: E402
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


def bench(args) -> dict:
    model = build_model("smollm2")
    workdir = args.workdir = tempfile.mkdtemp(prefix="bench-vllm-")
    ids = tokenize(model, corpus_text(80000))
    top = max(args.lengths)
    while len(ids) < 2 * top + 2000:
        ids = ids + ids
    pairs = {n: prompts_for(ids, n) for n in args.lengths}
    # warm-up: every prefill shape the measurements use (a cold prompt and a hit on it) on other tokens
    warm = []
    for n in args.lengths:
        w = ids[top + 1500 : top + 1500 + n]
        warm += [one(w, "warm", reset=True), one(w[:-TAIL] + ids[:TAIL], "warm")]
    r = args.repeats

    base_runs = list(warm)
    for n in args.lengths:
        for _ in range(args.cold_repeats):
            base_runs += [one(pairs[n][0], f"cold{n}", reset=True), one(pairs[n][1], f"local{n}")]
    save_runs = list(warm) + [one(pairs[n][0], f"save{n}", reset=True) for n in args.lengths]
    load_runs = list(warm)
    for n in args.lengths:
        for _ in range(r):  # an external hit, then the same prompt again: an in-engine hit in the same engine
            load_runs += [one(pairs[n][1], f"hit{n}", reset=True), one(pairs[n][1], f"local{n}")]

    base = measure(model, workdir, base_runs, args)
    daemon = start_daemon(workdir, host_bytes=args.host_bytes)
    try:
        kvt = connector_config(daemon.socket)
        kv_save = measure(model, workdir, save_runs, args, kvt)
        kv_load = measure(model, workdir, load_runs, args, kvt)
    finally:
        daemon.stop()
    disk = os.path.join(workdir, "example-store")
    os.makedirs(disk, exist_ok=True)
    ext = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": disk}}
    ex_save = measure(model, workdir, save_runs, args, ext)
    ex_load = measure(model, workdir, load_runs, args, ext)

    def median_s(result, runs, label):
        return statistics.median(x["wall_s"] for x in by_label(result, runs, label))

    def cached(result, runs, label):
        return [x["outputs"][0]["num_cached_tokens"] for x in by_label(result, runs, label)]

    results: dict = {"model": "SmolLM2-135M-Instruct bf16", "block_size": BLOCK, "threads": args.threads,
                     "bind": args.bind, "repeats": r, "cold_repeats": args.cold_repeats, "lengths": {}}
    for n in args.lengths:
        entry = {
            "ttft_cold_s": median_s(base, base_runs, f"cold{n}"),
            "ttft_inengine_hit_s": median_s(base, base_runs, f"local{n}"),
            "ttft_cold_with_store_s": median_s(kv_save, save_runs, f"save{n}"),
            "ttft_cold_with_example_s": median_s(ex_save, save_runs, f"save{n}"),
            "ttft_kvstore_hit_s": median_s(kv_load, load_runs, f"hit{n}"),
            "ttft_example_hit_s": median_s(ex_load, load_runs, f"hit{n}"),
            "inengine_cached_tokens": cached(base, base_runs, f"local{n}"),
            "kvstore_cached_tokens": cached(kv_load, load_runs, f"hit{n}"),
            "example_cached_tokens": cached(ex_load, load_runs, f"hit{n}"),
            "expected_cached_tokens": (n - 1) // BLOCK * BLOCK,
            "all_kvstore_hit_s": [x["wall_s"] for x in by_label(kv_load, load_runs, f"hit{n}")],
            "all_cold_s": [x["wall_s"] for x in by_label(base, base_runs, f"cold{n}")],
        }
        entry["hit_vs_cold"] = entry["ttft_kvstore_hit_s"] / entry["ttft_cold_s"]
        entry["hit_vs_example"] = entry["ttft_kvstore_hit_s"] / entry["ttft_example_hit_s"]
        entry["hit_vs_inengine"] = entry["ttft_kvstore_hit_s"] / entry["ttft_inengine_hit_s"]
        # paired: each connector's external hit against an in-engine hit of the same prompt in the same
        # engine process, right after it (insensitive to the other tenants of a shared machine)
        entry["kvstore_engine_inengine_hit_s"] = median_s(kv_load, load_runs, f"local{n}")
        entry["example_engine_inengine_hit_s"] = median_s(ex_load, load_runs, f"local{n}")
        entry["hit_vs_inengine_paired"] = entry["ttft_kvstore_hit_s"] / entry["kvstore_engine_inengine_hit_s"]
        entry["example_vs_inengine_paired"] = entry["ttft_example_hit_s"] / entry["example_engine_inengine_hit_s"]
        entry["all_example_hit_s"] = [x["wall_s"] for x in by_label(ex_load, load_runs, f"hit{n}")]
        results["lengths"][str(n)] = entry
    top_entry = results["lengths"][str(top)]
    results["ttft_hit_vs_cold_8k"] = top_entry["hit_vs_cold"]
    results["ttft_vs_example_connector_8k"] = top_entry["hit_vs_example"]
    results["ttft_vs_inengine_hit_8k"] = top_entry["hit_vs_inengine"]
    results["ttft_vs_inengine_hit_paired_8k"] = top_entry["hit_vs_inengine_paired"]
    results["example_vs_inengine_hit_paired_8k"] = top_entry["example_vs_inengine_paired"]
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
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work folder (engine logs, ExampleConnector files)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    results = bench(args)
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
