"""Benchmark: prefill/decode disaggregation through the store: a kv_consumer engine's TTFT on prompts a
kv_producer engine computed, and what waiting for in-flight blocks adds.

SmolLM2-135M (bf16, block size 128) on CPU; one daemon; a producer engine
(kv_producer) and a consumer engine (kv_consumer), each an offline `LLM` in its
own process, driven over stdin/stdout, 1 OpenMP thread each, unbound. For each
prompt length (2k and 8k tokens by default), fresh prompts per arm and repeat:

* cold: the consumer serves a prompt nothing has stored (waiting off for it);
* after producer: the producer serves P (max_tokens=1) to the end, then the
  consumer serves P: it loads floor((L-1)/128) blocks;
* local hit: the consumer serves P again right after (vLLM's in-engine prefix
  cache, the same split): the ratio after-producer / local-hit is the cost of
  getting the KV from the other engine (goal <= 1.1);
* waiting: both are sent at once, the consumer's request marked as the proxy
  marks it (kv_transfer_params kvstore_wait): it waits for the producer's
  blocks, then loads them. Added latency = consumer's first-token time minus
  the producer's finish time (both on the machine's monotonic clock; goal
  <= 50 ms at 8k), and the consumer's TTFT vs the producer's own. The consumer
  still computes the prompt's tail after the load (a local hit computes it
  too), so `wait_overhead_ms` = added latency - local-hit TTFT is the part
  that waiting itself costs (two different prefills subtracted: noisy).
  The connector's debug traces time the stages exactly (`stages_ms`: the
  daemon's wake-up after the last commit, acquire, copy, ...), and
  `ready_after_producer` is the end of the consumer's copy minus the
  producer's finish: the waiting path's latency without the tail prefill.

TTFT is the wall time of `LLM.generate(max_tokens=1)`; medians over --repeats.

    python tools/bench/bench_pd.py [--lengths 2048,8000] [--repeats 3] [--dtype auto] [--wait-s 300] [--arms all|waiting] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.tools.harness.vllm_helpers import base_env, build_model, connector_config, corpus_text, start_daemon, tokenize  # noqa: E402

BS = 128

ENGINE = r"""
import json, logging, sys, time
sys.path.insert(0, sys.argv[1])
from vllm import LLM, SamplingParams
traces = []  # the connector's stage times (monotonic), for the waiting arm's breakdown
class Trace(logging.Handler):
    def emit(self, record):
        if hasattr(record, "kvstore_trace"):
            traces.append(record.kvstore_trace)
conn_log = logging.getLogger("kvstore.connectors.vllm_worker")
conn_log.setLevel(logging.DEBUG)
conn_log.addHandler(Trace())
spec = json.loads(sys.argv[2])
llm = LLM(model=spec["model"], dtype=spec["dtype"], block_size=128, kv_cache_memory_bytes=1 << 30,
          max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_model_len"], enforce_eager=True,
          enable_prefix_caching=True, seed=0, kv_transfer_config=spec["kvt"])
print("READY", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": cmd["params"]} if cmd.get("params") else None)
    traces.clear()
    t0 = time.monotonic()
    out = llm.generate([{"prompt_token_ids": cmd["ids"]}], params, use_tqdm=False)[0]
    t1 = time.monotonic()
    print("RESULT " + json.dumps({"t0": t0, "t1": t1, "cached": out.num_cached_tokens, "trace": traces}), flush=True)
"""


class Engine:
    def __init__(self, model: str, kvt: dict, max_model_len: int, workdir: str, name: str, dtype: str) -> None:
        spec = json.dumps({"model": model, "kvt": kvt, "max_model_len": max_model_len, "dtype": dtype})
        self.log = open(os.path.join(workdir, f"{name}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(REPO), spec], cwd=REPO,
                                     env=base_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"engine {name} did not start; see {self.log.name}")

    def send(self, ids: list[int], params: dict | None = None) -> None:
        self.proc.stdin.write(json.dumps({"ids": ids, "params": params}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError("engine exited")

    def serve(self, ids: list[int], params: dict | None = None) -> dict:
        self.send(ids, params)
        return self.result()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def stages(pr: dict, cr: dict) -> dict[str, float]:
    """Where the waiting consumer's time after the producer's last commit went (seconds): the daemon's
    wait answering (wake), the acquire, waiting for the engine thread's next get_finished (to_copy),
    the copy, and the rest (after_copy): reporting the request and the tail prefill a local hit
    computes too. The producer returns its own request `producer_after_commit` after that commit;
    `ready_after_producer` = the copy's end - the producer's finish is what the waiting path adds
    over the producer's finish before the consumer can compute (the goal's measure)."""
    commits = [t["at"] for t in pr["trace"] if "committed" in t]
    loads = [t for t in cr["trace"] if "copy_end" in t]
    if not commits or len(loads) != 1:
        return {}
    w = loads[0]
    return {"wake": w["answered"] - max(commits), "acquire": w["acquired"] - w["answered"],
            "to_copy": w["copy_start"] - w["acquired"], "copy": w["copy_end"] - w["copy_start"],
            "after_copy": cr["t1"] - w["copy_end"], "producer_after_commit": pr["t1"] - max(commits),
            "ready_after_producer": w["copy_end"] - pr["t1"]}


def measure(producer: Engine, consumer: Engine, prompts, length: int, repeats: int, arms: str = "all") -> dict:
    """`arms` "all": every arm of the docstring; "waiting": only the waiting arm, its local hit being
    the same prompt served again by the consumer."""
    rows: dict[str, list[float]] = {k: [] for k in ("cold", "after_producer", "local_hit", "producer",
                                                   "waiting", "waiting_added")}
    cached: dict[str, list[int]] = {"after_producer": [], "waiting": []}
    parts: dict[str, list[float]] = {}
    for r in range(repeats):
        if arms == "all":
            cold = consumer.serve(next(prompts), {"kvstore_wait_s": 0})
            rows["cold"].append(cold["t1"] - cold["t0"])
            p = next(prompts)
            producer.serve(p)
            hit = consumer.serve(p)
            rows["after_producer"].append(hit["t1"] - hit["t0"])
            cached["after_producer"].append(hit["cached"])
            for t in hit["trace"]:
                if "loaded" in t:  # the step load's own times
                    for k in ("acquire", "copy", "release"):
                        parts.setdefault(f"load_{k}", []).append(t[k])
            local = consumer.serve(p)
            rows["local_hit"].append(local["t1"] - local["t0"])
        w = next(prompts)
        producer.send(w)
        consumer.send(w, {"kvstore_wait": True})
        pr, cr = producer.result(), consumer.result()
        rows["producer"].append(pr["t1"] - pr["t0"])
        rows["waiting"].append(cr["t1"] - cr["t0"])
        rows["waiting_added"].append(cr["t1"] - pr["t1"])
        cached["waiting"].append(cr["cached"])
        for k, v in stages(pr, cr).items():
            parts.setdefault(k, []).append(v)
        if arms == "waiting":
            local = consumer.serve(w)
            rows["local_hit"].append(local["t1"] - local["t0"])
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    out = {
        "prompt_tokens": length,
        "loaded_tokens_expected": (length - 1) // BS * BS,
        "cached_tokens": cached,
        **{f"{k}_ms": round(v * 1000, 1) for k, v in med.items()},
        # what waiting adds beyond what the consumer must do anyway after the producer's commit
        # (load + the tail prefill that a local hit computes too)
        "wait_overhead_ms": round((med["waiting_added"] - med["local_hit"]) * 1000, 1),
        "stages_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in parts.items()},
        "all_ms": {k: [round(x * 1000, 1) for x in v] for k, v in {**rows, **parts}.items() if v},
    }
    if arms == "all":
        out["after_producer_vs_local_hit"] = round(med["after_producer"] / med["local_hit"], 3)
        out["after_producer_vs_cold"] = round(med["after_producer"] / med["cold"], 3)
    return out


def cpu_dtype() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="auto: bfloat16 where the CPU has AVX-512 bf16 or AMX, else float32 (vLLM CPU's bf16 "
                         "path is ~5x slower without them)")
    ap.add_argument("--wait-s", type=float, default=300.0,
                    help="the consumer's wait for in-flight blocks (longer than a producer's prefill)")
    ap.add_argument("--arms", choices=("all", "waiting"), default="all",
                    help="waiting: only the waiting arm (and a local hit on its prompt), with its stage times")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype = cpu_dtype() if args.dtype == "auto" else args.dtype
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(400_000))
    max_len = max(lengths) + 64
    workdir = tempfile.mkdtemp(prefix="bench-pd-")
    daemon = start_daemon(workdir, host_bytes="4GiB")
    results = []
    try:
        kvt_p = {**connector_config(daemon.socket_path), "kv_role": "kv_producer"}
        kvt_c = {**connector_config(daemon.socket_path, wait_s=args.wait_s), "kv_role": "kv_consumer"}
        engines: dict[str, Engine] = {}
        threads = [threading.Thread(target=lambda n, k: engines.__setitem__(n, Engine(model, k, max_len, workdir, n, dtype)),
                                    args=(n, k)) for n, k in (("producer", kvt_p), ("consumer", kvt_c))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        producer, consumer = engines["producer"], engines["consumer"]
        counter = [0]

        def fresh(length):
            while True:  # a token of its own first: no two prompts share a block
                counter[0] += 1
                start = (counter[0] * 997) % max(len(ids) - length, 1)
                yield [2000 + counter[0]] + ids[start : start + length - 1]

        # warm-up: every prefill shape once, on other tokens
        for length in lengths:
            gen = fresh(length)
            w = next(gen)
            producer.serve(w)
            consumer.serve(w)
            if args.arms == "all":
                consumer.serve(next(gen), {"kvstore_wait_s": 0})
        for length in lengths:
            results.append(measure(producer, consumer, fresh(length), length, args.repeats, args.arms))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        producer.close()
        consumer.close()
    finally:
        daemon.stop()
    if args.json:
        print(json.dumps({"dtype": dtype, "wait_s": args.wait_s, "results": results}, indent=1))
    else:
        for r in results:
            if "cold_ms" in r:
                print(f"{r['prompt_tokens']:>6} tokens: cold {r['cold_ms']} ms, after producer {r['after_producer_ms']} ms, "
                      f"local hit {r['local_hit_ms']} ms (x{r['after_producer_vs_local_hit']})")
            print(f"{r['prompt_tokens']:>6} tokens: producer {r['producer_ms']} ms, waiting consumer {r['waiting_ms']} ms, "
                  f"added {r['waiting_added_ms']} ms, local hit {r['local_hit_ms']} ms, overhead "
                  f"{r['wait_overhead_ms']} ms; stages {r['stages_ms']}")


if __name__ == "__main__":
    main()
