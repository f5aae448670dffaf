"""End-to-end: a hybrid model's compressed disk hit. A Gemma3-style engine (5 sliding-window layers : 1
full, HMA on) that opts into `k4v2` stores its spine blocks (the full-attention layer's KV) encoded on disk
and its attachments (the windows at kept boundaries) exact; a fresh engine's hit promotes both from disk,
decoding the spine, and restores every group. An engine that did not opt in finds none of those blocks.

One daemon (a 6 MiB host tier, one prompt's blocks and a little more, over a disk tier; `[compression]
disk = true` and `exact_when_busy = false`, so that every spine demotion is encoded and the counts below
are exact) and real vLLM engines, one at a time:
A stores prompt A = D + tail_a, then F, whose blocks push A's down to disk; B (opted in)
serves B = D + tail_b: its hit ends at the deepest kept boundary within D; E (exact) serves B and finds
nothing. The lossy KV differs from the exact one, so B's outputs are not compared with a baseline (the
quality benchmarks judge the codec; tests/test_vllm_compressed.py compares a dense model's greedy tokens).
"""

from __future__ import annotations

import pytest

from kvstore.tools.harness.vllm_helpers import (
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

MODEL = "tiny-gemma3"
BS = 32
INTERVAL = 4 * BS
DOC = 400
HIT = DOC // INTERVAL * INTERVAL  # 384: the deepest kept boundary within D
COMMON = dict(dtype="float32", block_size=BS, kv_cache_memory_bytes=64 << 20, max_model_len=4096)


def one(ids):
    return {"prompts": [{"ids": ids}], "max_tokens": 4}


def test_a_hybrid_spine_is_stored_encoded_and_a_hit_restores_every_group(tmp_path):
    model = build_model(MODEL)
    ids = tokenize(model, corpus_text(20000))
    a = ids[:DOC] + ids[DOC + 100 : DOC + 130]
    b = ids[:DOC] + ids[DOC + 300 : DOC + 340]
    f = ids[2000 : 2000 + DOC]  # another prompt: its blocks push A's out of the host tier
    config = tmp_path / "kvstore.toml"
    config.write_text("[compression]\ndisk = true\nexact_when_busy = false\n")
    daemon = start_daemon(str(tmp_path), host_bytes="6MiB", disk_bytes="256MiB", extra=("--config", str(config)),
                          admin=True)
    try:
        lossy = connector_config(daemon.socket_path, boundary_interval=INTERVAL, compression="k4v2")
        engine_a = run_engine(engine_spec(model, [one(a), one(f)], kv_transfer_config=lossy, **COMMON), str(tmp_path))
        stats = daemon.stats()
        (tag,) = stats["tiers"]["disk"]["compressed"]
        compressed = stats["tiers"]["disk"]["compressed"][tag]["blocks"]
        rows = stats["by_namespace"]
        (spine,) = [row for row in rows.values() if not row["anchor"]]
        (attachment,) = [row for row in rows.values() if row["anchor"]]
        assert tag.startswith("k4v2@") and compressed > 0
        assert compressed == spine["blocks"].get("disk", 0)  # every spine block on disk, and nothing else
        assert attachment["blocks"].get("disk", 0) > 0  # attachments went down too, exact
        hits_before = stats["tiers"]["disk"]["hits"]
        engine_b = run_engine(engine_spec(model, [one(b)], kv_transfer_config=lossy, **COMMON), str(tmp_path))
        assert daemon.stats()["tiers"]["disk"]["hits"] > hits_before  # promoted from disk: the spine decoded
        exact = connector_config(daemon.socket_path, boundary_interval=INTERVAL)
        engine_e = run_engine(engine_spec(model, [one(b)], kv_transfer_config=exact, **COMMON), str(tmp_path))
        for r in (engine_a, engine_b, engine_e):
            assert not r.hma_off, "vLLM turned its hybrid KV cache manager off"
            assert "kvstore connector disabled" not in r.log and "compression off" not in r.log
        assert engine_b.cached(0) == HIT and engine_b.counter(0, "vllm:external_prefix_cache_hits") == HIT
        assert engine_e.cached(0) == 0 and engine_e.counter(0, "vllm:external_prefix_cache_hits") == 0
        assert len(engine_b.tokens(0)) == 4
        assert daemon.check() == []
    finally:
        daemon.stop()
