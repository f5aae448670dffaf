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

Each engine first serves a short warm-up prompt. Repeats reset vLLM's prefix
cache between measurements (the store and the disk folder keep their data).
TTFT is the wall time of `LLM.generate` with max_tokens=1; reported values
are medians over the repeats.

    python tools/bench_vllm.py [--lengths 2048,8000] [--repeats 3] [--threads 2] [--bind 0-1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
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
    p2 = p[:-TAIL] + ids[length + 1000 : length + 1000 + TAIL]
    assert len(p2) == length and p2 != p
    return p, p2


def measure(model, workdir, runs, args, kvt=None):
    spec = engine_spec(
        model, runs, dtype="bfloat16", block_size=BLOCK, kv_cache_memory_bytes=1 << 30,
        max_model_len=8192, max_num_batched_tokens=8192, kv_transfer_config=kvt,
    )
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return run_engine(spec, workdir, threads=args.threads, timeout_s=1800, env_extra=env)


def one(ids, reset=False):
    return {"prompts": [{"ids": ids}], "max_tokens": 1, "reset_prefix_cache": reset}


def bench(args) -> dict:
    model = build_model("smollm2")
    workdir = tempfile.mkdtemp(prefix="bench-vllm-")
    ids = tokenize(model, corpus_text(80000))
    need = max(args.lengths) + 1000 + TAIL
    while len(ids) < need:
        ids = ids + ids
    pairs = {n: prompts_for(ids, n) for n in args.lengths}
    warm = [one(ids[-300:])]
    r = args.repeats

    # cold and in-engine hit: P (cold), P' (hit), repeated after a prefix-cache reset
    runs = list(warm)
    for n in args.lengths:
        for _ in range(r):
            runs += [one(pairs[n][0], reset=True), one(pairs[n][1])]
    base = measure(model, workdir, runs, args)

    def arm(kvt_factory) -> tuple[object, object]:
        save_runs = list(warm) + [one(pairs[n][0], reset=True) for n in args.lengths]
        load_runs = list(warm) + [one(pairs[n][1], reset=True) for n in args.lengths for _ in range(r)]
        return measure(model, workdir, save_runs, args, kvt_factory()), measure(model, workdir, load_runs, args, kvt_factory())

    daemon = start_daemon(workdir, host_bytes=args.host_bytes)
    try:
        kv_save, kv_load = arm(lambda: connector_config(daemon.socket))
    finally:
        daemon.stop()
    disk = os.path.join(workdir, "example-store")
    os.makedirs(disk, exist_ok=True)
    ex_save, ex_load = arm(lambda: {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": disk},
    })

    results: dict = {"model": "SmolLM2-135M-Instruct bf16", "block_size": BLOCK, "threads": args.threads,
                     "bind": args.bind, "repeats": r, "lengths": {}}
    for li, n in enumerate(args.lengths):
        base_runs = base.runs[1 + li * 2 * r : 1 + (li + 1) * 2 * r]
        load_idx = range(1 + li * r, 1 + (li + 1) * r)
        expected_hit = (n - 1) // BLOCK * BLOCK
        entry = {
            "ttft_cold_s": statistics.median(x["wall_s"] for x in base_runs[0::2]),
            "ttft_inengine_hit_s": statistics.median(x["wall_s"] for x in base_runs[1::2]),
            "ttft_cold_with_store_s": kv_save.runs[1 + li]["wall_s"],
            "ttft_kvstore_hit_s": statistics.median(kv_load.runs[i]["wall_s"] for i in load_idx),
            "ttft_example_hit_s": statistics.median(ex_load.runs[i]["wall_s"] for i in load_idx),
            "kvstore_cached_tokens": [kv_load.runs[i]["outputs"][0]["num_cached_tokens"] for i in load_idx],
            "example_cached_tokens": [ex_load.runs[i]["outputs"][0]["num_cached_tokens"] for i in load_idx],
            "expected_cached_tokens": expected_hit,
        }
        entry["hit_vs_cold"] = entry["ttft_kvstore_hit_s"] / entry["ttft_cold_s"]
        entry["hit_vs_example"] = entry["ttft_kvstore_hit_s"] / entry["ttft_example_hit_s"]
        entry["hit_vs_inengine"] = entry["ttft_kvstore_hit_s"] / entry["ttft_inengine_hit_s"]
        results["lengths"][str(n)] = entry
    top = str(max(args.lengths))
    results["ttft_hit_vs_cold_8k"] = results["lengths"][top]["hit_vs_cold"]
    results["ttft_vs_example_connector_8k"] = results["lengths"][top]["hit_vs_example"]
    results["ttft_vs_inengine_hit_8k"] = results["lengths"][top]["hit_vs_inengine"]
    return results


def table(results: dict) -> str:
    rows = ["| prompt tokens | cold | in-engine hit | kvstore hit | ExampleConnector hit | cold + store saves "
            "| kvstore/cold | kvstore/Example | kvstore/in-engine |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n, e in results["lengths"].items():
        rows.append(
            f"| {n} | {e['ttft_cold_s']*1000:.0f} ms | {e['ttft_inengine_hit_s']*1000:.0f} ms "
            f"| {e['ttft_kvstore_hit_s']*1000:.0f} ms | {e['ttft_example_hit_s']*1000:.0f} ms "
            f"| {e['ttft_cold_with_store_s']*1000:.0f} ms | {e['hit_vs_cold']:.3f} | {e['hit_vs_example']:.3f} "
            f"| {e['hit_vs_inengine']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,8000", help="prompt lengths in tokens (max 8191)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for every engine")
    p.add_argument("--bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for every engine")
    p.add_argument("--host-bytes", default="2GiB", help="daemon host tier")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    results = bench(args)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
