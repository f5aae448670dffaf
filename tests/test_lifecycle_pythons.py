"""The daemon's start / SIGTERM / restart lifecycle under every CPython the project supports.

`requires-python >= 3.10`, and Python 3.12 changed `asyncio.Server.wait_closed`
to wait for every open connection: a daemon that waited for it before closing
its clients' connections hung on SIGTERM as long as one idle engine stayed
connected (and was SIGKILLed by systemd or Kubernetes, losing the host tier).
Each test runs the daemon under one interpreter, from the venv `tools/dev test`
makes in `.cache/py/<version>` for each of 3.10-3.13 found on the machine
(pyenv's), with an idle client attached, and skips, saying why, where that
Python is absent.
"""

from __future__ import annotations

import signal
import subprocess
import time

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.keys import hash_blocks
from kvstore.tools.harness.daemon_proc import ROOT, start_daemon
from tests.helpers import namespace

VERSIONS = ("3.10", "3.11", "3.12", "3.13")
NS = namespace("lifecycle")


def venv_python(version: str):
    folder = ROOT / ".cache" / "py" / version
    python = folder / "bin" / "python"
    return python if python.exists() and any(folder.glob(".ready-*")) else None


@pytest.mark.parametrize("version", VERSIONS)
def test_sigterm_with_an_idle_engine_attached_then_restart(version, tmp_path):
    python = venv_python(version)
    if python is None:
        pytest.skip(f"no CPython {version} here: tools/dev test makes .cache/py/{version} where python{version} exists")
    disk = ["--disk-path", str(tmp_path / "disk"), "--disk-bytes", "16MiB"]
    d = start_daemon(tmp_path, *disk, disk=True, python=str(python))
    hashes = hash_blocks(np.arange(4 * 16), 16)
    payloads = [np.full(NS.block_bytes, i + 1, np.uint8) for i in range(4)]
    engine = KVClient(d.socket_path)  # stays connected and idle, as every vLLM engine does
    try:
        ns = engine.register(NS)
        engine.put(ns, list(zip(hashes, [None] + hashes[:-1], payloads)))
        start = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            d.stop(signal.SIGKILL)
            pytest.fail(f"Python {version}: the daemon still ran 15 s after SIGTERM with a client attached")
        stop_s = time.monotonic() - start
    finally:
        engine.close()
    d.cleanup(keep_arena=True)
    assert code == 0 and stop_s < 5, f"exit {code} after {stop_s:.1f} s"

    again = start_daemon(tmp_path, *disk, disk=True, python=str(python), name=d.name)
    try:
        with KVClient(again.socket_path) as c:  # the host tier is back: the arena was re-adopted
            ns = c.register(NS)
            assert c.lookup(ns, hashes).hits == 4
            assert all(np.array_equal(a, b) for a, b in zip(c.get(ns, hashes), payloads))
        assert again.check() == []
    finally:
        assert again.stop() == 0
