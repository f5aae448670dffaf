"""End-to-end on hybrid models: vLLM's hybrid KV cache manager stays on, and engine B's hit from engine A's
saves restores every KV cache group (connectors/hybrid.py).

Tiny random-weight models built from transformers configs (tools/harness/build_models.py): Gemma3-style
(5 sliding-window layers : 1 full), gpt-oss-style (sliding with sinks : full, MoE, bf16), Mistral-style
(a window on every layer: the window lives in the spine), Qwen3-Next-style (Gated DeltaNet state : full,
bf16) and DeepSeek-V2-style MLA (vLLM's CPU_MLA backend). For each, a fresh daemon; engine A stores a
prompt, a fresh engine B reads it, and the baseline is an engine without the connector, HMA on too, whose
prefill of B is split at the token where B's hit ends. B's tokens and their logprobs must equal the
baseline's, vLLM must keep its hybrid manager on and the KV capacity must not change. The negative control
corrupts one kind of stored page only (the attachments' windows or states, or a window spine) once B
has run, and B's next load of the same prompt (its own prefix cache reset) must give other logprobs.

Window models take prompts A = D + tail_a and B = D + tail_b: B's hit ends at the deepest kept boundary
within D (the connector's `boundary_interval` is 4 blocks here), and the baseline is a cold prefill
chunked at that token (vLLM's own prefix cache keeps sliding-window blocks sparsely: after A it gives B no
hit at all). The state model takes one prompt twice, and the baseline is vLLM's in-engine hit: vLLM keeps
a state at the prompt's last block boundary, for its own cache as for ours, and its hit on the repeat is
as long as ours must be.
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
    run_engine,
    start_daemon,
    tokenize,
    vllm_available,
)

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32
INTERVAL = 4 * BS
MAX_TOKENS = 12
# model -> (dtype, block size (None: vLLM's choice), prompt tokens D, identical prompts, what the control corrupts)
MODELS = {
    "tiny-gemma3": ("float32", BS, 400, False, "attachment"),
    "tiny-gptoss": ("bfloat16", BS, 400, False, None),
    "tiny-mistral-swa": ("float32", BS, 400, False, "spine"),
    "tiny-qwen3next": ("bfloat16", None, 1100, True, "attachment"),
}


def prompts(model: str, doc: int, same: bool) -> tuple[list[int], list[int]]:
    ids = tokenize(model, corpus_text(20000))
    if same:
        return ids[:doc], ids[:doc]
    return ids[:doc] + ids[doc + 100 : doc + 130], ids[:doc] + ids[doc + 300 : doc + 340]


def corrupt(daemon, kind: str) -> int:
    """Flip the high bit of every 16-bit word of the stored blocks of one kind (the spine, or the
    attachments: the namespace anchored to it). Returns how many blocks were changed."""
    with daemon.client() as c:
        rows = c.stats()["by_namespace"]
        targets = [ns for ns, row in rows.items() if bool(row["anchor"]) == (kind == "attachment")]
        changed = 0
        for ns in targets:
            hashes = [row[1] for row in c.list_blocks(ns, limit=10_000)[0]]
            extents = c.acquire(ns, hashes, prefix=False)
            arena = c.arena.view(np.uint8)
            for runs in extents:
                for off, n in runs or ():
                    words = arena[off : off + n].view(np.uint16)
                    np.bitwise_xor(words, np.uint16(0x8000), out=words)
                changed += runs is not None
            c.release(ns, hashes)
    return changed


@pytest.mark.parametrize("name", list(MODELS))
def test_a_hybrid_hit_restores_every_group(name, tmp_path):
    dtype, bs, doc, same, control = MODELS[name]
    model = build_model(name)
    a, b = prompts(model, doc, same)
    common = dict(dtype=dtype, block_size=bs, kv_cache_memory_bytes=64 << 20, max_model_len=4096)
    run = lambda p: {"prompts": [{"ids": p}], "max_tokens": MAX_TOKENS, "logprobs": True}  # noqa: E731
    info = {"VLLM_LOGGING_LEVEL": "INFO"}
    daemon = start_daemon(str(tmp_path))
    try:
        kv = connector_config(daemon.socket_path, boundary_interval=INTERVAL)
        # the baseline (no connector) runs beside engine A
        if same:  # vLLM's in-engine hit on the repeat
            base = EngineRun(engine_spec(model, [run(a), run(b)], **common), str(tmp_path), env_extra=info)
        else:  # a cold prefill chunked where B's hit ends: the deepest kept boundary within D
            hit = doc // INTERVAL * INTERVAL
            base = EngineRun(engine_spec(model, [run(b)], enable_prefix_caching=False, max_num_batched_tokens=hit,
                                         **common), str(tmp_path), env_extra=info)
        engine_a = run_engine(engine_spec(model, [run(a)], kv_transfer_config=kv, **common), str(tmp_path), env_extra=info)
        base = base.result()
        if same:
            hit, want = base.cached(1), base.outputs(1)[0]
        else:
            want = base.outputs(0)[0]
        runs_b = [run(b)]
        if control is not None:  # then, in the same engine, B again from a store whose `control` pages were spoiled
            spoiled, go = str(tmp_path / "b-ran"), str(tmp_path / "store-spoiled")
            runs_b.append({**run(b), "reset_prefix_cache": True, "signal_path": spoiled, "wait_for_path": go})
            threading.Thread(target=spoil, args=(daemon, control, spoiled, go), daemon=True).start()
        engine_b = run_engine(engine_spec(model, runs_b, kv_transfer_config=kv, **common), str(tmp_path), env_extra=info)
        for r in (base, engine_a, engine_b):
            assert not r.hma_off, "vLLM turned its hybrid KV cache manager off"
            assert "kvstore connector disabled" not in r.log
        if name != "tiny-mistral-swa":  # (one KV cache group of sliding-window layers: vLLM logs no group sizes)
            assert "," in engine_b.log.split("kv cache group sizes (")[1].split(")")[0]  # several groups
        assert engine_b.num_blocks == base.num_blocks  # the same KV capacity with and without the connector
        assert hit > 0 and engine_b.cached(0) == hit
        assert engine_b.counter(0, "vllm:external_prefix_cache_hits") == hit
        assert engine_b.tokens(0) == want["token_ids"]
        assert engine_b.outputs(0)[0]["logprobs"] == want["logprobs"]
        if control is not None:
            assert engine_b.cached(1) >= hit  # loaded again (B's own blocks are stored by now too) ...
            assert engine_b.outputs(1)[0]["logprobs"] != want["logprobs"]  # ... and the spoiled pages were used
    finally:
        daemon.stop()


def spoil(daemon, kind: str, ready: str, go: str) -> None:
    """Once engine B's first run is over (`ready` exists), spoil the store's `kind` pages, then let it go on."""
    deadline = time.monotonic() + 300
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert corrupt(daemon, kind) > 0
    finally:
        open(go, "w").close()


def test_mla_on_cpu_stores_its_latents_and_takes_no_hit(tmp_path):
    """vLLM's CPU MLA backend computes a prompt from its first token only (the CPU platform turns prefix
    caching off for it; with a loaded prefix of byte-identical KV it gives other tokens): the connector
    stores the engine's blocks, one latent row per token, and offers no hit, saying why."""
    model = build_model("tiny-mla")
    ids = tokenize(model, corpus_text(20000))[:400]
    common = dict(dtype="bfloat16", block_size=16, kv_cache_memory_bytes=64 << 20, attention_backend="CPU_MLA")
    run = {"prompts": [{"ids": ids}], "max_tokens": MAX_TOKENS}
    daemon = start_daemon(str(tmp_path))
    try:
        kv = connector_config(daemon.socket_path)
        engine_a = run_engine(engine_spec(model, [run], kv_transfer_config=kv, **common), str(tmp_path))
        engine_b = run_engine(engine_spec(model, [run], kv_transfer_config=kv, **common), str(tmp_path))
        with daemon.client() as c:
            (row,) = c.stats()["by_namespace"].values()
        assert row["block_bytes"] == 2 * 16 * 576 * 2 and row["blocks"]["host"] == 400 // 16  # 2 layers, no V
        assert "computes prompts without a cached context" in engine_b.log
        assert engine_b.cached(0) == 0 and engine_b.tokens(0) == engine_a.tokens(0)  # both cold: no hit taken
    finally:
        daemon.stop()
