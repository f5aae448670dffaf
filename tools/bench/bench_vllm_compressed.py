"""Benchmark: vLLM hits served from a compressing disk tier against exact disk hits, TTFT and output.

SmolLM2-135M (bf16, block size 128) on CPU, as tools/bench/bench_vllm.py's
disk arm: a daemon whose host tier holds one prompt's blocks over a disk tier,
with `[compression] disk = true` and the committed profile folder
(tools/bench/profiles). Two arms, each with a daemon of its own and the same
config, one after the other:

* exact: engines without an opt-in (their blocks are stored exact on disk);
* compressed: engines with `kv_connector_extra_config {"compression": PROFILE}`
  (their blocks are stored encoded on disk, decoded on promotion).

In each arm, engine 1 stores P and F (prompts of the same length), then a
fresh engine 2 alternates hits on P' and F' (each finds its chain on disk: the
other's promotion demoted it), `--repeats` each, TTFT = wall time of
`LLM.generate` with max_tokens=1; then it generates `--gen-tokens` greedy
tokens after a last hit on P'. Reported: median TTFT per arm and their ratio,
the daemon's disk-hit counter over engine 2's run, the disk tier's stored vs
logical bytes, and the greedy match length of the compressed arm's output
against the exact arm's (both hits split at the same token).

    python tools/bench/bench_vllm_compressed.py [--length 2048] [--repeats 3] [--gen-tokens 32] [--json]
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

from kvstore.tools.bench.bench_vllm import BLOCK, by_label, measure, one, prompts_for  # noqa: E402
from kvstore.tools.harness.vllm_helpers import (  # noqa: E402
    build_model,
    connector_config,
    corpus_text,
    start_daemon,
    tokenize,
)

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILE = "smollm2-135m-3b"


def plan(ids: list[int], args) -> tuple[list[dict], list[dict]]:
    n = args.length
    p, p2 = prompts_for(ids, n)
    f, f2 = prompts_for(ids[n + 3000 :], n)
    w = ids[2 * n + 4500 : 3 * n + 4500]  # warm-up: the prefill shapes of the measurements, other tokens
    warm = [one(w, "warm", reset=True), one(w[:-16] + ids[:16], "warm")]
    save = warm + [one(p, "saveP", reset=True), one(f, "saveF", reset=True)]
    load = list(warm)
    for _ in range(args.repeats):
        load += [one(p2, "hit", reset=True), one(f2, "hit", reset=True)]
    load.append({"prompts": [{"ids": p2}], "max_tokens": args.gen_tokens, "reset_prefix_cache": True, "label": "gen"})
    return save, load


def run_arm(model: str, args, save: list[dict], load: list[dict], profile: str) -> dict:
    config = os.path.join(args.workdir, "kvstore.toml")
    with open(config, "w") as f:
        f.write(f'[compression]\ndisk = true\nprofile_dir = "{args.profile_dir}"\n')
    daemon = start_daemon(args.workdir, host_bytes=args.host_bytes, disk_bytes=args.disk_bytes,
                          extra=("--config", config))
    try:
        kvt = connector_config(daemon.socket_path, **({"compression": profile} if profile else {}))
        measure(model, args.workdir, save, args, kvt)
        before = _disk(daemon)
        res = measure(model, args.workdir, load, args, kvt)
        after = _disk(daemon)
    finally:
        daemon.stop()
    hits = by_label(res, load, "hit")
    (gen,) = by_label(res, load, "gen")
    stored = sum(r["stored_bytes"] for r in after["compressed"].values())
    logical = sum(r["logical_bytes"] for r in after["compressed"].values())
    return {
        "ttft_s": statistics.median(x["wall_s"] for x in hits),
        "all_ttft_s": [x["wall_s"] for x in hits],
        "cached_tokens": [x["outputs"][0]["num_cached_tokens"] for x in hits],
        "disk_hit_blocks": int(after["hits"] - before["hits"]),
        "compressed_blocks": sum(r["blocks"] for r in after["compressed"].values()),
        "disk_ratio": round(logical / stored, 3) if stored else 1.0,
        "tokens": gen["outputs"][0]["token_ids"],
    }


def _disk(daemon) -> dict:
    client = daemon.client()
    try:
        return client.stats()["tiers"]["disk"]
    finally:
        client.close()


def bench(args) -> dict:
    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(80000))
    while len(ids) < 3 * args.length + 4600:
        ids = ids + ids
    save, load = plan(ids, args)
    exact = run_arm(model, args, save, load, "")
    lossy = run_arm(model, args, save, load, args.profile)
    match = next((i for i, (a, b) in enumerate(zip(lossy["tokens"], exact["tokens"])) if a != b),
                 min(len(lossy["tokens"]), len(exact["tokens"])))
    return {
        "model": "SmolLM2-135M-Instruct bf16", "block_size": BLOCK, "prompt_tokens": args.length,
        "profile": args.profile, "repeats": args.repeats, "threads": args.threads,
        "expected_cached_tokens": (args.length - 1) // BLOCK * BLOCK,
        "exact": exact, "compressed": lossy,
        "ttft_compressed_vs_exact": lossy["ttft_s"] / exact["ttft_s"],
        "greedy_match_tokens": match, "gen_tokens": args.gen_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--repeats", type=int, default=3, help="hits on each of P' and F' per arm (medians reported)")
    p.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens compared between the arms")
    p.add_argument("--profile", default=PROFILE, help="codec profile of the compressed arm")
    p.add_argument("--profile-dir", default=str(PROFILE_DIR), help="the daemons' [compression] profile_dir")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every engine")
    p.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND for every engine")
    p.add_argument("--host-bytes", default="64MiB", help="host tier: one prompt's blocks, not two (2k: 15 x 2.95 MB)")
    p.add_argument("--disk-bytes", default="1GiB")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.workdir = tempfile.mkdtemp(prefix="bench-vllm-compressed-")
    try:
        r = bench(args)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(r))
        return 0
    for arm in ("exact", "compressed"):
        a = r[arm]
        print(f"{arm:10s} disk hit TTFT {a['ttft_s'] * 1000:.0f} ms (median of {len(a['all_ttft_s'])}), cached "
              f"{a['cached_tokens']} of {r['expected_cached_tokens']}, disk hits {a['disk_hit_blocks']} blocks, "
              f"disk ratio {a['disk_ratio']}")
    print(f"compressed / exact TTFT {r['ttft_compressed_vs_exact']:.3f}; greedy match "
          f"{r['greedy_match_tokens']}/{r['gen_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
