"""A `kvstore serve` subprocess for tests and benchmarks: start it, wait until it is ready, stop it.

One launcher for every harness (pytest fixtures, the vLLM end-to-end helpers,
`bench_store`, `bench_vllm`). The daemon prints one line on stdout once it
listens, `kvstore ready socket=... admin_port=... tcp_port=...`; `start_daemon`
reads it, so there is no polling. Its logs (stderr) go to `log_path` when one
is given, else to the caller's stderr. A daemon that was killed leaves its
lock and admin token beside its socket, and every daemon leaves its arena and
the arena's placement index in /dev/shm for its successor (host.persistent);
`stop` and `cleanup` remove them, unless `keep_arena` (a restart that is to
re-adopt the arena). `http` sends the admin token the daemon wrote
(`<socket folder>/<name>.admin-token`), as the owner's tools do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import instance_file
from kvstore.server.instance import read_admin_token, remove_stale_instance

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket_path: str
    admin_port: int | None
    tcp_port: int | None
    name: str
    args: list = field(default_factory=list)
    log_path: str | None = None
    prefix: tuple = ()  # a launcher the daemon runs under, e.g. ("ip", "netns", "exec", "hostA")
    events_endpoint: str | None = None  # the KV-event PUB socket it bound, when [events] is on
    events_replay: str | None = None

    def client(self, timeout_s: float = 10.0):
        from kvstore.client import KVClient

        return KVClient(self.socket_path, timeout_s=timeout_s)

    @property
    def admin_token_path(self) -> str:
        return instance_file(self.socket_path, self.name, ".admin-token")

    @property
    def lock_path(self) -> str:
        return instance_file(self.socket_path, self.name, ".lock")

    def http(self, path: str, method: str = "GET", headers: dict | None = None,
             body: bytes | None = None) -> tuple[int, bytes]:
        """An admin request with the owner's token (POSTs as JSON); `headers` add to or replace those."""
        sent = {"Authorization": f"Bearer {read_admin_token(self.admin_token_path)}"}
        if method == "POST":
            sent["Content-Type"] = "application/json"
            body = b"{}" if body is None else body
        sent.update(headers or {})
        if self.prefix:  # its loopback is another network namespace's: ask from in there
            return _http_under(self.prefix, f"http://127.0.0.1:{self.admin_port}{path}", method, sent, body)
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}", data=body, headers=sent,
                                     method=method)
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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30, keep_arena: bool = False) -> int:
        """Signal the daemon and wait; a daemon that outlives `timeout` is killed. Returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.cleanup(keep_arena)
        return code

    def cleanup(self, keep_arena: bool = False) -> None:
        """Remove what a stopped daemon leaves: its arena and index (unless `keep_arena`); a killed one's
        lock and token too."""
        if self.proc.poll() is not None:
            remove_stale_instance(f"/dev/shm/kvstore-{os.getuid()}-{self.name}", self.lock_path,
                                  self.admin_token_path, keep_arena)


def proc_stat_cpu(path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat`
    file: a process's every thread, or one thread (the benchmarks' view of a daemon's CPU; 10 ms
    ticks on Linux)."""
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_daemon(
    folder: str | Path,
    *extra: str,
    host_bytes: str = "64MiB",
    page_bytes: str = "64KiB",
    name: str | None = None,
    disk: bool = False,
    admin: bool = True,
    socket_path: str | None = None,
    log_path: str | None = None,
    env: dict | None = None,
    python: str = sys.executable,
    prefix: tuple = (),
) -> DaemonProc:
    """Start `kvstore serve` (socket in `folder` unless given) and return once it is ready.

    No disk tier unless `disk` (then give `--disk-path`/`--disk-bytes` in
    `extra`, or get the config defaults); admin HTTP on a free port unless
    `admin` is false; `extra` flags are appended last. `python` runs it (another CPython's venv),
    under `prefix` if given (e.g. `ip netns exec hostA`: the daemon of another "host").
    """
    name = name or f"t-{uuid.uuid4().hex[:10]}"
    sock = socket_path or str(Path(folder) / f"{name}.sock")
    args = [*prefix, python, "-m", "kvstore.tools.cli", "serve", "--name", name, "--socket", sock,
            "--host-bytes", str(host_bytes), "--page-bytes", str(page_bytes), "--log-level", "WARNING"]
    args += ["--admin-port", "0"] if admin else ["--no-admin"]
    if not disk:
        args.append("--no-disk")
    args += list(extra)
    log = open(log_path, "w") if log_path else None
    try:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    finally:
        if log is not None:
            log.close()  # the child holds its own descriptor
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "ready" not in line:
        proc.kill()
        code = proc.wait()
        tail = Path(log_path).read_text()[-2000:] if log_path else ""
        raise RuntimeError(f"daemon did not start: {line!r}, exit {code} {tail}")
    fields = dict(kv.split("=", 1) for kv in line.split()[2:])
    port = lambda v: None if v == "None" else int(v)  # noqa: E731
    endpoint = lambda key: None if fields.get(key, "None") == "None" else fields[key]  # noqa: E731
    return DaemonProc(proc, sock, port(fields["admin_port"]), port(fields["tcp_port"]), name, args, log_path,
                      tuple(prefix), endpoint("events"), endpoint("events_replay"))


_HTTP_SCRIPT = """
import json, sys, urllib.error, urllib.request
url, method, headers, body = json.loads(sys.stdin.read())
req = urllib.request.Request(url, data=None if body is None else body.encode("latin-1"), headers=headers, method=method)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        status, data = r.status, r.read()
except urllib.error.HTTPError as exc:
    status, data = exc.code, exc.read()
print(json.dumps([status, data.decode("latin-1")]))
"""


def _http_under(prefix: tuple, url: str, method: str, headers: dict, body: bytes | None) -> tuple[int, bytes]:
    """An HTTP request made by a child process started under `prefix` (another network namespace)."""
    payload = json.dumps([url, method, headers, None if body is None else body.decode("latin-1")])
    out = subprocess.run([*prefix, sys.executable, "-c", _HTTP_SCRIPT], input=payload, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    status, data = json.loads(out)
    return status, data.encode("latin-1")
