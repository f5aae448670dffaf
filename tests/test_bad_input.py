"""Bad input never crashes the daemon, never changes what is stored, and gets an answer.

Each case gets an error reply or a closed connection. Afterwards the daemon is
alive, every stored block reads back identical, and the store's check() is clean.
"""

import random
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import KVStoreError, NamespaceError, ProtocolError
from kvstore.keys import hash_blocks
from tests.helpers import frame, namespace

NS = namespace("bad-input-model")


class Raw:
    """A bare socket speaking (or not) the protocol."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self):
        """The next reply, or None if the daemon closed the connection."""
        header = self._read(4)
        if header is None:
            return None
        body = self._read(struct.unpack(">I", header)[0])
        return None if body is None else msgpack.unpackb(body, raw=False)

    def _read(self, n: int):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def hello(self) -> None:
        self.send(frame([1, "hello", {}]))
        assert self.reply()[1] is None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stored(daemon):
    """A daemon holding a known chain of blocks."""
    hs = hash_blocks(np.arange(16 * 6), 16)
    payloads = [np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8) for i in range(6)]
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        assert c.put(ns, list(zip(hs, [None] + hs[:-1], payloads))) == 6
    return daemon, ns, hs, payloads


def assert_intact(daemon, ns, hs, payloads):
    assert daemon.alive()
    with KVClient(daemon.socket_path) as c:
        assert c.lookup(ns, hs).hits == len(hs)
        assert all(np.array_equal(g, w) for g, w in zip(c.get(ns, hs), payloads))
    assert daemon.check() == []
    assert daemon.stats()["pinned_blocks"] == 0 and daemon.stats()["reserved_blocks"] == 0


def error_type(reply) -> str:
    assert reply is not None, "expected an error reply, got a closed connection"
    assert reply[2] is None and isinstance(reply[1], dict)
    return reply[1]["type"]


def test_malformed_requests_get_error_replies_and_the_connection_survives(stored):
    daemon, ns, hs, payloads = stored
    raw = Raw(daemon.socket_path)
    cases = [
        (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "ProtocolError"),  # not msgpack
        (frame({"op": "lookup"}), "ProtocolError"),  # not [msgid, op, args]
        (frame([1, 2, 3]), "ProtocolError"),
        (frame([-5, "ping", {}]), "ProtocolError"),
        (frame([1, "ping", []]), "ProtocolError"),
        (frame([1, "ping", {}]), "AuthError"),  # before hello
    ]
    for data, want in cases:
        raw.send(data)
        assert error_type(raw.reply()) == want
    raw.hello()
    bad_args = [
        ("launch_missiles", {}, "ProtocolError"),
        ("lookup", {"ns": ns}, "ProtocolError"),
        ("lookup", {"ns": ns, "hashes": "nope"}, "ProtocolError"),
        ("lookup", {"ns": ns, "hashes": [b"short"]}, "ProtocolError"),
        ("lookup", {"ns": 7, "hashes": []}, "ProtocolError"),
        ("lookup", {"ns": "ns-wrong", "hashes": hs}, "NamespaceError"),
        ("acquire", {"ns": "ns-wrong", "hashes": hs}, "NamespaceError"),
        ("reserve", {"ns": ns, "blocks": [[hs[0]]]}, "ProtocolError"),
        ("reserve", {"ns": ns, "blocks": [[hs[0], 12]]}, "ProtocolError"),
        ("commit", {"ns": ns, "hashes": hs[:1]}, "KVStoreError"),  # not reserved by us
        ("commit", {"ns": ns, "hashes": hs[:1], "attention": ["x"]}, "ProtocolError"),
        ("release", {"ns": ns, "hashes": hs[:1]}, "KVStoreError"),  # not pinned by us
        ("abort", {"ns": ns, "hashes": hs[:2]}, "KVStoreError"),
        ("put", {"ns": ns, "blocks": [[hs[0], None, b"too short"]]}, "NamespaceError"),
        ("put", {"ns": ns, "blocks": [[hs[0], None, "str"]]}, "ProtocolError"),
        ("register", {"namespace": {"model": "m"}}, "NamespaceError"),
        ("register", {"namespace": {**NS.to_dict(), "num_layers": -1}}, "NamespaceError"),
        ("register", {"namespace": {**NS.to_dict(), "block_bytes": 1 << 40}}, "NamespaceError"),
        ("lookup", {"ns": ns, "hashes": [hs[0]] * 100_000}, "ProtocolError"),  # over max_batch_blocks
    ]
    for i, (op, args, want) in enumerate(bad_args, start=2):
        raw.send(frame([i, op, args]))
        reply = raw.reply()
        assert error_type(reply) == want, (op, args, reply)
        assert reply[0] == i
    raw.send(frame([99, "ping", {}]))
    assert raw.reply() == [99, None, {"pong": True}]
    raw.close()
    assert_intact(daemon, ns, hs, payloads)
    assert daemon.stats()["errors"]["ProtocolError"] >= 10


def test_oversize_length_prefix_closes_the_connection(stored):
    daemon, ns, hs, payloads = stored
    raw = Raw(daemon.socket_path)
    raw.send(struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)
    assert error_type(raw.reply()) == "ProtocolError"
    assert raw.reply() is None  # and the stream is closed: it cannot be resynchronised
    raw.close()
    assert_intact(daemon, ns, hs, payloads)


def test_oversize_length_prefix_without_a_body_is_answered_and_closed(stored):
    """Protocol fuzzing: a length prefix over the limit but within the drained range, and no
    body. The daemon answered and then kept the connection open waiting for the body (still open 10 s
    later); it must answer and close (within DISCARD_IDLE_S)."""
    daemon, ns, hs, payloads = stored
    limit = daemon.client().server_info["max_frame_bytes"]
    raw = Raw(daemon.socket_path)
    raw.hello()
    raw.send(struct.pack(">I", limit + 1))
    t0 = time.monotonic()
    assert error_type(raw.reply()) == "ProtocolError"
    assert raw.reply() is None  # closed, not waiting for a body that never comes (recv times out at 5 s)
    assert time.monotonic() - t0 < 3.0  # DISCARD_IDLE_S (1 s) and some slack
    raw.close()
    assert_intact(daemon, ns, hs, payloads)


def test_truncated_frames_and_abrupt_disconnects(stored):
    daemon, ns, hs, payloads = stored
    whole = frame([1, "hello", {}]) + frame([2, "acquire", {"ns": ns, "hashes": hs}])
    for cut in (1, 3, 4, 7, len(whole) - 1):
        raw = Raw(daemon.socket_path)
        raw.send(whole[:cut])
        raw.close()
    # a client that pinned and reserved, then vanished without a word
    raw = Raw(daemon.socket_path)
    raw.send(whole + frame([3, "reserve", {"ns": ns, "blocks": [[b"\x07" * 16, hs[-1]]]}]))
    assert raw.reply()[1] is None and raw.reply()[1] is None and raw.reply()[1] is None
    raw.close()
    assert_intact(daemon, ns, hs, payloads)


def test_thousands_of_random_inputs(stored):
    daemon, ns, hs, payloads = stored
    rng = random.Random(1234)
    ops = ["hello", "ping", "register", "lookup", "reserve", "commit", "abort", "acquire", "release", "put", "get", "stats", "x"]
    atoms = [None, True, 0, -1, 2**40, 1.5, "", "ns", ns, b"", b"\x00" * 16, hs[0], [], {}, [hs[0]], [[hs[0], None]]]

    def rand_obj(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.5:
            return rng.choice(atoms)
        if r < 0.75:
            return [rand_obj(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["ns", "hashes", "blocks", "prefix", "attention", "namespace", "token"]): rand_obj(depth + 1)
                for _ in range(rng.randint(0, 3))}

    replies = closed = 0
    raw = Raw(daemon.socket_path)
    raw.hello()
    for i in range(3000):
        kind = rng.random()
        if kind < 0.1:  # pure noise, with a plausible small length prefix
            body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
            data = struct.pack(">I", len(body)) + body
        elif kind < 0.15:  # noise with an arbitrary header, then the client vanishes mid-frame
            raw.send(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 12))))
            raw.close()
            closed += 1
            raw = Raw(daemon.socket_path)
            raw.hello()
            continue
        else:
            data = frame([i, rng.choice(ops), rand_obj()] if rng.random() < 0.9 else rand_obj())
        try:
            raw.send(data)
            reply = raw.reply()
        except (socket.timeout, OSError):
            reply = None  # an incomplete frame: the daemon is still waiting for the rest
        if reply is None:
            closed += 1
            raw.close()
            raw = Raw(daemon.socket_path)
            raw.hello()
        else:
            replies += 1
            assert isinstance(reply, list) and len(reply) == 3
    raw.close()
    assert replies > 2500
    assert_intact(daemon, ns, hs, payloads)


def test_client_raises_typed_errors(stored):
    daemon, ns, hs, payloads = stored
    with KVClient(daemon.socket_path) as c:
        with pytest.raises(NamespaceError):
            c.acquire("ns-0000", hs)
        with pytest.raises(ProtocolError):
            c.call("nope")
        with pytest.raises(KVStoreError):
            c.release(ns, hs)
        assert c.ping()
    assert_intact(daemon, ns, hs, payloads)
