"""Benchmark: hybrid models (connectors/hybrid.py) — time to first token of a hit from another engine, and
the bytes the store keeps per hit token.

Per model (tiny random-weight models built by tools/harness/build_models.py; vLLM's hybrid KV cache
manager on), every engine in its own process with the same thread pinning as tools/bench/bench_vllm.py:

* engine 1 with the connector serves prompt P (`--length` tokens) and a second prompt F, which stores them;
* a fresh engine 2 with the connector alternates, `--repeats` times: an external hit on P (vLLM's prefix
  cache reset first), then P again in the same engine: an in-engine hit of the same prompt. The paired
  ratio (external / in-engine, medians) is insensitive to the other tenants of a shared machine; the goal
  is <= 1.02, as for dense models.
* stored bytes: the daemon's bytes in the model's namespaces (spine and attachments) per hit token,
  against storing every KV cache group's every block (what vLLM's OffloadingConnector keeps: its sliding
  window mask is dense) for the same prompts. The same hits for fewer stored bytes is the goal.

    python tools/bench/bench_vllm_hybrid.py [--models tiny-gemma3,tiny-gptoss,tiny-mistral-swa,tiny-qwen3next]
        [--length 2048] [--repeats 5] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
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

MODELS = {  # name -> (dtype, block size (None: vLLM's, which the state model sets from its page size),
    #                   attention layers, whether the other layers are recurrent state)
    "tiny-gemma3": ("float32", 32, 6, False),
    "tiny-gptoss": ("bfloat16", 32, 4, False),
    "tiny-mistral-swa": ("float32", 32, 4, False),
    "tiny-qwen3next": ("bfloat16", None, 1, True),
    "bench-gemma3": ("bfloat16", 32, 12, False),  # ~190M parameters: an in-engine hit of tens of ms
}


def one(ids: list[int], label: str, reset: bool = False) -> dict:
    return {"prompts": [{"ids": ids}], "max_tokens": 1, "reset_prefix_cache": reset, "label": label}


def measure(model: str, workdir: str, runs: list[dict], args, dtype: str, bs, kvt=None):
    spec = engine_spec(model, runs, dtype=dtype, block_size=bs, kv_cache_memory_bytes=512 << 20,
                       max_model_len=4096, kv_transfer_config=kvt)
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "INFO"}
    return run_engine(spec, workdir, threads=args.threads, timeout_s=1800, env_extra=env)


def bench_model(name: str, ids: list[int], args) -> dict:
    dtype, bs, attention_layers, state = MODELS[name]
    model = build_model(name)
    workdir = tempfile.mkdtemp(prefix=f"bench-hybrid-{name}-")
    p, f = ids[: args.length], ids[args.length + 500 : 2 * args.length + 500]
    warm = ids[2 * args.length + 1000 : 3 * args.length + 1000]
    daemon = start_daemon(workdir, host_bytes="2GiB")
    try:
        kvt = connector_config(daemon.socket_path)
        save = [one(warm, "warm", reset=True), one(p, "save", reset=True), one(f, "save", reset=True)]
        measure(model, workdir, save, args, dtype, bs, kvt)
        with daemon.client() as c:
            rows = c.stats()["by_namespace"]
        stored = sum(sum(r["bytes"].values()) for r in rows.values())
        (spine,) = [r for r in rows.values() if not r["anchor"]]
        attachment = [r for r in rows.values() if r["anchor"]]
        positions = sum(spine["blocks"].values())
        # every group's every block: each attention layer's page at every position (the spine's page per
        # layer), and a state model's states at every block boundary too
        every = positions * (spine["block_bytes"] // spine["num_layers"] * attention_layers
                             + (attachment[0]["block_bytes"] if state and attachment else 0))
        load = [one(warm, "warm", reset=True), one(warm, "warm")]
        for _ in range(args.repeats):
            load += [one(p, "hit", reset=True), one(p, "local")]
        res = measure(model, workdir, load, args, dtype, bs, kvt)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    runs = list(zip(res.runs, load))
    hit = [r["wall_s"] for r, s in runs if s["label"] == "hit"]
    local = [r["wall_s"] for r, s in runs if s["label"] == "local"]
    cached = [r["outputs"][0]["num_cached_tokens"] for r, s in runs if s["label"] == "hit"]
    return {
        "model": name, "prompt_tokens": args.length, "hit_tokens": cached,
        "ttft_kvstore_hit_s": statistics.median(hit), "ttft_inengine_hit_s": statistics.median(local),
        "hit_vs_inengine_paired": statistics.median(hit) / statistics.median(local),
        "stored_bytes": stored, "every_group_every_block_bytes": every,
        "stored_vs_every_block": stored / every if every else None,
        "stored_bytes_per_hit_token": stored / max(cached[0], 1) / 2,  # two prompts stored, one hit measured
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))  # (bench-gemma3 is built on first use: ~1 GB, a minute)
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="hits and in-engine hits (medians reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bind", default="nobind")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tok_model = build_model("tiny")
    ids = tokenize(tok_model, corpus_text(120000))
    out = [bench_model(name, ids, args) for name in args.models.split(",")]
    if args.json:
        print(json.dumps(out))
        return 0
    print("| model | hit tokens | kvstore hit | in-engine hit | paired ratio | stored / every group's every block |")
    print("|---|---|---|---|---|---|")
    for r in out:
        ratio = f"{r['stored_vs_every_block']:.3f}" if r["stored_vs_every_block"] else "-"
        print(f"| {r['model']} | {r['hit_tokens'][0]} | {r['ttft_kvstore_hit_s'] * 1000:.0f} ms "
              f"| {r['ttft_inengine_hit_s'] * 1000:.0f} ms | {r['hit_vs_inengine_paired']:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
