"""A real vLLM CPU engine on host B gets a prefix hit on KV an engine on host A computed, through
two daemons and a Mooncake cluster (hosts are network namespaces; tools/harness/remote_env.py).

Same model, prompts and baseline as tests/test_vllm_e2e.py: prompt B shares a
700-token document with prompt A, so 21 blocks of 32 tokens (672) can come
from A. The baseline is one engine without the connector serving A then B (an
in-engine hit split at the same token). The negative control overwrites the
cluster's value of every stored root block: an engine on B then asking for a
prompt it never saw locally gets no hit at all and computes what a cold
engine computes, never a wrong token.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from kvstore.tools.harness.remote_env import Master, make_hosts, mooncake_or_skip, remote_config, remove_hosts
from tests.test_vllm_e2e import BS, COMMON, DOC, EXPECTED_HIT, one
from kvstore.tools.harness.vllm_helpers import (EngineRun, base_env, build_model, connector_config, corpus_text, engine_spec,
                                tokenize, vllm_available)
from kvstore.tools.harness.daemon_proc import ROOT, start_daemon

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

CORRUPT = """
import sys
sys.path.insert(0, {root!r})
from kvstore.client import KVClient
from kvstore.tiers import remote as r
import numpy as np
class Arena: buf = np.zeros(1 << 16, dtype=np.uint8)
t = r.MooncakeTier({master!r}, Arena(), segment_bytes=512 << 20, buffer_bytes=16 << 20)
with KVClient({socket!r}) as c:
    rows, _ = c.list_blocks(limit=100000)
roots = [(ns, h) for ns, h, tier, depth, *_ in rows if depth == 0]
for ns, h in roots:
    key = r.object_key(ns, h)
    size = t._mc.get_size(key)
    assert size > 0, key
    assert t._mc.upsert(key, bytes(size)) == 0  # zeros: a wrong header, a wrong payload
print("CORRUPTED", len(roots), flush=True)
import time; time.sleep(600)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mooncake_or_skip()
    work = tmp_path_factory.mktemp("remote-vllm")
    hosts = make_hosts()
    a, b = hosts
    procs: list = []
    try:
        master = Master(a.prefix, a.addr, log_path=work / "master.log").start()
        procs.append(master)
        cfg = remote_config(work / "remote.toml", master, segment_size="1GiB")
        env = base_env(str(work))
        da = start_daemon(work, "--config", cfg, name="vhostA", prefix=a.prefix, host_bytes="512MiB",
                          page_bytes="256KiB", log_path=str(work / "a.log"), env=env)
        procs.append(da)
        db = start_daemon(work, "--config", cfg, name="vhostB", prefix=b.prefix, host_bytes="512MiB",
                          page_bytes="256KiB", log_path=str(work / "b.log"), env=env)
        procs.append(db)
        model = build_model("smollm2")
        ids = tokenize(model, corpus_text(16000))
        assert len(ids) > DOC + 1600
        doc = ids[:DOC]
        prompts = {"a": doc + ids[DOC + 100 : DOC + 130], "b": doc + ids[DOC + 300 : DOC + 340],
                   "e": ids[DOC + 1200 : DOC + 1200 + 400]}  # shares nothing with a and b
        yield dict(work=str(work), master=master, a=a, b=b, da=da, db=db, model=model, prompts=prompts, procs=procs)
    finally:
        for p in reversed(procs):
            if hasattr(p, "cleanup"):
                if p.alive():
                    p.stop(signal.SIGTERM, timeout=30)
                p.cleanup()
            elif hasattr(p, "kill"):
                p.kill()
        remove_hosts(hosts)


def engine(s, daemon, runs) -> EngineRun:
    kvt = connector_config(daemon.socket_path) if daemon is not None else None
    return EngineRun(engine_spec(s["model"], runs, kv_transfer_config=kvt, **COMMON), s["work"])


def test_an_engine_on_host_b_reuses_what_an_engine_on_host_a_computed(setup):
    s, p = setup, setup["prompts"]
    baseline = engine(s, None, [one(p["a"]), one(p["b"]), one(p["e"])])  # no connector: beside engine A
    engine_a = engine(s, s["da"], [one(p["a"]), one(p["e"])]).result()
    baseline = baseline.result()
    assert baseline.cached(1) == EXPECTED_HIT and baseline.cached(2) == 0
    assert engine_a.cached(0) == 0 and engine_a.tokens(0) == baseline.tokens(0)
    stored = s["da"].stats()["blocks"]
    deadline = time.monotonic() + 30
    while s["da"].stats()["counters"].get("remote_published_blocks", 0) < stored and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s["da"].stats()["counters"]["remote_published_blocks"] == stored

    engine_b = engine(s, s["db"], [one(p["b"])]).result()
    assert engine_b.cached(0) == EXPECTED_HIT
    assert engine_b.counter(0, "vllm:external_prefix_cache_hits") == EXPECTED_HIT
    assert engine_b.tokens(0) == baseline.tokens(1)
    sb = s["db"].stats()
    assert sb["tiers"]["remote"]["hits"] >= EXPECTED_HIT // BS
    assert sb["counters"]["remote_promotions"] >= EXPECTED_HIT // BS
    assert s["db"].check() == []

    # negative control: every root's value in the cluster overwritten; B never saw prompt e locally
    code = CORRUPT.format(root=str(ROOT), master=s["master"].url, socket=s["da"].socket_path)
    writer = subprocess.Popen([*s["a"].prefix, sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=base_env(s["work"]))
    s["procs"].append(writer)
    assert writer.stdout.readline().startswith("CORRUPTED")
    failures = sb["counters"].get("remote_checksum_failures", 0)
    engine_e = engine(s, s["db"], [one(p["e"])]).result()
    assert engine_e.cached(0) == 0  # a miss and a recompute
    assert engine_e.tokens(0) == baseline.tokens(2)
    assert s["db"].stats()["counters"]["remote_checksum_failures"] > failures
    assert s["db"].check() == [] and s["da"].check() == []
