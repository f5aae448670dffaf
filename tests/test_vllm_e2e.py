"""End-to-end: real vLLM engines in separate processes share prefix KV through a real daemon.

Model: SmolLM2-135M-Instruct (built locally by tools/harness/build_models.py), run in float32 (bf16
matmuls are 3-4x slower on CPUs without AVX512-BF16; tests/test_vllm_compressed.py and the hybrid
tests run engines in bf16), block size 32. Prompt A = D + tail_a, prompt B = D + tail_b with |D| = 700
tokens, so B can reuse 21 blocks (672 tokens) that engine A stored.

Correctness baseline: an engine without the connector that serves A and then B, so B
gets an in-engine prefix-cache hit split at the same token. A one-shot cold prefill
may differ from any split prefill (in bf16 it does); a split baseline does not.

Each engine runs in its own process, one at a time but for the baselines (no connector), which run
beside an engine with the connector. Engine B uses vLLM's default multiprocess engine (scheduler-side
connector in EngineCore, worker side in the Worker process). A failed load (injected in an in-process
engine) must be recomputed. The negative control corrupts the whole store, so it runs last.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvstore.tools.harness.vllm_helpers import (
    EngineRun,
    build_model,
    connector_config,
    corpus_text,
    engine_spec,
    start_daemon,
    tokenize,
    vllm_available,
)

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32
DOC = 700
EXPECTED_HIT = DOC // BS * BS  # 672
MAX_TOKENS = 24
COMMON = dict(dtype="float32", block_size=BS, kv_cache_memory_bytes=256 << 20, max_model_len=2048)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


class World:
    """Shared state of the module: model, prompts and daemon (the module-scoped fixtures run its engines once)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.model = build_model("smollm2")
        ids = tokenize(self.model, corpus_text(12000))
        assert len(ids) > DOC + 600
        self.doc = ids[:DOC]
        self.a = self.doc + ids[DOC + 100 : DOC + 130]
        self.b = self.doc + ids[DOC + 300 : DOC + 340]
        self.s = ids[DOC + 400 : DOC + 800]  # for the cache_salt checks: 12 blocks reusable
        # fresh tails for later engines (B's own full blocks are stored once engine B ran)
        self.c1 = self.doc + ids[DOC + 900 : DOC + 930]
        self.c2 = self.doc + ids[DOC + 1000 : DOC + 1030]
        self.c3 = self.doc + ids[DOC + 1100 : DOC + 1130]
        self.daemon = start_daemon(workdir)

    def spec(self, runs, conn: bool, socket: str | None = None, **kw):
        kvt = connector_config(socket or self.daemon.socket_path, **kw.pop("extra", {})) if conn else None
        return engine_spec(self.model, runs, kv_transfer_config=kvt, **COMMON, **kw)

    def start(self, runs, conn: bool, **kw) -> EngineRun:
        multiprocess = kw.pop("multiprocess", False)
        env_extra = kw.pop("env_extra", None)
        return EngineRun(self.spec(runs, conn, **kw), self.workdir, multiprocess=multiprocess, env_extra=env_extra)

    def run(self, runs, conn: bool, **kw):
        return self.start(runs, conn, **kw).result()


def one(prompt, max_tokens=MAX_TOKENS, salt=None, **kw):
    p = {"ids": prompt}
    if salt is not None:
        p["cache_salt"] = salt
    return {"prompts": [p], "max_tokens": max_tokens, **kw}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(str(tmp_path_factory.mktemp("vllm-e2e")))
    yield w
    w.daemon.stop()


@pytest.fixture(scope="module")
def first(world):
    """Engine A (with the connector) and the baseline (without it) do not depend on each other: they run
    side by side. The baseline has an in-engine prefix cache: A, B (hit from A), S salted X (cold), S salted
    X again (hit), C1 (hit from A), C3 cold (after a prefix-cache reset)."""
    a = world.start([one(world.a), one(world.s, salt="X")], conn=True)
    base = world.start([one(world.a), one(world.b), one(world.s, salt="X"), one(world.s, salt="X"),
                        one(world.c1), one(world.c3, reset_prefix_cache=True)], conn=False)
    return a.result(), base.result()


@pytest.fixture(scope="module")
def baseline(first):
    return first[1]


@pytest.fixture(scope="module")
def engine_a(first):
    return first[0]


@pytest.fixture(scope="module")
def engine_b(world, engine_a):
    """Started after A, in vLLM's multiprocess mode: B, S salted Y, S salted X."""
    return world.run([one(world.b), one(world.s, salt="Y"), one(world.s, salt="X")], conn=True, multiprocess=True)


def test_second_engine_reuses_the_prefix_and_matches_the_baseline(world, engine_a, baseline, engine_b):
    assert engine_a.cached(0) == 0
    assert engine_a.tokens(0) == baseline.tokens(0)
    assert baseline.cached(1) == EXPECTED_HIT  # the baseline really is split at the same token
    assert engine_b.cached(0) == EXPECTED_HIT
    assert engine_b.counter(0, "vllm:external_prefix_cache_hits") == EXPECTED_HIT
    assert engine_b.tokens(0) == baseline.tokens(1)
    assert "did not wait" not in engine_b.log  # the forward waited for each layer's copy


def test_cache_salt_isolates_tenants(world, engine_b, baseline):
    reusable = (len(world.s) - 1) // BS * BS
    assert engine_b.cached(1) == 0  # salt Y never sees blocks stored under salt X
    assert engine_b.tokens(1) == baseline.tokens(2)
    assert engine_b.cached(2) == reusable  # same salt hits
    assert engine_b.counter(2, "vllm:external_prefix_cache_hits") == EXPECTED_HIT + reusable
    assert engine_b.tokens(2) == baseline.tokens(3)


def test_async_load_path(world, engine_a, baseline):
    r = world.run([one(world.c1)], conn=True, extra={"load_async": True})
    assert r.cached(0) == EXPECTED_HIT
    assert r.tokens(0) == baseline.tokens(4)


def test_failed_load_is_recomputed(world, engine_a, baseline):
    """Every block copy fails (injected in the worker): vLLM is told through
    get_block_ids_with_load_errors, recomputes the whole prompt, and the output is the cold one."""
    r = world.run([one(world.c3)], conn=True, inject_load_failure=True)
    assert r.counter(0, "vllm:external_prefix_cache_hits") == EXPECTED_HIT  # the hit was reported ...
    assert "injected load failure" in r.stderr  # ... its load failed ...
    assert "Recovered from KV load failure" in r.log  # ... vLLM rescheduled it ...
    assert r.tokens(0) == baseline.tokens(5)  # ... and recomputed it: the cold output


def test_ngram_speculative_decoding(world, engine_a):
    """Same namespace as plain decoding (no draft layers): B loads what engine A stored."""
    base = world.start([one(world.a), one(world.c2)], conn=False, speculative_config=NGRAM)
    r = world.run([one(world.c2)], conn=True, speculative_config=NGRAM)
    base = base.result()
    assert r.cached(0) == EXPECTED_HIT
    assert r.counter(0, "vllm:external_prefix_cache_hits") == EXPECTED_HIT
    assert r.tokens(0) == base.tokens(1)


def test_draft_model_speculative_decoding(world):
    """Draft layers are stored too; B's prompt continues A's spec-decoded output, so saved blocks
    holding generated (verified) tokens are loaded and must be exact."""
    draft = {"method": "draft_model", "model": world.model, "num_speculative_tokens": 3}
    out_len = 64
    a_run = world.run([one(world.a, max_tokens=out_len)], conn=True, speculative_config=draft)
    out_a = a_run.tokens(0)
    b_prompt = world.a + out_a + world.b[DOC:]
    base = world.start([one(world.a, max_tokens=out_len), one(b_prompt)], conn=False, speculative_config=draft)
    b_run = world.run([one(b_prompt)], conn=True, speculative_config=draft)
    base = base.result()
    assert base.tokens(0) == out_a
    expected = (len(world.a) + out_len - 1) // BS * BS  # full blocks of verified tokens A computed
    assert base.cached(1) == expected
    assert b_run.cached(0) == expected
    assert b_run.tokens(0) == base.tokens(1)
    assert "did not wait" not in b_run.log  # target and draft layers: copied before they attend
    accepted = b_run.counter(0, "vllm:spec_decode_num_accepted_tokens")
    drafted = b_run.counter(0, "vllm:spec_decode_num_draft_tokens")
    assert drafted > 0 and accepted / drafted > 0.5  # self-draft: restored draft KV keeps acceptance high


def test_daemon_down_recomputes_warns_and_reconnects(world, baseline):
    sock = os.path.join(world.workdir, "late.sock")
    signal_path = os.path.join(world.workdir, "phase1.done")
    started = {}

    def start_later():
        deadline = time.monotonic() + 240
        while not os.path.exists(signal_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        started["daemon"] = start_daemon(os.path.join(world.workdir), socket=sock)

    t = threading.Thread(target=start_later, daemon=True)
    t.start()
    try:
        r = world.run(
            [one(world.a), one(world.b), one(world.s, signal_path=signal_path, wait_for_path=sock)],
            conn=True, socket=sock, extra={"retry_s": 0.2},
        )
        t.join(timeout=60)
        assert r.tokens(0) == baseline.tokens(0)
        assert r.tokens(1) == baseline.tokens(1)
        assert r.counter(1, "vllm:external_prefix_cache_hits") == 0
        assert "kvstore: daemon unavailable" in r.stderr
        late = started["daemon"]
        with late.client() as c:
            assert c.stats()["blocks"] > 0  # the engine reconnected and stored S
        assert "is back" in r.stderr
    finally:
        if "daemon" in started:
            started["daemon"].stop()


def test_zz_corrupted_store_changes_the_output(world, engine_b, baseline):
    """Negative control (runs last: it ruins the store): negate every stored KV value."""
    with world.daemon.client() as c:
        arena = c.arena.view(np.uint32)
        np.bitwise_xor(arena, np.uint32(0x80000000), out=arena)  # flips the sign of every float32 value
    r = world.run([one(world.b)], conn=True)
    assert r.cached(0) >= EXPECTED_HIT  # B's own blocks are stored too by now
    assert r.tokens(0) != baseline.tokens(1)
