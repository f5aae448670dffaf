"""End-to-end: a compressed disk hit is served to the engine that opted in, never to one that did not.

One daemon (a small host tier over a disk tier, `[compression] disk = true`,
the committed SmolLM2-135M profile) and two real vLLM engines, one at a time:

- engine L opts in (`kv_connector_extra_config {"compression": PROFILE}`):
  it stores P, then F (F's blocks push P's to disk, encoded), then serves P'
  (P with another last partial block) after a prefix-cache reset: an external
  hit whose blocks the daemon promotes from disk, decoding them;
- engine E does not opt in: it serves P on the same daemon and finds nothing
  (its namespace is the exact one; every stored block of P is the lossy one),
  then P' with vLLM's own prefix cache: the exact baseline, split at the same
  token, that L's output is matched against (greedy, first token at least).

Evidence read from the daemon, not assumed: the disk tier holds compressed
blocks under the profile's tag, its hit counter rises over L's hit, and no
block of E's namespace is compressed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstore.tools.bench

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

PROFILE = "smollm2-135m-3b"
PROFILE_DIR = Path(kvstore.tools.bench.__file__).parent / "profiles"
BS = 32
DOC = 400
HIT = (DOC - 1) // BS * BS  # 384: 12 blocks of 737,280 B
COMMON = dict(dtype="bfloat16", block_size=BS, kv_cache_memory_bytes=128 << 20, max_model_len=1024)


def one(ids, reset=False, max_tokens=8):
    return {"prompts": [{"ids": ids}], "max_tokens": max_tokens, "reset_prefix_cache": reset}


def disk_stats(daemon) -> dict:
    with daemon.client() as c:
        return c.stats()["tiers"]["disk"]


def test_compressed_disk_hit_reaches_only_the_engine_that_opted_in(tmp_path):
    workdir = str(tmp_path)
    model = build_model("smollm2")
    ids = tokenize(model, corpus_text(8000))
    p = ids[:DOC]
    p2 = p[:-8] + ids[DOC + 50 : DOC + 58]
    f = ids[DOC + 100 : 2 * DOC + 100]
    # host: 12 MiB = 48 pages = 16 blocks, less than P and F together (24)
    daemon = start_daemon(workdir, host_bytes="12MiB", disk_bytes="256MiB",
                          extra=("--config", _config(tmp_path)), admin=True)
    try:
        lossy = connector_config(daemon.socket_path, compression=PROFILE)
        store = run_engine(engine_spec(model, [one(p), one(f)], kv_transfer_config=lossy, **COMMON), workdir)
        assert store.cached(0) == 0
        before = disk_stats(daemon)
        (tag,) = before["compressed"]
        assert tag.startswith(PROFILE + "@") and before["compressed"][tag]["blocks"] > 0
        hit = run_engine(engine_spec(model, [one(p2, reset=True)], kv_transfer_config=lossy, **COMMON), workdir)
        after = disk_stats(daemon)
        assert hit.cached(0) == HIT
        assert hit.counter(0, "vllm:external_prefix_cache_hits") == HIT
        assert after["hits"] > before["hits"]  # promoted from disk (decoded), not found in the host tier
        # E serves P, then P' (vLLM's own prefix cache: the exact baseline, split at the same token)
        exact = run_engine(engine_spec(model, [one(p), one(p2)], kv_transfer_config=connector_config(daemon.socket_path),
                                       **COMMON), workdir)
        assert exact.cached(0) == 0 and exact.counter(0, "vllm:external_prefix_cache_hits") == 0
        assert exact.cached(1) == HIT and exact.counter(1, "vllm:external_prefix_cache_hits") == 0
        assert list(disk_stats(daemon)["compressed"]) == [tag]  # E's blocks are stored exact
        metrics = dict(line.rsplit(" ", 1) for line in daemon.http("/metrics")[1].decode().splitlines()
                       if line.startswith("kvstore_disk_"))
        counters = daemon.stats()["counters"]  # (read after: counters only grow)
        for name in ("disk_stored_exact_busy", "disk_compacted", "disk_encoded_copies_dropped"):
            assert 0 <= float(metrics[f"kvstore_{name}_total"]) <= counters.get(name, 0)
        match = next((i for i, (a, b) in enumerate(zip(hit.tokens(0), exact.tokens(1))) if a != b),
                     len(hit.tokens(0)))
        print(f"greedy match {match}/{len(hit.tokens(0))} tokens")  # the quality benchmarks judge the rest
        assert match >= 1  # the decoded KV is the prompt's: a block decoded into the wrong place is noise
        assert daemon.check() == []
    finally:
        daemon.stop()


def _config(tmp_path) -> str:
    path = tmp_path / "kvstore.toml"
    path.write_text(f'[compression]\ndisk = true\nprofile_dir = "{PROFILE_DIR}"\n')
    return str(path)
