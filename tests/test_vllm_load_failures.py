"""A failed load under vLLM's prefix cache, with real engines (found by the chaos run's probes).

Three bugs, each with its test:

1. vLLM caches the blocks of a synchronous connector load when it allocates them, so a request
   admitted after the loading one in the same step gets them as a local prefix hit and attends to
   them in the same forward. When the load fails, that second request's new blocks are computed on
   garbage: vLLM recomputes them (its output stays right), but the connector must not save them.
   Before the fix it did, and a later engine that loaded them gave wrong output.
2. With kv_load_failure_policy "recompute" vLLM leaves the failed blocks in its prefix cache, to be
   recomputed by the request that loaded them. If that request is aborted (or preempted) before it
   has, a request admitted later hits the garbage in the local prefix cache: its output was wrong
   from the first token, and the connector stored its blocks. The connector now evicts the failed
   blocks, and what followed them in each request that held them, from vLLM's prefix cache.
3. With asynchronous loads, a request whose load failed at its first block is freed and admitted again
   ahead of the requests whose loads finished; answered with another asynchronous load it may not fit
   beside their reservations, and vLLM's scheduler stops at it every step: the engine never moves again.
   The connector answers it with a synchronous load.

SmolLM2 float32, block size 32, chunked prefill of 96 tokens; each test's engines are in its docstring
or its first lines. Baseline: each prompt served alone by an engine without the connector, same
chunking, prefix caching off; it runs beside the test's other engines from the start.
"""

from __future__ import annotations

import pytest

from kvstore.tools.harness.vllm_helpers import (
    EngineRun,
    build_model,
    connector_config,
    corpus_text,
    engine_spec,
    run_engine,
    start_daemon,
    tokenize,
    vllm_available,
)

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32
COMMON = dict(dtype="float32", block_size=BS, kv_cache_memory_bytes=64 << 20, max_model_len=1024,
              max_num_batched_tokens=96)


def one(prompt: list[int]) -> dict:
    """A step list of one prompt, 24 greedy tokens."""
    return {"prompts": [{"ids": prompt}], "max_tokens": 24}


def store_prefixes(model: str, daemon, prompts: list[list[int]], workdir: str) -> None:
    """Engine A serves `prompts` (2 tokens each) with the connector: their full blocks are stored."""
    run_engine(engine_spec(model, [{"prompts": [{"ids": x} for x in prompts], "max_tokens": 2}],
                           kv_transfer_config=connector_config(daemon.socket_path), **COMMON), workdir)


def test_a_request_sharing_a_failed_load_stores_no_wrong_block(tmp_path):
    """Engine A stores the 12-block prefix P; engine B (every load fails at a seeded random block) serves
    R = P + a and R2 = P + b together (R loads P, R2 hits R's blocks locally); engine C then serves R2.
    Both R and R2 hold the failed blocks: vLLM recomputes them in one of them while the other attends to
    them as they are, so neither offers its blocks from the first failed one on (the connector cannot see
    whether the recomputing one is aborted first): C loads P alone, and its output is the baseline's."""
    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(20000))
    p = ids[: 12 * BS]
    r, r2 = p + ids[2000:2040], p + ids[3000:3050]
    workdir = str(tmp_path)
    daemon = start_daemon(workdir, host_bytes="256MiB", admin=True)
    base = EngineRun(engine_spec(model, [one(r), one(r2)], enable_prefix_caching=False, **COMMON), workdir)  # beside
    try:
        store_prefixes(model, daemon, [p + ids[5000:5010]], workdir)
        b = run_engine(engine_spec(model, [{"prompts": [{"ids": r}, {"ids": r2}], "max_tokens": 24}],
                                   kv_transfer_config=connector_config(daemon.socket_path, fail_loads=1.0), **COMMON),
                       workdir)
        c = run_engine(engine_spec(model, [one(r2)], kv_transfer_config=connector_config(daemon.socket_path),
                                   **COMMON), workdir)
        base = base.result()
        assert daemon.check() == []
    finally:
        daemon.stop()
    assert "injected load failure" in b.log and "Recovered from KV load failure" in b.log
    assert b.cached(0, 0) == b.cached(0, 1) == 12 * BS  # R loaded P, R2 hit R's blocks
    assert b.tokens(0, 0) == base.tokens(0) and b.tokens(0, 1) == base.tokens(1)  # vLLM recomputed
    assert c.cached(0) == 12 * BS  # C loaded P (A's); B stored nothing of R2 from the failed block on
    assert c.tokens(0) == base.tokens(1)


def test_a_failed_load_whose_request_is_aborted_leaves_no_garbage_in_the_prefix_cache(tmp_path):
    """Engine B: R = P + a loads P, every load failing at a seeded block (block 6 of 12); R is aborted the
    step after (it has recomputed 3 of the 6 failed blocks); R5 = P + c arrives then and hits P in vLLM's
    prefix cache. Engine C then loads R5's stored chain."""
    from pathlib import Path

    from kvstore.tools.harness.chaos_procs import EngineProc, wait_all

    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(20000))
    p = ids[: 12 * BS]
    r, r5 = p + ids[2000:2040], p + ids[3000:3050]
    workdir = str(tmp_path)
    daemon = start_daemon(workdir, host_bytes="256MiB", admin=True)
    base = EngineRun(engine_spec(model, [one(r5)], enable_prefix_caching=False, **COMMON), workdir)  # beside
    try:
        store_prefixes(model, daemon, [p + ids[5000:5010]], workdir)
        requests = [dict(rid="R", engine=0, ids=r, max_tokens=24, arrive_step=0, abort="admitted"),
                    dict(rid="R5", engine=0, ids=r5, max_tokens=24, arrive_step=2)]
        kvt = connector_config(daemon.socket_path, fail_loads=1.0, fault_seed=0)
        b = EngineProc("b", Path(workdir) / "b", {"engine": dict(model=model, **COMMON, kv_transfer_config=kvt),
                                                   "requests": requests, "hold": False}).start()
        wait_all([b], 600, idle=False)
        res = b.result()["results"]
        c = run_engine(engine_spec(model, [one(r5)], kv_transfer_config=connector_config(daemon.socket_path),
                                   **COMMON), workdir)
        base = base.result()
        assert daemon.check() == []
    finally:
        daemon.stop()
    log = (Path(workdir) / "b" / "engine.log").read_text()
    assert "failed at block 6/12" in log and res["R"]["outcome"] == "aborted"
    assert res["R"]["state"]["num_computed_tokens"] < 12 * BS  # aborted before it recomputed the failed blocks
    assert res["R5"]["token_ids"] == base.tokens(0)
    assert c.tokens(0) == base.tokens(0)


def test_an_asynchronous_load_failed_at_its_first_block_does_not_deadlock_the_scheduler(tmp_path):
    """Engine B (asynchronous loads, a KV cache of 20 blocks, chunked prefill, whole-prompt admission off)
    admits R1 = P1 + a (loads 5 blocks) and R2 = P2 + b (loads 8 blocks of a 17-block prompt) in one step;
    R1's load fails at its first block (seeded), R2's succeeds. vLLM frees R1's blocks and admits it
    again from the queue of requests that held blocks, ahead of R2. Answered as another asynchronous load,
    R1 must leave R2's remaining 9 blocks free (vLLM's reservation for in-flight prefills, R1's own
    counted in it too): it does not fit, the scheduler stops at it every step, and R2, finished loading
    behind it, is never promoted: nothing moves again (the engine stepped forever before the fix). A
    request whose asynchronous load failed is answered with a synchronous load."""
    from pathlib import Path

    from kvstore.tools.bench.chaos_run import block_bytes
    from kvstore.tools.harness.chaos_procs import EngineProc, wait_all

    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(20000))
    p1, p2 = ids[: 5 * BS], ids[1000 : 1000 + 8 * BS]
    r1, r2 = p1 + ids[2000:2010], p2 + ids[3000:3284]
    workdir = str(tmp_path)
    daemon = start_daemon(workdir, host_bytes="256MiB", admin=True)
    base = EngineRun(engine_spec(model, [{"prompts": [{"ids": r1}], "max_tokens": 8},  # beside
                                         {"prompts": [{"ids": r2}], "max_tokens": 8}],
                                 enable_prefix_caching=False, **COMMON), workdir)
    try:
        store_prefixes(model, daemon, [p1 + ids[4000:4010], p2 + ids[4000:4010]], workdir)
        small = dict(COMMON, kv_cache_memory_bytes=21 * block_bytes(model, BS), max_model_len=640,
                     scheduler_reserve_full_isl=False)
        requests = [dict(rid="R1", engine=0, ids=r1, max_tokens=8, arrive_step=0),
                    dict(rid="R2", engine=0, ids=r2, max_tokens=8, arrive_step=0)]
        kvt = connector_config(daemon.socket_path, fail_loads=0.5, fault_seed=36, load_async=True)
        b = EngineProc("b", Path(workdir) / "b", {"engine": dict(model=model, **small, kv_transfer_config=kvt),
                                                   "requests": requests, "hold": False}).start()
        wait_all([b], 300, idle=False)  # raises with the scheduler's state when the engine is stuck
        res = b.result()["results"]
        base = base.result()
        assert daemon.check() == []
    finally:
        daemon.stop()
    log = (Path(workdir) / "b" / "engine.log").read_text()
    assert "load of R1" in log and "failed at block 0/5" in log and "load of R2" not in log
    assert res["R1"]["outcome"] == res["R2"]["outcome"] == "finished"
    assert res["R2"]["num_cached_tokens"] == 8 * BS  # R2's load was taken
    assert res["R1"]["num_cached_tokens"] == 5 * BS  # R1's second load (synchronous) was taken
    assert res["R1"]["token_ids"] == base.tokens(0) and res["R2"]["token_ids"] == base.tokens(1)
