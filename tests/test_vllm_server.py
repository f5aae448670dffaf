"""The OpenAI server with the connector: a second server process gets external hits for a prompt
the first one served, and answers the same text.

Uses the tiny random Llama (fast startup) and vLLM's default multiprocess engine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers import free_port
from kvstore.tools.harness.vllm_helpers import base_env, build_model, connector_config, corpus_text, start_daemon, tokenize, vllm_available

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32


def http(url: str, body: dict | None = None, timeout: float = 120) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    def __init__(self, model: str, daemon_socket: str, workdir: str, name: str) -> None:
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"{name}.log")
        kvt = connector_config(daemon_socket)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--block-size", str(BS), "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(128 << 20), "--enforce-eager",
            "--kv-transfer-config", json.dumps(kvt),
        ]
        env = base_env(workdir, multiprocess=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log_path).read()[-4000:]}")
            try:
                http(self.url("/v1/models"), timeout=2)
                return
            except Exception:
                time.sleep(0.5)
        raise RuntimeError(f"server not ready: {open(self.log_path).read()[-4000:]}")

    def complete(self, prompt_ids: list[int]) -> str:
        body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        return json.loads(http(self.url("/v1/completions"), body))["choices"][0]["text"]

    def metric(self, name: str) -> float:
        text = http(self.url("/metrics"))
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        return sum(values)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_second_server_gets_external_hits(tmp_path):
    workdir = str(tmp_path)
    model = build_model("tiny")
    prompt = tokenize(model, corpus_text(3000))[:500]
    daemon = start_daemon(workdir)
    try:
        first = Server(model, daemon.socket_path, workdir, "server1")
        second = Server(model, daemon.socket_path, workdir, "server2")  # starts beside the first
        try:
            first.wait_ready()
            text1 = first.complete(prompt)
            assert first.metric("vllm:external_prefix_cache_hits_total") == 0
            first.stop()
            second.wait_ready()
            text2 = second.complete(prompt)
            hits = second.metric("vllm:external_prefix_cache_hits_total")
        finally:
            first.stop()
            second.stop()
        assert hits == (len(prompt) - 1) // BS * BS
        assert text2 == text1
    finally:
        daemon.stop()
