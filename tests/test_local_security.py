"""What another local user can and cannot do to a daemon (findings of an outside review).

The daemon runs as root here; the other user is `nobody` (uid 65534), reached through
`setpriv`. Those tests skip, saying why, when not run as root. Each finding is checked
with real daemons (tools/harness/daemon_proc.py) and real processes of the other user:

1. the admin HTTP plane: counters stay open on loopback, everything else needs the
   owner's token; foreign Host headers (DNS rebinding) and non-JSON POSTs are refused;
2. predictable names in /dev/shm: the instance lock moved beside the socket, the arena
   is never followed or reused when another user put something at its path;
3. the socket folder must be the daemon's own and closed to others; a client talks only
   to a daemon of its own user or root, and maps only an arena that daemon owns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import KVStoreError
from kvstore.keys import hash_blocks
from tests.helpers import namespace

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
NS = namespace()
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv: the test acts as a second local user (uid 65534)",
)


# -- helpers -------------------------------------------------------------------------------
def as_nobody(code: str, *args: str) -> str:
    """Run stdlib-only Python `code` as uid 65534; its stdout."""
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", code, *args], cwd="/", capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


NOBODY_HTTP = """
import sys, urllib.request, urllib.error
port, method, path, ctype = sys.argv[1:5]
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                             data=b"{}" if method == "POST" else None, headers={"Content-Type": ctype} if ctype else {})
try:
    with urllib.request.urlopen(req, timeout=10) as resp:
        print(resp.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def owner_token(d) -> str:
    """The token the daemon wrote beside its socket ("" where it wrote none)."""
    path = Path(d.socket_path).parent / f"{d.name}.admin-token"
    return path.read_text().strip() if path.exists() else ""


def admin(d, path: str, method: str = "GET", headers: dict | None = None, body: bytes | None = None):
    """(status, parsed JSON or text) of an admin request with exactly these headers."""
    req = urllib.request.Request(f"http://127.0.0.1:{d.admin_port}{path}", data=body, headers=headers or {},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def bearer(d) -> dict:
    return {"Authorization": f"Bearer {owner_token(d)}"}


def put_blocks(d, n: int = 2) -> None:
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        hs = hash_blocks(np.arange(n * 16), 16)
        c.put(ns, [(h, hs[i - 1] if i else None, np.full(NS.block_bytes, i, np.uint8)) for i, h in enumerate(hs)])


def blocks(d) -> int:
    with KVClient(d.socket_path) as c:
        return c.stats()["blocks"]


@pytest.fixture
def shared_dir():
    """A fresh folder under /tmp; the test sets its owner and mode."""
    path = Path(f"/tmp/kvsec-{uuid.uuid4().hex[:10]}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dev_shm_names():
    """Paths the test plants in /dev/shm, removed afterwards whatever happened."""
    planted: list[str] = []
    yield planted
    for p in planted:
        if os.path.lexists(p):
            os.unlink(p)


def refused_start(daemon_factory, log: Path, **kw) -> str:
    """Start a daemon that must refuse to start; its error output."""
    with pytest.raises(RuntimeError, match="did not start") as info:
        daemon_factory(log_path=str(log), **kw)
    return str(info.value)


# -- 1. the admin plane ---------------------------------------------------------------------
@needs_root
def test_another_user_reads_counters_but_cannot_list_check_or_clear(daemon):
    put_blocks(daemon)
    port = str(daemon.admin_port)
    for method, path, ctype in [("GET", "/stats", ""), ("GET", "/check", ""), ("POST", "/clear", "text/plain"),
                                ("POST", "/clear", "application/json"),
                                ("POST", "/clear", "application/x-www-form-urlencoded")]:
        assert as_nobody(NOBODY_HTTP, port, method, path, ctype) == "401", f"uid 65534 got through: {method} {path}"
    assert as_nobody(NOBODY_HTTP, port, "GET", "/metrics", "") == "200"  # read-only counters stay open on loopback
    assert as_nobody(NOBODY_HTTP, port, "GET", "/healthz", "") == "200"
    assert blocks(daemon) == 2, "nothing was cleared"


def test_the_admin_token_is_a_private_file_beside_the_socket_and_required(daemon_factory):
    d = daemon_factory()
    token_file = Path(d.socket_path).parent / f"{d.name}.admin-token"
    assert token_file.exists(), "the daemon writes its admin token beside its socket"
    st = token_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    status, body = admin(d, "/stats")
    assert status == 401 and body["error"] == "AuthError" and "admin-token" in body["message"]
    assert admin(d, "/check", headers={"Authorization": "Bearer " + "x" * 43})[0] == 401
    assert admin(d, "/stats", headers={"Authorization": owner_token(d)})[0] == 401  # no scheme
    status, body = admin(d, "/stats", headers=bearer(d))
    assert status == 200 and body["blocks"] == 0
    assert d.check() == [] and d.stats()["blocks"] == 0  # the owner's tools read the token themselves
    assert d.stop() == 0
    assert not token_file.exists(), "a clean stop removes the token"


def test_a_restarted_daemon_replaces_a_killed_one_s_token(daemon_factory):
    d = daemon_factory()
    first = owner_token(d)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=30)
    again = daemon_factory(name=d.name)  # no cleanup between: the stale token, lock and arena are still there
    assert owner_token(again) not in ("", first)
    assert admin(again, "/stats", headers={"Authorization": f"Bearer {first}"})[0] == 401
    assert again.check() == []


def test_foreign_host_headers_are_refused(daemon):
    port = daemon.admin_port
    for host in ["evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}", "localhost.evil.example",
                 "[::2]", f"0.0.0.0:{port}"]:
        for path in ("/stats", "/metrics"):  # a rebound page may not read the counters either
            status, body = admin(daemon, path, headers={**bearer(daemon), "Host": host})
            assert status == 421, f"Host {host} answered {status} on {path}"
            assert body["error"] == "WrongHost"
    for host in ["127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", "[::1]", f"[::1]:{port}"]:
        assert admin(daemon, "/stats", headers={**bearer(daemon), "Host": host})[0] == 200, host


def test_posts_must_be_json(daemon):
    put_blocks(daemon)
    for ctype in ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"]:  # what a cross-site form or fetch sends without asking
        status, body = admin(daemon, "/clear", "POST", headers={**bearer(daemon), "Content-Type": ctype}, body=b"{}")
        assert status == 415, f"POST /clear as {ctype} answered {status}"
        assert body["error"] == "WrongContentType"
    assert blocks(daemon) == 2
    status, body = admin(daemon, "/clear", "POST", headers={**bearer(daemon), "Content-Type": "application/json"},
                         body=b"{}")
    assert status == 200 and body["removed"] == 2 and blocks(daemon) == 0


# -- 2. predictable names in /dev/shm ----------------------------------------------------------
@needs_root
def test_a_symlink_planted_at_the_old_lock_path_is_not_followed(daemon_factory, dev_shm_names):
    name = f"t-{uuid.uuid4().hex[:10]}"
    planted, victim = f"/dev/shm/kvstore-{os.getuid()}-{name}.lock", f"/tmp/kvsec-victim-{name}"
    dev_shm_names += [planted, victim]
    as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", victim, planted)
    d = daemon_factory(name=name)
    assert not os.path.lexists(victim), "the root daemon created a file where another user's symlink pointed"
    lock = Path(d.socket_path).parent / f"{name}.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and lock.stat().st_uid == os.geteuid()


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@needs_root
def test_another_user_holding_the_old_lock_path_cannot_keep_the_daemon_down(daemon_factory, dev_shm_names, tmp_path):
    name = f"t-{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm/kvstore-{os.getuid()}-{name}.lock"
    dev_shm_names.append(path)
    holder = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", HOLD_LOCK, path], cwd="/", text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            d = daemon_factory(name=name, log_path=str(tmp_path / "d.log"))
        except RuntimeError as exc:
            d = None
            why = str(exc)
        assert d is not None, f"uid 65534 kept the daemon from starting: {why}"
        assert d.client().ping()
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_beside_the_socket_must_be_a_private_file(daemon_factory, tmp_path):
    name = f"t-{uuid.uuid4().hex[:10]}"
    lock, victim = tmp_path / f"{name}.lock", tmp_path / "victim"
    lock.symlink_to(victim)
    err = refused_start(daemon_factory, tmp_path / "a.log", name=name)
    assert "symbolic link" in err and str(lock) in err and not victim.exists()
    lock.unlink()
    lock.touch(mode=0o644)
    os.chmod(lock, 0o644)
    err = refused_start(daemon_factory, tmp_path / "b.log", name=name)
    assert str(lock) in err and "0644" in err


@needs_root
@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_the_arena_path_taken_by_another_user_is_refused_untouched(daemon_factory, dev_shm_names, tmp_path, kind):
    name = f"t-{uuid.uuid4().hex[:10]}"
    arena = f"/dev/shm/kvstore-{os.getuid()}-{name}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    dev_shm_names.append(arena)
    if kind == "file":
        as_nobody("import sys; open(sys.argv[1], 'wb').write(b'planted')", arena)
    else:
        as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), arena)
    err = refused_start(daemon_factory, tmp_path / "d.log", name=name)
    assert arena in err and f"uid {NOBODY}" in err, err
    assert os.lstat(arena).st_uid == NOBODY, "left where it was"
    assert victim.read_bytes() == b"root's file"
    if kind == "file":
        assert Path(arena).read_bytes() == b"planted"


def test_a_live_arena_of_the_same_name_is_not_taken_over(daemon_factory, tmp_path):
    """The lock is per folder now; the arena's own flock still keeps a second daemon of that name
    (its socket elsewhere) from unlinking a running daemon's arena."""
    d = daemon_factory()
    put_blocks(d)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    err = refused_start(daemon_factory, tmp_path / "d.log", name=d.name, socket_path=str(other / "s.sock"))
    assert "in use" in err or "another kvstore daemon" in err
    assert blocks(d) == 2 and d.check() == []


# -- 3. the socket folder, and whom a client trusts ----------------------------------------------
@needs_root
@pytest.mark.parametrize("mode", [0o777, 0o700], ids=oct)
def test_a_socket_folder_of_another_user_is_refused(shared_dir, daemon_factory, tmp_path, mode):
    os.chown(shared_dir, NOBODY, NOBODY)
    os.chmod(shared_dir, mode)
    err = refused_start(daemon_factory, tmp_path / "d.log", socket_path=str(shared_dir / "kv.sock"))
    assert str(shared_dir) in err and f"uid {NOBODY}" in err and f"{mode:04o}" in err, err
    assert not any(shared_dir.iterdir()), "nothing was put in it"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o730, 0o702], ids=oct)
def test_a_socket_folder_others_may_write_is_refused(daemon_factory, tmp_path, mode):
    folder = tmp_path / "run"
    folder.mkdir()
    os.chmod(folder, mode)
    err = refused_start(daemon_factory, tmp_path / "d.log", socket_path=str(folder / "kv.sock"))
    assert str(folder) in err and f"{mode:04o}" in err and "writable by group or others" in err, err
    os.chmod(folder, 0o755)  # readable by others is fine: the socket itself is 0600
    assert daemon_factory(socket_path=str(folder / "kv.sock")).client().ping()


def nobody_python(tmp_path: Path) -> str:
    """A `python` for start_daemon that runs as uid 65534."""
    wrapper = tmp_path / "python-as-nobody"
    wrapper.write_text(f"#!/bin/sh\nexec {' '.join(AS_NOBODY)} {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def mapped(path: str) -> bool:
    """Whether this process maps the file now at `path` (a mapping of an unlinked one reads "(deleted)")."""
    return any(line.rstrip().endswith(" " + path) for line in Path("/proc/self/maps").read_text().splitlines())


@needs_root
def test_a_client_refuses_a_daemon_of_another_user(shared_dir, daemon_factory, tmp_path):
    os.chown(shared_dir, NOBODY, NOBODY)
    os.chmod(shared_dir, 0o700)
    # Not persistent: that user's daemon removes its arena at stop (the harness, as root, would not).
    d = daemon_factory("--no-persistent-host", socket_path=str(shared_dir / "kv.sock"), admin=False,
                       python=nobody_python(tmp_path))
    arena = f"/dev/shm/kvstore-{NOBODY}-{d.name}"
    assert os.stat(arena).st_uid == NOBODY  # a real daemon of that user
    with pytest.raises(KVStoreError, match=f"uid {NOBODY}") as info:
        KVClient(d.socket_path)
    assert type(info.value).__name__ == "OwnershipError"
    assert not mapped(arena)


@needs_root
@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_client_maps_no_arena_another_user_put_at_its_path(daemon, tmp_path, kind):
    with KVClient(daemon.socket_path) as c:
        arena, size = c.server_info["arena_path"], c.server_info["arena_bytes"]
    target = Path(f"/tmp/kvsec-target-{daemon.name}")  # for the symlink: root's, big enough to map
    os.unlink(arena)  # the daemon keeps its mapping; the name is free for the other user
    if kind == "file":
        as_nobody("import os, sys; f = open(sys.argv[1], 'wb'); f.truncate(int(sys.argv[2]))", arena, str(size))
    else:
        with open(target, "wb") as f:
            f.truncate(size)
        as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(target), arena)
    try:
        with pytest.raises(KVStoreError, match="not mapped") as info:
            KVClient(daemon.socket_path)
        assert type(info.value).__name__ == "OwnershipError"
        assert not mapped(arena if kind == "file" else str(target))
    finally:
        os.unlink(arena)  # the daemon keeps its arena at stop now (host.persistent): remove what was planted
        if kind == "symlink":
            target.unlink()


@needs_root
def test_a_user_who_cannot_write_the_install_encodes_with_the_compiled_loops(tmp_path):
    """numba caches compiled code beside the module or in the user's cache folder; a daemon user with
    neither writable (a read-only install, no home) still loads the codec's compiled loops (compiled in
    the process) and encodes the bytes the NumPy code does."""
    pytest.importorskip("numba", reason="numba is not installed (the NumPy code serves)")
    code = (
        "import numpy as np\n"
        "from kvstore import codec, codec_fast\n"
        "from kvstore.codec import BlockLayout, Budget\n"
        "layout = BlockLayout(1, 1, 32, 64, 'bfloat16', 'HKTVND')\n"
        "x = codec.from_float32(np.random.default_rng(0).standard_normal(layout.block_bytes // 2).astype(np.float32), 'bfloat16')\n"
        "print(codec_fast.AVAILABLE, codec.encode(x.view(np.uint8), layout, Budget.uniform(layout, 4)).tobytes().hex())\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    available, compiled = out.stdout.split()
    numpy_only = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVSTORE_CODEC_NUMPY": "1"},
                                capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert available == "True" and numpy_only[0] == "False"
    assert compiled == numpy_only[1]
