"""Run one vLLM engine in this process and print its results as JSON (driven by tests and benchmarks).

    python tools/harness/engine_runner.py SPEC.json

SPEC keys: model, dtype, block_size, kv_cache_memory_bytes, max_model_len,
max_num_batched_tokens (optional), enable_prefix_caching (default true),
inject_load_failure (test only, in-process engines: every connector block load fails),
kv_transfer_config (optional dict), speculative_config (optional dict),
attention_backend (optional, e.g. "CPU_MLA"), and
runs: a list of {"prompts": [{"ids": [...]} | {"text": "..."}, optional
"cache_salt"], "max_tokens": N, optional "wait_for_path": P, optional
"signal_path": P, optional "reset_prefix_cache": true, optional "logprobs": true}. Runs are generated one after another in the same engine;
before a run, `signal_path` is created and the runner waits (60 s at most)
until `wait_for_path` exists. The last stdout line is
`ENGINE_RESULT {json}`: per run the outputs (token ids, their logprobs with
"logprobs", prompt length and token ids, num_cached_tokens) and its wall time, the engine's
KV capacity in blocks (num_blocks), and the engine's counters (prefix-cache,
external-hit and speculative-decoding metrics) after each run.
"""

from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:
        return out
    for m in metrics:
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(value)
    return out


def _prompt(p: dict) -> dict:
    prompt = {"prompt_token_ids": p["ids"]} if "ids" in p else {"prompt": p["text"]}
    if p.get("cache_salt") is not None:
        prompt["cache_salt"] = p["cache_salt"]
    return prompt


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)


def _inject_load_failure() -> None:
    """In-process engines only: every load's copy into the paged KV fails (whole-step, layer-wise and
    waited loads alike); saves are untouched."""
    from kvstore.connectors.cpu_copy import CpuTransfers, Ticket

    def failing_load(self, *args, **kwargs):
        return Ticket(RuntimeError("injected load failure (test)"))

    CpuTransfers.load = failing_load
    CpuTransfers.load_layers = failing_load


def _llm_kwargs(spec: dict) -> dict:
    kwargs = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 256 << 20),
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        disable_log_stats=False,
        seed=0,
    )
    for key in ("max_num_batched_tokens", "kv_transfer_config", "speculative_config", "max_num_seqs"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    if spec.get("attention_backend"):  # e.g. CPU_MLA, so that hosts with and without AMX pick the same one
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    return kwargs


def _run(llm, run: dict) -> dict:
    from vllm import SamplingParams

    if run.get("signal_path"):
        open(run["signal_path"], "w").close()
    if run.get("wait_for_path"):
        _wait_for(run["wait_for_path"])
    if run.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=run.get("max_tokens", 16), ignore_eos=True,
                            logprobs=1 if run.get("logprobs") else None)
    t0 = time.perf_counter()
    outs = llm.generate([_prompt(p) for p in run["prompts"]], params, use_tqdm=False)
    wall_s = time.perf_counter() - t0
    outputs = [
        {
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "prompt_len": len(o.prompt_token_ids or []),
            "prompt_token_ids": list(o.prompt_token_ids or []),
            "num_cached_tokens": o.num_cached_tokens,
            # the logprob of each generated token (with "logprobs" in the run): outputs that match token for
            # token can still differ in their numbers
            "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            if o.outputs[0].logprobs else None,
        }
        for o in outs
    ]
    return {"wall_s": wall_s, "outputs": outputs, "counters": _counters(llm)}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM

    if spec.get("inject_load_failure"):
        _inject_load_failure()
    t0 = time.perf_counter()
    llm = LLM(**_llm_kwargs(spec))
    startup_s = time.perf_counter() - t0
    results = [_run(llm, run) for run in spec["runs"]]
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks  # the KV capacity vLLM settled on
    print("ENGINE_RESULT " + json.dumps({"startup_s": startup_s, "runs": results, "num_blocks": blocks}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
