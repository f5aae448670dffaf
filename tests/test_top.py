"""`kvstore top` in a real pseudo-terminal: its numbers move while a client writes, and `q` quits.

The command runs under a pty (stdlib `pty`/`os.openpty`, 50x160) against a
real daemon's admin URL with its token file, as an operator would run it on
another host. A client thread keeps writing and reading blocks; the screen,
stripped of escape sequences, must show the block count growing frame after
frame and non-zero request rates, and a `q` key press must end it with exit 0.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.keys import hash_blocks
from tests.conftest import ROOT
from tests.helpers import namespace

pytest.importorskip("rich", reason="kvstore top needs rich (the tools extra)")
NS = namespace("top-model")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def spawn_in_pty(args: list[str], rows: int = 50, cols: int = 160) -> tuple[subprocess.Popen, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    return proc, master


def read_for(fd: int, seconds: float) -> str:
    out, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return ANSI.sub("", out.decode(errors="replace"))


def writer(sock: str, stop: threading.Event) -> None:
    with KVClient(sock) as c:
        ns = c.register(NS)
        seed = 0
        while not stop.is_set():
            hs = hash_blocks(np.arange(64) + seed * 1000, 16)
            c.put(ns, [(h, p, np.zeros(NS.block_bytes, np.uint8)) for h, p in zip(hs, [None] + hs[:-1])])
            c.get(ns, hs[:2])
            seed += 1
            time.sleep(0.05)


def top_args(daemon, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.tools.cli", "top", "--url", f"http://127.0.0.1:{daemon.admin_port}",
            "--token-file", daemon.admin_token_path, *extra]


def test_top_shows_moving_numbers_in_a_terminal_and_q_quits(daemon_factory):
    d = daemon_factory(host_bytes="64MiB", page_bytes="64KiB")
    proc, master = spawn_in_pty(top_args(d, "--interval", "0.5"))
    stop = threading.Event()
    client = threading.Thread(target=writer, args=(d.socket_path, stop), daemon=True)
    try:
        first = read_for(master, 3)
        assert "kvstore top" in first and "hit ratio" in first and "q quits" in first, first[-2000:]
        client.start()
        screen = read_for(master, 6)
        counts = [int(n) for n in re.findall(r"blocks (\d+)\s+sessions", screen)]
        # the first frame after the writer starts may come before its first commit, so it can show 0
        assert counts == sorted(counts) and len(set(counts)) >= 3, counts
        tables = re.findall(r"requests/s\s*\n[^\n]*\n┃([^\n]*)┃\s*\n[^\n]*\n│([^\n]*)│", screen)
        assert tables, screen[-3000:]
        header, values = ([c.strip() for c in row.split(sep)] for row, sep in zip(tables[-1], "┃│"))
        assert float(dict(zip(header, values))["commit"]) > 0  # commits per second, in the latest frame
        assert "top-model" in screen  # the busiest namespace, by model name
        assert re.search(r"all tiers\s+│?\s*\d+\.\d%", screen), screen[-3000:]  # a hit ratio over the window
        os.write(master, b"q")
        assert proc.wait(timeout=10) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
        if client.is_alive():
            client.join(timeout=10)


def test_top_bad_input_is_one_line_and_exit_1(daemon_factory, tmp_path):
    d = daemon_factory()
    bad_token = tmp_path / "token"
    bad_token.write_text("x" * 32)
    bad_token.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cases = [
        (["--url", "http://127.0.0.1:9", "--token-file", d.admin_token_path], "cannot reach the admin plane"),
        (["--url", f"http://127.0.0.1:{d.admin_port}", "--token-file", str(bad_token)], "answered 401"),
        (["--url", f"http://127.0.0.1:{d.admin_port}", "--token-file", str(tmp_path / "none")], "admin token"),
    ]
    for args, why in cases:
        r = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "top", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run(top_args(d, "--once", "--interval", "0.2"), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "hit ratio" in r.stdout and "tiers" in r.stdout, r.stderr
