"""Prefill/decode disaggregation with real engines: a kv_producer OpenAI server and a kv_consumer one
(separate processes, one daemon) behind server/pd_proxy.py, SmolLM2 float32, block size 32.

One module-scoped world serves every check (engine startups dominate on this machine):
* outputs through the proxy equal a baseline engine's (no connector) split at the same token: it
  serves each prompt alone (a batch's composition changes the matmuls' rounding), with max_tokens=1 first,
  so the real run is an in-engine prefix hit of (n-1)//32 blocks, exactly what the consumer loads;
  the consumer computed < 32 prompt tokens per request (its external-hit metric covers the rest);
* both are sent at once (the proxy's parallel mode): the consumer waited for in-flight blocks
  (the daemon's inflight_waits counter) and still loaded them all; the negative control, the same
  start-at-once with waiting disabled for the request (kv_transfer_params kvstore_wait_s=0),
  recomputes the whole prompt;
* the producer killed mid-prefill: the consumer's wait ends at the producer's lease (the daemon
  counts it "aborted", well before the 60 s wait_s; no wait ever times out), it recomputes, its
  output equals the baseline's cold run, daemon check() clean.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvstore.client import KVClient
from tests.helpers import free_port
from kvstore.tools.harness.vllm_helpers import (REPO, base_env, build_model, connector_config, corpus_text, engine_spec,
                                run_engine, start_daemon, tokenize, vllm_available)

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32
MAX_TOKENS = 12
COMMON = dict(dtype="float32", block_size=BS, kv_cache_memory_bytes=256 << 20, max_model_len=2048,
              max_num_batched_tokens=2048)
CONSUMER_WAIT_S = 60.0


def http(url: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Proc:
    def __init__(self, cmd: list[str], workdir: str, name: str, multiprocess: bool = False) -> None:
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(workdir, multiprocess=multiprocess),
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return open(self.log_path).read()[-4000:]

    def wait_http(self, url: str, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path} exited: {self.tail()}")
            try:
                urllib.request.urlopen(url, timeout=2).read()
                return
            except Exception:
                time.sleep(0.5)
        raise RuntimeError(f"not ready: {self.tail()}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


def server(model: str, socket: str, workdir: str, name: str, role: str, **extra) -> tuple[Proc, str]:
    port = free_port()
    kvt = connector_config(socket, **extra)
    kvt["kv_role"] = role
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "smol", "--host", "127.0.0.1", "--port", str(port), "--dtype", COMMON["dtype"], "--block-size", str(BS),
           "--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--kv-cache-memory-bytes",
           str(256 << 20), "--enforce-eager", "--kv-transfer-config", json.dumps(kvt)]
    return Proc(cmd, workdir, name), f"http://127.0.0.1:{port}"


class World:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.model = build_model("smollm2")
        ids = tokenize(self.model, corpus_text(40000))
        # distinct prompts, none a multiple of the block size
        self.prompts = [ids[0:745], ids[1000:1811], ids[2000:2690]]
        self.control = ids[3000:4650]  # long: the producer is still prefilling when the consumer asks
        self.killed = ids[5000:6870]
        self.daemon = start_daemon(workdir, host_bytes="1GiB", admin=True)
        self.producer, self.p_url = server(self.model, self.daemon.socket_path, workdir, "producer", "kv_producer")
        self.consumer, self.c_url = server(self.model, self.daemon.socket_path, workdir, "consumer", "kv_consumer",
                                           wait_s=CONSUMER_WAIT_S)
        self.baseline = self._baseline()  # while the servers start
        self.producer.wait_http(self.p_url + "/v1/models")
        self.consumer.wait_http(self.c_url + "/v1/models")
        port = free_port()
        self.proxy = Proc([sys.executable, "-m", "kvstore.tools.cli", "proxy", "--prefill", self.p_url, "--decode", self.c_url,
                           "--port", str(port), "--health-interval-s", "0.5"], workdir, "proxy")
        self.x_url = f"http://127.0.0.1:{port}"
        self.proxy.wait_http(self.x_url + "/health", timeout_s=60)

    def _baseline(self) -> dict:
        """No connector: each prompt with max_tokens=1 (so the next run is a prefix hit split where the
        consumer's load ends), then the real run; `killed` cold (what a full recompute gives).
        Each prompt runs alone, as the consumer serves it: a batch of several sequences changes
        the matmuls' rounding (in bf16, prompt 2's greedy output differed at its 6th token between
        a batch of four and a batch of one), which is not what this test is about."""
        prompts = self.prompts + [self.control]
        runs = [{"prompts": [{"ids": self.killed}], "max_tokens": MAX_TOKENS}]
        for p in prompts:
            runs += [{"prompts": [{"ids": p}], "max_tokens": 1}, {"prompts": [{"ids": p}], "max_tokens": MAX_TOKENS}]
        res = run_engine(engine_spec(self.model, runs, **COMMON), self.workdir, timeout_s=900)
        split = {}
        for i, p in enumerate(prompts):
            out = res.outputs(2 + 2 * i)[0]
            assert out["num_cached_tokens"] == (len(p) - 1) // BS * BS
            split[i] = out["token_ids"]
        return {"split": split, "killed_cold": res.tokens(0)}

    def complete(self, base: str, ids: list[int], **extra) -> tuple[int, dict, dict]:
        body = {"model": "smol", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **extra}
        return http(base + "/v1/completions", body)

    def daemon_stats(self) -> dict:
        with KVClient(self.daemon.socket_path) as c:
            return c.stats()

    def close(self) -> None:
        for p in (getattr(self, "proxy", None), getattr(self, "consumer", None), getattr(self, "producer", None)):
            if p is not None:
                p.kill(signal.SIGTERM) if p.proc.poll() is None else p.log.close()
        if getattr(self, "daemon", None) is not None:
            self.daemon.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(str(tmp_path_factory.mktemp("pd")))
    try:
        yield w
    finally:
        w.close()


def token_ids(reply: dict) -> list[int]:
    choice = reply["choices"][0]
    return list(choice.get("token_ids") or [])


def test_through_the_proxy_outputs_match_the_split_baseline_and_the_consumer_loads_the_prompt(world):
    hits0 = metric(world.c_url, "vllm:external_prefix_cache_hits_total")
    prompt0 = metric(world.c_url, "vllm:prompt_tokens_total")
    waits0 = world.daemon_stats()["counters"].get("inflight_waits", 0)
    for i, ids in enumerate(world.prompts):
        status, headers, reply = world.complete(world.x_url, ids)
        assert status == 200, reply
        assert "x-pd-prefill-error" not in {k.lower() for k in headers}
        assert token_ids(reply) == world.baseline["split"][i], f"prompt {i} differs from the split baseline"
    hits = metric(world.c_url, "vllm:external_prefix_cache_hits_total") - hits0
    prompt = metric(world.c_url, "vllm:prompt_tokens_total") - prompt0
    assert hits == sum((len(p) - 1) // BS * BS for p in world.prompts)
    computed_per_request = (prompt - hits) / len(world.prompts)
    assert computed_per_request < BS
    # both were sent at once: the consumer asked while the producer was still computing, and waited
    assert world.daemon_stats()["counters"].get("inflight_waits", 0) > waits0
    assert metric(world.p_url, "vllm:external_prefix_cache_hits_total") == 0  # a producer never loads


def test_start_at_once_without_waiting_recomputes_the_prompt(world):
    """Negative control: the same start-at-once, the consumer told not to wait: it computes it all."""
    hits0 = metric(world.c_url, "vllm:external_prefix_cache_hits_total")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(p=world.complete(world.p_url, world.control, max_tokens=1)))
    t.start()
    status, _, reply = world.complete(world.c_url, world.control, kv_transfer_params={"kvstore_wait_s": 0})
    t.join(300)
    assert status == 200 and out["p"][0] == 200
    assert metric(world.c_url, "vllm:external_prefix_cache_hits_total") - hits0 == 0, "it loaded: no recompute"
    # the same prompt again (now a local prefix hit split at the same token) matches the baseline
    status, _, reply = world.complete(world.x_url, world.control)
    assert status == 200 and token_ids(reply) == world.baseline["split"][3]


def test_a_producer_killed_mid_prefill_ends_the_wait_at_its_lease_and_the_consumer_recomputes(world):
    out: dict = {}

    def ask():
        t0 = time.monotonic()
        out["reply"] = world.complete(world.x_url, world.killed)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 120
    while world.daemon_stats()["announced_blocks"] == 0:  # the producer scheduled the prefill
        assert time.monotonic() < deadline, "the producer never announced its blocks"
        time.sleep(0.01)
    aborted0 = world.daemon_stats()["counters"].get("waits_aborted", 0)
    world.producer.kill()
    killed_at = time.monotonic()
    while world.daemon_stats()["counters"].get("waits_aborted", 0) == aborted0:  # the consumer's wait ended
        assert time.monotonic() - killed_at < CONSUMER_WAIT_S / 2, "the wait did not end at the producer's lease"
        time.sleep(0.05)
    t.join(600)  # the recompute (slow on a shared CPU)
    status, headers, reply = out["reply"]
    assert status == 200, reply
    assert world.daemon_stats()["counters"].get("waits_timeout", 0) == 0
    assert token_ids(reply) == world.baseline["killed_cold"]
    stats = world.daemon_stats()
    assert stats["announced_blocks"] == 0 and stats["reserved_blocks"] == 0 and stats["pinned_blocks"] == 0
    assert world.daemon.check() == []
    # the proxy notices the dead producer and still answers (the consumer recomputes)
    deadline = time.monotonic() + 10
    while http(world.x_url + "/health")[2]["engines"]["prefill"][world.p_url]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    status, headers, reply = world.complete(world.x_url, world.prompts[0])
    assert status == 200 and token_ids(reply) == world.baseline["split"][0]  # a local prefix hit now
    assert "no prefill engine is up" in {k.lower(): v for k, v in headers.items()}["x-pd-prefill-error"]
