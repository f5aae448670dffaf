"""The chaos run (tools/bench/chaos_run.py), bounded: two real vLLM CPU engines with the connector and
one daemon, under preemption, aborts, injected load failures and a daemon SIGKILLed and restarted
mid-run; every oracle holds. Then each oracle is shown failing on a bug planted into the engines
(tools/harness/chaos_plants.py): the oracles can fail.

Engines: SmolLM2-135M float32 (most planted-bug runs: the tiny random Llama), block size 32, a
20-block KV cache with chunked prefill (96 tokens a step) and whole-prompt admission off, so that they
preempt; one engine plain, one with ngram speculative decoding and asynchronous loads. The baseline
is each finished request served alone by an engine without the connector (same speculative config,
prefix caching off, the same chunking).

Load failures are injected in 30% of the loads and every stored block is checked: at these settings
the bounded run catches both bugs that tests/test_vllm_load_failures.py pins down (outputs differing
from the baseline, stored blocks off by far more than the tolerance).
"""

from __future__ import annotations

import json

import pytest

from kvstore.tools.bench.chaos_run import ChaosConfig, run_chaos
from kvstore.tools.bench.chaos_workload import WorkloadConfig
from kvstore.tools.harness.vllm_helpers import vllm_available

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BOUNDED = ChaosConfig(workload=WorkloadConfig(seed=3, num_requests=32, arrival_steps=30), kill_at=(0.4,))


def small(**kw) -> ChaosConfig:
    """A shorter run for the planted bugs: fewer requests, only the oracle under test, and the tiny random
    Llama (tools/harness/build_models.py) where it shows the failure as well as SmolLM2 does, in half the time
    or less."""
    return ChaosConfig(**{"workload": WorkloadConfig(seed=5, num_requests=20, arrival_steps=20), "model": "tiny",
                          **kw})


def test_the_bounded_chaos_run_passes_every_oracle(tmp_path):
    report = run_chaos(BOUNDED, str(tmp_path))
    print(json.dumps({k: report[k] for k in ("engines", "restarts", "leaked_pins", "present_misses", "wall_s")},
                     indent=1))
    verdicts = report["oracles"]
    print(json.dumps(verdicts, indent=1, default=str))
    assert set(verdicts) == {"outputs", "stored_bytes", "daemon_state", "rss", "reuse"}
    assert all(v["ok"] for v in verdicts.values()), [k for k, v in verdicts.items() if not v["ok"]]
    engines = report["engines"].values()
    # what the run covered (each a precondition of the oracles meaning something)
    assert sum(e["preemptions"] for e in engines) > 0
    assert sum(e["aborted"] for e in engines) > 0
    assert sum(e["injected_load_failures"] for e in engines) > 0
    assert sum(e["prompt_logprobs_requests"] for e in engines) > 0
    assert all(e["loaded_blocks"] > 0 and e["external_hit_tokens"] > 0 for e in engines)
    assert report["restarts"] == 1
    assert verdicts["outputs"]["compared"] >= 16 and verdicts["outputs"]["mismatches"] == 0
    stored = verdicts["stored_bytes"]
    assert stored["unknown_blocks"] == 0 and stored["sampled"] == stored["stored_blocks"] >= 32  # every one
    assert verdicts["stored_bytes"]["min_wrong_block_error"] > 100 * verdicts["stored_bytes"]["tolerance"]
    assert report["leaked_pins"] == 0 and report["leaked_reservations"] == 0


def test_outputs_oracle_fails_on_a_load_failure_left_unreported(tmp_path):
    """vLLM #49250's class: a load that fails silently leaves garbage in the blocks vLLM computes on."""
    cfg = small(fail_loads=0.5, plant=((0, "silent_load_failure"), (1, "silent_load_failure")), oracles=("outputs",))
    verdict = run_chaos(cfg, str(tmp_path))["oracles"]["outputs"]
    print(json.dumps(verdict, indent=1))
    assert not verdict["ok"] and verdict["mismatches"] > 0


def test_stored_bytes_oracle_fails_on_stale_block_ids_after_preemption(tmp_path):
    """vLLM #52360's class: after preemption the connector saves from block ids that now hold another
    request's KV."""
    cfg = small(plant=((0, "stale_block_ids_on_resume"), (1, "stale_block_ids_on_resume")),
                oracles=("stored_bytes",))
    verdict = run_chaos(cfg, str(tmp_path))["oracles"]["stored_bytes"]
    print(json.dumps(verdict, indent=1, default=str))
    assert not verdict["ok"] and verdict["bad"] > 0


def test_daemon_state_and_rss_oracles_fail_on_leaks(tmp_path):
    """LMCache #1034 / #3767's class: pins of hits never loaded never released, saves never committed,
    an engine's memory growing."""
    cfg = small(plant=((0, "leak_pins"), (0, "rss_leak"), (1, "leak_pins"), (1, "drop_commits")),
                oracles=("daemon_state", "rss"), kill_at=())  # no restart: leaks from the start stay
    verdicts = run_chaos(cfg, str(tmp_path))["oracles"]
    print(json.dumps(verdicts, indent=1, default=str))
    state, rss = verdicts["daemon_state"], verdicts["rss"]
    assert not state["ok"]
    end = [f for f in state["failures"] if f["when"] == "end"]
    assert end and end[0]["pinned_blocks"] > 0 and end[0]["reserved_blocks"] > 0
    assert not rss["ok"] and list(rss["over"]) == ["0-plain"]


def test_reuse_oracle_fails_when_hits_stop(tmp_path):
    """vLLM #52735's class (an engine's offload hits silently off) and a connector that never reconnects
    after the daemon's restart."""
    # SmolLM2, not the tiny model: the engines must still be looking blocks up once the daemon is back
    # (the tiny model finishes the whole workload within the daemon's downtime)
    # 20 requests: engine 0 still looks up ~14 prompts in the bound after the restart (3 make it late); with 14
    # a fast VM left it too few
    cfg = small(plant=((0, "no_reconnect"), (1, "no_reconnect"), (1, "no_hits")), oracles=("reuse",), kill_at=(0.1,),
                model="smollm2", workload=WorkloadConfig(seed=5, num_requests=20, arrival_steps=20))
    verdict = run_chaos(cfg, str(tmp_path))["oracles"]["reuse"]
    print(json.dumps(verdict, indent=1, default=str))
    assert not verdict["ok"]
    assert verdict["loaded_blocks"]["1-ngram_async"] == 0
    assert verdict["late"] == ["0-plain"]


def test_a_hybrid_model_under_chaos(tmp_path):
    """A Gemma3-style hybrid (sliding-window and full-attention KV cache groups, vLLM's hybrid manager on):
    one engine with ngram speculative decoding and asynchronous loads, under preemption, aborts, injected
    load and save failures and a daemon restart. Its outputs match the baseline's and the daemon's state
    is clean; it loads spine blocks and attachments (connectors/hybrid.py) from the store."""
    cfg = ChaosConfig(workload=WorkloadConfig(seed=3, num_requests=32, arrival_steps=24), kill_at=(0.4,),
                      model="tiny-gemma3", engines=("ngram_async",), oracles=("outputs", "daemon_state"))
    report = run_chaos(cfg, str(tmp_path))
    verdicts = report["oracles"]
    print(json.dumps({"oracles": verdicts, "engines": report["engines"]}, indent=1, default=str))
    assert all(v["ok"] for v in verdicts.values()), [k for k, v in verdicts.items() if not v["ok"]]
    (engine,) = report["engines"].values()
    assert engine["preemptions"] > 0 and engine["aborted"] > 0 and engine["injected_load_failures"] > 0
    assert engine["loaded_blocks"] > 0 and engine["external_hit_tokens"] > 0
    assert verdicts["outputs"]["compared"] >= 8 and verdicts["outputs"]["mismatches"] == 0
    assert report["leaked_pins"] == 0 and report["leaked_reservations"] == 0
