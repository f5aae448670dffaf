"""The client engines and tools use to talk to the daemon.

One `KVClient` over one of two transports (kvstore/transports.py): local
clients connect over the Unix socket and map the daemon's shared arena;
`reserve`/`commit` and `acquire`/`release` exchange extents ([offset, length]
runs in the arena) and the payload bytes are copied by the client, never sent
over the socket. Remote clients connect over TCP with a token (and the tenant
the token is for, if it is scoped to tenants: kvstore/tokens.py) and move
payloads inline in frames. `put`, `get` and `get_into` work over both. No
request is sent over the frame limit the daemon announced: that is a
ProtocolError here.

Errors are exceptions (kvstore.errors), re-raised with the class the daemon
raised; a miss is None. `DaemonUnavailable` means the daemon could not be
reached or did not answer in time; the connection is then closed and the next
call reconnects. One client is one connection: not shared between threads
without the internal lock (every call takes it).

This module imports the wire types (kvstore/wire.py) and the arena's client
side (tiers/arena.py), never the store: an engine worker loads no daemon code.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Sequence

import numpy as np

from kvstore.config import default_socket_path
from kvstore.errors import ERRORS_BY_NAME, DaemonUnavailable, KVStoreError, ProtocolError
from kvstore.keys import Namespace
from kvstore.protocol import HEADER, pack_frame, unpack_body
from kvstore.transports import ArenaTransport, Block, InlineTransport
from kvstore.wire import Extents, LookupResult, WaitResult
from kvstore.tiers.arena import copy_bytes  # noqa: F401  (re-exported: connectors/ reach tiers only through kvstore)


# A wait for a reply polls the socket this long before it sleeps in the kernel. Where the daemon answers
# within it (a lookup, a ping, a small acquire), neither side pays for waking a sleeping process: on this
# project's VMs that is ~20 us each way of a 33-41 us round trip, and it cut a 32-block lookup's latency
# from 100-116 to 65-68 us in a probe (docs/benchmarks.md, Scale, "A reply awaited"). A reply that takes
# longer costs the spin's CPU once and is then waited for asleep.
SPIN_US = 100.0
MAX_SPIN_US = 10_000.0


def check_spin_us(spin_us: object) -> None:
    """ValueError unless `spin_us` is a number of microseconds in 0..MAX_SPIN_US."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not 0 <= spin_us <= MAX_SPIN_US:
        raise ValueError(f"spin_us must be a number of microseconds in 0..{MAX_SPIN_US:g}, got {spin_us!r}")


def _arrived(sock: socket.socket, view: memoryview, spin_s: float) -> int:
    """Read into `view` what has arrived on `sock` (in timeout mode, so non-blocking underneath), without
    the poll Python's timeout mode makes before each read; poll for up to `spin_s` while nothing has.
    0 if nothing came."""
    fd, deadline = sock.fileno(), -math.inf
    while True:
        try:
            k = os.readv(fd, [view])
        except BlockingIOError:
            now = time.perf_counter()
            if deadline == -math.inf:
                deadline = now + spin_s
            if now >= deadline:
                return 0
            continue
        if k == 0:
            raise EOFError("connection closed by the daemon")
        return k


class KVClient:
    def __init__(
        self,
        socket_path: str | None = None,
        *,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        tenant: str | None = None,
        timeout_s: float = 5.0,
        name: str = "",
        connect: bool = True,
        copy_threads: int = 2,
        spin_us: float = SPIN_US,
    ) -> None:
        if not isinstance(copy_threads, int) or copy_threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        check_spin_us(spin_us)
        self._spin_s = spin_us / 1e6  # how long a wait for a reply polls before it sleeps (SPIN_US)
        self.copy_threads = copy_threads  # local clients' copy threads (kvstore/transports.py)
        self.socket_path = socket_path or default_socket_path()
        self.tcp = tcp
        self.transport: ArenaTransport | InlineTransport = (
            InlineTransport(tcp) if tcp is not None else ArenaTransport(self.socket_path, copy_threads))
        self.token = token
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.name = name
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.server_info: dict = {}
        self._pending: deque = deque()  # (msgid, op) sent, reply not yet read
        self._replies: dict[int, tuple] = {}
        self._block_bytes: dict[str, int] = {}  # namespace id -> block size, from register
        if connect:
            self.connect()

    # -- connection -----------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        with self._lock:
            if self._sock is not None:
                return
            try:
                sock = self.transport.open(self.timeout_s)
            except OSError as exc:
                raise DaemonUnavailable(f"cannot reach the kvstore daemon at {self.transport.where}: {exc}") from None
            self._sock = sock
            try:
                self.transport.greet(sock)
                hello = {"token": self.token, "client": self.name, "tenant": self.tenant}
                self.server_info = self._call("hello", hello)
                self.transport.welcomed(self.server_info)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        with self._lock:
            self.transport.close()
            self._pending.clear()
            self._replies.clear()
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def arena(self) -> np.ndarray:
        """The daemon's arena, mapped (local clients)."""
        return self.transport.arena

    # -- the RPC ------------------------------------------------------------------
    def call(self, op: str, **args: Any) -> Any:
        with self._lock:
            return self.wait(self.send(op, **args))

    def send(self, op: str, **args: Any) -> int:
        """Send a request without waiting for its reply; `wait(msgid)` collects it.

        The daemon answers a connection's requests in order, so a client may keep
        several in flight (e.g. reserve the next batch while copying this one).
        """
        with self._lock:
            if self._sock is None:
                self.connect()
            msgid = next(self._ids)
            frame = pack_frame([msgid, op, args])
            limit = self.server_info.get("max_frame_bytes")
            if limit is not None and len(frame) - HEADER.size > limit:  # the daemon would refuse it and hang up
                raise ProtocolError(f"a {op} request of {len(frame) - HEADER.size} B exceeds the daemon's frame "
                                    f"limit of {limit} B (server.max_frame); send fewer blocks per call")
            try:
                self._sock.sendall(frame)  # type: ignore[union-attr]
            except OSError as exc:
                self.close()
                raise DaemonUnavailable(f"kvstore daemon did not take {op}: {exc}") from None
            self._pending.append((msgid, op))
            return msgid

    def wait(self, msgid: int) -> Any:
        with self._lock:
            while msgid not in self._replies:
                if not self._pending:
                    raise KVStoreError(f"no request {msgid} in flight")
                expected, op = self._pending.popleft()
                self._replies[expected] = self._read_reply(expected, op)
            error, result = self._replies.pop(msgid)
            if error is not None:
                raise error
            return result

    def _call(self, op: str, args: dict) -> Any:
        return self.wait(self.send(op, **args))

    def _read_reply(self, msgid: int, op: str) -> tuple[BaseException | None, Any]:
        try:
            (length,) = HEADER.unpack(self._recv_exactly(HEADER.size, self._spin_s))
            reply = unpack_body(self._recv_exactly(length))
        except (OSError, EOFError, ProtocolError) as exc:  # socket.timeout is an OSError
            self.close()
            raise DaemonUnavailable(f"kvstore daemon did not answer {op}: {exc or type(exc).__name__}") from None
        if not (isinstance(reply, list) and len(reply) == 3 and isinstance(reply[0], int)):
            self.close()
            raise ProtocolError("malformed reply from the daemon")
        rid, error, result = reply
        if error is not None:
            if rid == 0:  # the daemon could not read our frame and closed the stream
                self.close()
            cls = ERRORS_BY_NAME.get(error.get("type"), KVStoreError) if isinstance(error, dict) else KVStoreError
            return cls(error.get("message", "") if isinstance(error, dict) else str(error)), None
        if rid != msgid:
            self.close()
            raise ProtocolError(f"reply {rid} does not match request {msgid}")
        return None, result

    def _recv_exactly(self, n: int, spin_s: float = 0.0) -> bytes:
        """The next `n` bytes. What has arrived is read at once; for the rest the socket's timeout
        applies, after polling for up to `spin_s` while nothing has arrived (a reply's first bytes)."""
        sock = self._sock
        assert sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = _arrived(sock, view, spin_s) if sock.gettimeout() and type(sock) is socket.socket else 0  # (not TLS)
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("connection closed by the daemon")
            got += k
        return bytes(buf)

    # -- namespaces and queries --------------------------------------------------
    def register(self, ns: Namespace) -> str:
        ns_id = self.call("register", namespace=ns.to_dict())["ns"]
        self._block_bytes[ns_id] = ns.block_bytes
        return ns_id

    def block_bytes_of(self, ns_id: str) -> int | None:
        """The block size of a namespace this client registered (None for one it did not)."""
        return self._block_bytes.get(ns_id)

    def lookup(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        r = self.call("lookup", ns=ns_id, hashes=list(hashes))
        return LookupResult(r["hits"], tuple(r["tiers"]))

    def stats(self) -> dict:
        return self.call("stats")

    def list_blocks(self, ns_id: str | None = None, limit: int = 100) -> tuple[list, int]:
        """Up to `limit` rows [ns, hash, tier, depth, pins, committed, nbytes], and the total count."""
        r = self.call("blocks", ns=ns_id, limit=limit)
        return r["blocks"], r["total"]

    def describe(self, ns_id: str, hashes: Sequence[bytes]) -> list[dict | None]:
        """Per hash: None (not stored) or {tier, committed, pins, hits, depth, idle_s, policy_value, copies, ...}."""
        limit = self.server_info.get("max_batch_blocks", 8192)
        out: list[dict | None] = []
        for i in range(0, len(hashes), limit):
            out += self.call("describe", ns=ns_id, hashes=list(hashes[i : i + limit]))["blocks"]
        return out

    def remove(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Remove blocks and everything stored under them; pinned subtrees are left alone."""
        return self.call("remove", ns=ns_id, hashes=list(hashes))["removed"]

    def ping(self) -> bool:
        return bool(self.call("ping")["pong"])

    # -- zero-copy, two-phase (local clients) -------------------------------------
    def reserve(self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]]) -> list[Extents | None]:
        return self.call("reserve", ns=ns_id, blocks=[[h, p] for h, p in blocks])["extents"]

    def commit(self, ns_id: str, hashes: Sequence[bytes], attention: Sequence[float] | None = None,
               tokens: Sequence[bytes | None] | None = None) -> int:
        """`tokens`: per block its token ids as <u4 bytes (or None), for the daemon's KV events;
        worth sending only when `server_info["events"]["token_ids"]` says the daemon publishes them."""
        args: dict = {"ns": ns_id, "hashes": list(hashes)}
        if attention is not None:
            args["attention"] = [float(a) for a in attention]
        if tokens is not None:
            args["tokens"] = list(tokens)
        return self.call("commit", **args)["committed"]

    def abort(self, ns_id: str, hashes: Sequence[bytes]) -> None:
        self.call("abort", ns=ns_id, hashes=list(hashes))

    def acquire(self, ns_id: str, hashes: Sequence[bytes], prefix: bool = True) -> list[Extents | None]:
        return self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=prefix)["extents"]

    def acquire_at(self, ns_id: str, hashes: Sequence[bytes], tier: str,
                   prefix: bool = True) -> tuple[list[Extents | None], list[str | None]]:
        """`acquire` for a client that also reads `tier` ("gpu": an engine that mapped the GPU pools,
        `gpu_pools`): each block's extents and the tier they are in ("gpu" or "host"; None: a miss)."""
        reply = self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=prefix, tier=tier)
        return reply["extents"], reply["at"]

    def reserve_at(self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]],
                   tier: str) -> tuple[list[Extents | None], list[str | None]]:
        """`reserve`, into `tier` ("gpu") where it has free pages, else into the arena: each block's
        extents and the tier they are in (None: skipped)."""
        reply = self.call("reserve", ns=ns_id, blocks=[[h, p] for h, p in blocks], tier=tier)
        return reply["extents"], reply["at"]

    @property
    def gpu_pools(self) -> list[dict] | None:
        """The daemon's GPU pools as this connection may map them (`kvstore.tiers.gpu.open_pool`), one per device
        slot; None where the daemon has no gpu tier (or is reached over TCP)."""
        gpu = self.server_info.get("gpu") or {}
        return gpu.get("pools") if gpu.get("available") else None

    def gpu_pool_buffers(self) -> list | None:
        """The GPU pools mapped into this process, per device slot (mapped once per daemon): CUDA tensors
        opened by IPC, or NumPy arrays over the emulated tier's shared memory. A block at global offset
        `o` of the gpu tier is at `o % SLOT` of buffer `o // SLOT` (kvstore.tiers.gpu.SLOT)."""
        handles = self.gpu_pools
        if handles is None or not isinstance(self.transport, ArenaTransport):
            return None
        return self.transport.pools(handles)

    def acquire_with_tiers(
        self, ns_id: str, hashes: Sequence[bytes], prefix: bool = True, tier: str | None = None
    ) -> tuple[list[Extents | None], list[str | None]]:
        """`acquire`, plus the tier each block was found in ("host", "disk", ...) before
        the daemon promoted it into the arena; None where the block is missing. `tier` as in `acquire_at`."""
        args = {"tier": tier} if tier is not None else {}
        reply = self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=prefix, **args)
        extents = reply["extents"]
        tiers = reply.get("tiers") or [None if e is None else "host" for e in extents]  # an older daemon
        return extents, tiers

    def acquire_inflight(
        self, ns_id: str, hashes: Sequence[bytes], tier: str | None = None
    ) -> tuple[list[Extents | None], list[str | None], int]:
        """`acquire_with_tiers(prefix=True)`, plus how many leading blocks are committed or in
        flight (reserved or announced by a producer): those a consumer may `wait` for."""
        args = {"tier": tier} if tier is not None else {}
        reply = self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=True, inflight=True, **args)
        extents = reply["extents"]
        tiers = reply.get("tiers") or [None if e is None else "host" for e in extents]
        return extents, tiers, int(reply.get("inflight", 0))

    def wait_committed(self, ns_id: str, hashes: Sequence[bytes], timeout_s: float, appear: bool = False) -> WaitResult:
        """Block until the leading `hashes` are committed, or until one of them stops being in flight
        (aborted, its producer gone), is absent (unless `appear`), or `timeout_s` passes.

        Holds this connection for the whole wait (replies come in order): use a connection of its
        own. The socket timeout is stretched to cover the wait."""
        with self._lock:
            sock = self._sock
            if sock is not None:
                sock.settimeout(self.timeout_s + timeout_s)
            try:
                r = self.call("wait", ns=ns_id, hashes=list(hashes), timeout_s=float(timeout_s), appear=appear)
            finally:
                if self._sock is not None:
                    self._sock.settimeout(self.timeout_s)
        return WaitResult(int(r["ready"]), tuple(r["waited"]), str(r["reason"]))

    def expect(self, ns_id: str, hashes: Sequence[bytes]) -> None:
        """Announce blocks this client's engine is about to save (consumers may wait for them)."""
        if hashes:
            self.call("expect", ns=ns_id, hashes=list(hashes))

    def withdraw(self, ns_id: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.call("withdraw", ns=ns_id, hashes=list(hashes))

    def release(self, ns_id: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.call("release", ns=ns_id, hashes=list(hashes))

    # -- convenience: whole payloads (over either transport) -----------------------------
    def put(self, ns_id: str, blocks: Sequence[Block], chunk: int = 32) -> int:
        """Store blocks given as (hash, parent, payload); returns how many were newly stored."""
        with self._lock:
            return self.transport.put(self, ns_id, blocks, chunk)

    def get_into(self, ns_id: str, hashes: Sequence[bytes], outs: Sequence, chunk: int = 32) -> list[bool]:
        """Copy blocks into the given writable buffers; True where the block was present."""
        with self._lock:
            return self.transport.get_into(self, ns_id, hashes, outs, chunk)

    def get(self, ns_id: str, hashes: Sequence[bytes]) -> list[np.ndarray | None]:
        """Payloads of the given blocks (None where missing); pins are released before returning."""
        with self._lock:
            return self.transport.get(self, ns_id, hashes)
