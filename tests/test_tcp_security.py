"""TCP security: scoped tokens, limits before hello, frames under the daemon's limit.

Real daemons over real sockets, on 127.0.0.1 only. Every loop is bounded in
count and in time. Each test closes a finding of an outside tester; the
comment above it says which.
"""

import os
import select
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.config import ServerConfig, load_config
from kvstore.errors import AuthError, ConfigError, PermissionDenied, ProtocolError
from kvstore.keys import ExtraKeys, Namespace, hash_blocks
from tests.helpers import frame, namespace, wait_for

NS = namespace()
MiB = 1 << 20
SECRETS = {"acme": "acme-secret-0123456789", "globex": "globex-secret-0123456789", "reader": "reader-secret-0123456789",
           "other": "other-model-secret-0123", "admin": "admin-secret-0123456789"}
SCOPES = {  # name -> (namespaces, tenants, ops)
    "acme": (["test-model"], ["acme"], ["read", "write"]),
    "globex": (["test-model"], ["globex"], ["read", "write"]),
    "reader": (["test-model"], ["acme"], ["read"]),
    "other": (["other-*"], ["acme"], ["read", "write"]),
    "admin": (["*"], ["*"], ["read", "write", "admin"]),
}


def secret_file(folder, name: str, secret: str) -> str:
    path = os.path.join(folder, f"{name}.token")
    with open(path, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return path


def write_config(folder, server: str = "", scopes: dict = SCOPES) -> str:
    text = "[server]\n" + server
    for name, (namespaces, tenants, ops) in scopes.items():
        text += (f'[[server.tcp_tokens]]\nname = "{name}"\ntoken_file = "{secret_file(folder, name, SECRETS[name])}"\n'
                 f"namespaces = {namespaces}\ntenants = {tenants}\nops = {ops}\n")
    path = os.path.join(folder, "kv.toml")
    with open(path, "w") as f:
        f.write(text.replace("'", '"'))
    return path


def remote(d, name: str, tenant: str | None = None, **kw) -> KVClient:
    if tenant is not None:  # only then: the same calls run against a client without the argument
        kw["tenant"] = tenant
    return KVClient(tcp=("127.0.0.1", d.tcp_port), token=SECRETS[name], **kw)


def salted_blocks(salt: str, n: int, block_bytes: int = NS.block_bytes):
    hs = hash_blocks(np.arange(n * 16), 16, ExtraKeys(cache_salt=salt))
    payloads = [np.random.default_rng(i).integers(0, 256, block_bytes, dtype=np.uint8) for i in range(n)]
    return hs, list(zip(hs, [None] + hs[:-1], payloads)), payloads


def raw_tcp(d, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.tcp_port), timeout=timeout)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def read_reply(sock: socket.socket):
    """The next reply, or None when the daemon closed (or reset) the connection."""
    header = recv_exactly(sock, 4)
    body = None if header is None else recv_exactly(sock, struct.unpack(">I", header)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def closed_now(sock: socket.socket) -> bool:
    """True if the daemon has closed this connection (without waiting)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def errors(d) -> dict:
    return d.stats()["errors"]


# -- 1. scoped tokens ---------------------------------------------------------------

@pytest.fixture
def scoped(daemon_factory, tmp_path):
    return daemon_factory("--config", write_config(str(tmp_path)), "--tcp-port", "0")


def test_a_tenant_cannot_list_read_or_remove_another_tenants_blocks(scoped):
    """Finding 1: a client with the token listed tenant A's blocks, read them byte-exact and removed them."""
    hs, blocks, payloads = salted_blocks("acme", 3)
    with remote(scoped, "acme", tenant="acme") as a:
        ns_a = a.register(NS)
        assert a.put(ns_a, blocks) == 3
    with remote(scoped, "globex", tenant="globex") as b:
        for attack in (lambda: b.list_blocks(), lambda: b.remove(ns_a, hs), lambda: b.get(ns_a, hs),
                       lambda: b.lookup(ns_a, hs), lambda: b.stats()):
            with pytest.raises(PermissionDenied):
                attack()
        ns_b = b.register(NS)  # the same model, in globex's own partition
        assert ns_b != ns_a
        assert b.lookup(ns_b, hs).hits == 0 and b.get(ns_b, hs) == [None] * 3
    with remote(scoped, "acme", tenant="acme") as a:
        assert all(np.array_equal(g, w) for g, w in zip(a.get(ns_a, hs), payloads))
        with pytest.raises(PermissionDenied):
            a.list_blocks()  # listing is admin-only, even of one's own tenant
    with remote(scoped, "admin") as admin:
        assert admin.list_blocks()[1] == 3
        assert admin.remove(ns_a, hs[:1]) == 3  # a block and its subtree
    assert scoped.check() == []


def test_scopes_limit_ops_models_and_tenants(scoped):
    """Finding 1: a token grants the ops, models and tenants it lists, and nothing else."""
    for name, tenant in (("acme", "globex"), ("acme", None), ("acme", "bad label!")):
        with pytest.raises(AuthError):
            remote(scoped, name, tenant=tenant)
    hs, blocks, payloads = salted_blocks("acme", 2)
    with remote(scoped, "acme", tenant="acme") as a:
        ns_a = a.register(NS)
        a.put(ns_a, blocks)
        with pytest.raises(PermissionDenied, match="cannot register"):
            a.call("register", namespace={**NS.to_dict(), "tenant": "globex"})
    with remote(scoped, "reader", tenant="acme") as r:
        assert r.register(NS) == ns_a
        assert all(np.array_equal(g, w) for g, w in zip(r.get(ns_a, hs), payloads))
        with pytest.raises(PermissionDenied, match="does not grant put"):
            r.put(ns_a, blocks)
    with remote(scoped, "other", tenant="acme") as o:
        with pytest.raises(PermissionDenied, match="model 'test-model'"):
            o.register(NS)
        with pytest.raises(PermissionDenied):
            o.get(ns_a, hs)
    with KVClient(scoped.socket_path) as local:  # the Unix socket is unscoped, as before
        assert local.lookup(ns_a, hs).hits == 2 and local.list_blocks()[1] == 2


def test_tcp_token_in_argv_logs_a_warning(daemon_factory, tmp_path):
    """Finding 1: --tcp-token puts the secret in /proc/<pid>/cmdline; the daemon says so."""
    log = str(tmp_path / "daemon.log")
    d = daemon_factory("--tcp-port", "0", "--tcp-token", SECRETS["admin"], log_path=log)
    with remote(d, "admin") as c:
        assert c.ping()
    assert "cmdline" in open(log).read()


def test_tcp_token_file_grants_everything_without_a_warning(daemon_factory, tmp_path):
    """Finding 1: a token can come from a file (no secret in argv); it keeps the old all-scopes meaning."""
    log = str(tmp_path / "daemon.log")
    path = secret_file(str(tmp_path), "all", SECRETS["admin"])
    d = daemon_factory("--tcp-port", "0", "--tcp-token-file", path, log_path=log)
    assert SECRETS["admin"] not in " ".join(d.args)
    hs, blocks, payloads = salted_blocks("x", 2)
    with remote(d, "admin") as c:
        ns = c.register(NS)
        assert c.put(ns, blocks) == 2 and c.list_blocks()[1] == 2
    assert "cmdline" not in open(log).read()


@pytest.mark.parametrize("table,fragment", [
    ('token = "0123456789abcdef"\nops = ["read"]\n', "namespaces is required"),
    ('token = "0123456789abcdef"\nnamespaces = ["*"]\n', "ops is required"),
    ('token = "0123456789abcdef"\nnamespaces = ["*"]\nops = ["delete"]\n', "unknown ops"),
    ('token = "short"\nnamespaces = ["*"]\nops = ["read"]\n', "16 to 1024"),
    ('token_file = "/nonexistent/t"\nnamespaces = ["*"]\nops = ["read"]\n', "cannot read token file"),
    ('namespaces = ["*"]\nops = ["read"]\n', "exactly one of token_file"),
    ('token = "0123456789abcdef"\nnamespaces = ["*"]\nops = ["read"]\ntenants = ["*", "a"]\n', "not both"),
    ('token = "0123456789abcdef"\nnamespaces = ["*"]\nops = ["read"]\ncolour = 1\n', "unknown keys"),
])
def test_bad_token_tables_are_named(tmp_path, table, fragment):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\ntcp_port = 9999\n[[server.tcp_tokens]]\n" + table)
    with pytest.raises(ConfigError, match=fragment):
        load_config(str(path))


def test_two_scopes_may_not_share_a_token(tmp_path):
    path = tmp_path / "dup.toml"
    one = '[[server.tcp_tokens]]\ntoken = "0123456789abcdef"\nnamespaces = ["*"]\nops = ["read"]\n'
    path.write_text("[server]\ntcp_port = 9999\n" + one + one)
    with pytest.raises(ConfigError, match="share a token"):
        load_config(str(path))


def test_every_op_has_a_class():
    """Fail closed: an op with no class is refused to every token, so a new op must be classified."""
    from kvstore.server.auth import OP_CLASS
    from kvstore.server.rpc import Handlers

    assert set(Handlers(None, (), 1, 1 << 20, {}).ops) == set(OP_CLASS)  # type: ignore[arg-type]


# -- 2. unauthenticated peers -----------------------------------------------------------

def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def test_frames_before_hello_are_small_and_cost_no_memory(daemon_factory):
    """Finding 2: two peers that never said hello, each sending 23 MiB of a 24 MiB frame, grew the daemon
    by 46.5 MiB."""
    d = daemon_factory("--tcp-port", "0", "--tcp-token", SECRETS["admin"])
    before = rss_anon_bytes(d.proc.pid)
    peers, junk = [], b"\0" * MiB
    for _ in range(2):
        sock = raw_tcp(d, timeout=10)
        peers.append(sock)
        try:
            sock.sendall(struct.pack(">I", 24 * MiB))
            for _ in range(23):  # bounded: 23 MiB, or until the daemon hangs up
                sock.sendall(junk)
        except OSError:
            pass  # closed by the daemon: what should happen
    time.sleep(0.5)  # let the daemon take in whatever it is going to
    grown = rss_anon_bytes(d.proc.pid) - before
    for sock in peers:
        sock.close()
    assert grown < 8 * MiB, f"the daemon grew by {grown / MiB:.1f} MiB for two unauthenticated peers"
    assert errors(d).get("tcp_hello_frame_too_large") == 2


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_peer_with_a_wrong_token_is_not_read_further(daemon_factory):
    """Finding 2: after a wrong hello, what the peer goes on sending is neither read nor kept."""
    d = daemon_factory("--tcp-port", "0", "--tcp-token", SECRETS["admin"])

    def peer() -> None:
        sock = raw_tcp(d, timeout=10)
        try:
            sock.sendall(frame([1, "hello", {"token": "wrong-token-wrong-token"}]) + struct.pack(">I", 60 * MiB))
            for _ in range(40):  # bounded: 40 MiB of a 60 MiB frame, or until the daemon hangs up
                sock.sendall(b"\0" * MiB)
        except OSError:
            pass
        finally:
            sock.close()

    before = peak_rss_bytes(d.proc.pid)
    peers = [threading.Thread(target=peer) for _ in range(4)]
    for t in peers:
        t.start()
    for t in peers:
        t.join(timeout=30)
    grown = peak_rss_bytes(d.proc.pid) - before
    assert grown < 16 * MiB, f"the daemon's peak grew by {grown / MiB:.1f} MiB for four peers with a wrong token"
    assert errors(d).get("tcp_auth_failed") == 4


def test_silent_peers_are_capped_and_timed_out(daemon_factory):
    """Finding 2: 300 silent unauthenticated connections were all kept open (cap 64, 5 s to say hello)."""
    d = daemon_factory("--tcp-port", "0", "--tcp-token", SECRETS["admin"])
    socks = [raw_tcp(d) for _ in range(80)]
    try:
        assert wait_for(lambda: all(closed_now(s) for s in socks[64:]), 3)  # the 16 over the cap: at once
        assert errors(d).get("tcp_unauthenticated_cap") == 16
        assert not any(closed_now(s) for s in socks[:64]) and d.stats()["tcp_unauthenticated"] == 64
        assert wait_for(lambda: all(closed_now(s) for s in socks[:64]), 5 + 5)  # the rest: at the hello deadline
        assert errors(d).get("tcp_hello_timeout") == 64
    finally:
        for s in socks:
            s.close()
    with remote(d, "admin") as c:  # the slots are free again
        assert c.ping()
    metrics = d.http("/metrics")[1].decode()
    assert 'kvstore_errors_total{type="tcp_unauthenticated_cap"} 16.0' in metrics
    assert 'kvstore_errors_total{type="tcp_hello_timeout"} 64.0' in metrics


def test_a_wrong_token_closes_the_connection(daemon_factory):
    """Finding 2: wrong tokens were refused at ~11,000/s on one connection with no delay."""
    d = daemon_factory("--tcp-port", "0", "--tcp-token", SECRETS["admin"])
    for first in ([1, "hello", {"token": "wrong-token-wrong-token"}], [1, "ping", {}]):
        sock = raw_tcp(d)
        started = time.monotonic()
        sock.sendall(frame(first) + frame([2, "hello", {"token": SECRETS["admin"]}]))  # a second try, pipelined
        reply = read_reply(sock)
        assert reply is not None and reply[1]["type"] == "AuthError"
        assert read_reply(sock) is None  # closed: the second hello was never read
        assert time.monotonic() - started >= 0.15  # and answered after a delay
        sock.close()
    assert errors(d).get("tcp_auth_failed") == 2
    assert 'kvstore_errors_total{type="tcp_auth_failed"} 2.0' in d.http("/metrics")[1].decode()


def test_limits_before_hello_are_configurable(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[server]\ntcp_hello_timeout = 1.5\ntcp_hello_max_frame = "8KiB"\ntcp_max_unauthenticated = 3\n')
    sc = load_config(str(path)).server
    assert (sc.tcp_hello_timeout_s, sc.tcp_hello_max_frame_bytes, sc.tcp_max_unauthenticated) == (1.5, 8192, 3)
    for bad, fragment in ((dict(tcp_hello_timeout_s=0), "tcp_hello_timeout"),
                          (dict(tcp_hello_max_frame_bytes=100), "tcp_hello_max_frame"),
                          (dict(tcp_max_unauthenticated=0), "tcp_max_unauthenticated")):
        with pytest.raises(ConfigError, match=fragment):
            ServerConfig(**bad)


# -- 3. frames under the daemon's limit --------------------------------------------------

BIG = namespace(block_bytes=MiB)


@pytest.fixture
def small_frames(daemon_factory, tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[server]\nmax_frame = "4MiB"\n')
    return daemon_factory("--config", str(path), "--tcp-port", "0", "--tcp-token", SECRETS["admin"])


def test_a_remote_put_larger_than_a_frame_is_split(small_frames):
    """Finding 3: KVClient(tcp=...).put of 8 x 1 MiB against max_frame = "4MiB" got 'Connection reset by peer'."""
    hs, blocks, payloads = salted_blocks("big", 8, MiB)
    with remote(small_frames, "admin") as c:
        ns = c.register(BIG)
        assert c.put(ns, blocks) == 8
        assert all(np.array_equal(g, w) for g, w in zip(c.get(ns, hs), payloads))
        assert c.server_info["max_frame_bytes"] == 4 * MiB
    with KVClient(small_frames.socket_path) as local:
        assert all(np.array_equal(g, w) for g, w in zip(local.get(local.register(BIG), hs), payloads))


def test_a_frame_over_the_limit_gets_an_error_naming_the_limit(small_frames):
    """Finding 3: over the limit, the client raises ProtocolError naming it, never a reset."""
    hs, blocks, payloads = salted_blocks("big", 6, MiB)
    with remote(small_frames, "admin") as c:
        ns = c.register(BIG)
        c.server_info.pop("max_frame_bytes", None)  # a client that does not know the limit sends it all in one frame
        with pytest.raises(ProtocolError, match="exceeds the limit of 4194304 B"):
            c.call("put", ns=ns, blocks=[[h, p, bytes(data)] for h, p, data in blocks])
    with remote(small_frames, "admin") as c:
        ns = c.register(BIG)
        with pytest.raises(ProtocolError, match="frame limit of 4194304 B"):  # refused here, nothing sent
            c.put(ns, [(hs[0], None, np.zeros(5 * MiB, np.uint8))])
        c.put(ns, blocks)
        with pytest.raises(ProtocolError, match=r"frame limit of 4194304 B; ask for at most 3"):
            c.call("get", ns=ns, hashes=hs)  # the reply would be over the limit
        assert c.ping() and len(c.get(ns, hs)) == 6  # the connection survived both


def test_unix_batches_fit_the_frame_limit(daemon_factory, tmp_path):
    """Finding 3: a full batch of hashes always fits a frame; a config where it would not is refused."""
    with pytest.raises(ConfigError, match="cannot carry a batch of server.max_batch_blocks"):
        ServerConfig(max_frame_bytes=64 * 1024)
    path = tmp_path / "kv.toml"
    path.write_text("[server]\nmax_batch_blocks = 512\nmax_frame = 21504\n")  # the least that carries 512
    d = daemon_factory("--config", str(path))
    small = Namespace("test-model", "bfloat16", 1, 1, 8, 16, 4096)
    hs, blocks, payloads = salted_blocks("unix", 512, 4096)
    with KVClient(d.socket_path) as c:
        ns = c.register(small)
        assert c.put(ns, blocks, chunk=512) == 512
        assert c.lookup(ns, hs).hits == 512
        c.release(ns, [h for h, e in zip(hs, c.acquire(ns, hs)) if e is not None])
        assert c.remove(ns, hs[:1]) == 512
    assert d.check() == []
