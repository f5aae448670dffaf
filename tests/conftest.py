"""Shared fixtures: a real daemon in its own process, and clients for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from server.daemon import remove_stale_instance

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket_path: str
    admin_port: int | None
    tcp_port: int | None
    name: str
    args: list = field(default_factory=list)

    def http(self, path: str, method: str = "GET") -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def check(self) -> list:
        status, body = self.http("/check")
        assert status == 200
        return json.loads(body)["problems"]

    def stats(self) -> dict:
        return json.loads(self.http("/stats")[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.cleanup()
        return code

    def cleanup(self) -> None:
        """A killed daemon leaves its arena and lock in /dev/shm: remove them (a clean stop already did)."""
        if self.proc.poll() is not None:
            remove_stale_instance(f"/dev/shm/kvstore-{os.getuid()}-{self.name}")


def start_daemon(tmp_path: Path, *extra: str, host_bytes: str = "64MiB", page_bytes: str = "64KiB",
                 name: str | None = None, disk: bool = False) -> DaemonProc:
    name = name or f"t-{uuid.uuid4().hex[:10]}"
    sock = str(tmp_path / f"{name}.sock")
    args = [sys.executable, "-m", "tools.cli", "serve", "--name", name, "--socket", sock,
            "--host-bytes", host_bytes, "--page-bytes", page_bytes, "--admin-port", "0", "--log-level", "WARNING"]
    if not disk:
        args.append("--no-disk")
    args += list(extra)
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}, exit {proc.wait()}")
    fields = dict(kv.split("=", 1) for kv in line.split()[2:])
    port = lambda v: None if v == "None" else int(v)  # noqa: E731
    return DaemonProc(proc, sock, port(fields["admin_port"]), port(fields["tcp_port"]), name, args)


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon(tmp_path)
    yield d
    if d.alive():
        assert d.stop() == 0
    d.cleanup()


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def make(*extra: str, **kw) -> DaemonProc:
        d = start_daemon(tmp_path, *extra, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.alive():
            try:
                d.stop(signal.SIGTERM, timeout=30)
            except subprocess.TimeoutExpired:
                d.stop(signal.SIGKILL)
        d.cleanup()


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA and `vllm` tests without vLLM, saying why."""
    import importlib.util

    have_vllm = importlib.util.find_spec("vllm") is not None
    have_cuda = False
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        pass
    for item in items:
        if "vllm" in item.keywords and not have_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed (pip install -e .[vllm])"))
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))


os.environ.setdefault("PYTHONPATH", str(ROOT))
