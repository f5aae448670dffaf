"""Helpers for the remote-tier tests: a real `mooncake_master`, and "other hosts" as network namespaces.

`hosts()` makes two network namespaces joined by a veth pair with private
addresses (10.<random>.<random>.1 and .2), so each daemon has its own network
stack and reaches the other only over that link, as two machines would. The
Unix sockets and /dev/shm stay shared (a test's clients connect to either
daemon from outside), but no daemon can reach the other's loopback.
`Master` runs the wheel's `mooncake_master` (optionally inside a namespace).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest


def mooncake_or_skip() -> None:
    """Skip (with the reason) where the Mooncake client cannot be loaded here."""
    try:
        from kvstore.tiers.remote import RemoteUnavailable, load_mooncake, master_binary

        load_mooncake()
        master_binary()
    except (ImportError, RemoteUnavailable) as exc:
        pytest.skip(f"no Mooncake client on this machine: {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Host:
    netns: str
    addr: str

    @property
    def prefix(self) -> tuple:
        return ("ip", "netns", "exec", self.netns)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def make_hosts() -> tuple[Host, Host]:
    """Two namespaces joined by a veth pair; pytest.skip (with the reason) where that is not allowed."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"kvA{tag}", f"kvB{tag}"
    net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    try:
        _ip("netns", "add", a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces not allowed here ({exc.stderr.strip()}): the two-host tests need them")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        remove_hosts((Host(a, ""), Host(b, "")))
        pytest.skip(f"cannot wire network namespaces here: {exc.stderr.strip()}")
    return Host(a, f"{net}.1"), Host(b, f"{net}.2")


def limit_link(hosts, rate: str) -> None:
    """Shape both ends of the hosts' veth pair to `rate` (tc's units: "10gbit"), like a real NIC."""
    for h, side in zip(hosts, ("va", "vb")):
        dev = side + h.netns[3:]
        subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", "4mb", "latency", "50ms"], check=True, capture_output=True, text=True, timeout=10)


def remove_hosts(hosts) -> None:
    for h in hosts:
        subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=10)


_PROBE = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()"


def wait_port(host: str, port: int, prefix: tuple = (), timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run([*prefix, sys.executable, "-c", _PROBE, host, str(port)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout} s")


class Master:
    """A real mooncake_master (RPC on `port`), optionally inside a network namespace."""

    def __init__(self, prefix: tuple = (), host: str = "127.0.0.1", port: int | None = None, log_path=None) -> None:
        self.prefix, self.host = prefix, host
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}"

    def start(self) -> "Master":
        from kvstore.tiers.remote import master_binary, subprocess_env

        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        args = [*self.prefix, master_binary(), f"--rpc_port={self.port}", f"--metrics_port={free_port()}"]
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=subprocess_env())
        wait_port(self.host, self.port, self.prefix)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def remote_config(path, master: Master, **extra) -> str:
    """A TOML config file with a [remote] table for `master` (small segments for tests)."""
    fields = {"kind": "mooncake", "master": master.url, "segment_size": "256MiB", "buffer_size": "16MiB",
              "timeout": 1.0, "transfer_timeout": 5.0, **extra}
    body = "[remote]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    path.write_text(body)
    return str(path)
