"""The client engines and tools use to talk to the daemon.

Local clients connect over the Unix socket and map the daemon's shared arena:
`reserve`/`commit` and `acquire`/`release` exchange extents ([offset, length]
runs in the arena) and the payload bytes are copied by the client, never sent
over the socket. Remote clients connect over TCP with a token (and the tenant
the token is for, if it is scoped to tenants: kvstore/tokens.py) and use
`put`/`get`, which carry payloads inline, cut into frames under the daemon's
limit (kvstore/remote_io.py). `put` and `get` work for both. No request is
sent over the frame limit the daemon announced: that is a ProtocolError here.

A local client trusts only a daemon of its own user or root: it reads the
daemon's uid off the Unix socket (SO_PEERCRED) before saying anything, and maps
the arena only if the daemon's uid owns that file (`map_arena`); otherwise
OwnershipError, and nothing is sent or mapped.

Errors are exceptions (kvstore.errors), re-raised with the class the daemon
raised; a miss is None. `DaemonUnavailable` means the daemon could not be
reached or did not answer in time; the connection is then closed and the next
call reconnects. One client is one connection: not shared between threads
without the internal lock (every call takes it).

Local `put`/`get_into` copy a batch's blocks on `copy_threads` threads (default
2) when the batch holds at least PARALLEL_COPY_MIN_BYTES in blocks of at least
PARALLEL_COPY_MIN_BLOCK_BYTES: one core's memcpy does not saturate memory
bandwidth (2 MiB blocks move ~1.2x faster on the 2-core dev VM, see
docs/benchmarks.md). Smaller blocks stay on the calling thread: there the
daemon's per-block work is the limit, and copy threads only take its CPU
(256 KiB blocks were 15% slower to put). `copy_threads=1` never uses threads.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.config import default_socket_path
from kvstore.errors import ERRORS_BY_NAME, DaemonUnavailable, KVStoreError, OwnershipError, ProtocolError
from kvstore.inflight import WaitResult as WaitReply
from kvstore.keys import Namespace
from kvstore.protocol import HEADER, pack_frame, unpack_body
from kvstore.remote_io import get_inline, put_inline
from kvstore.store import LookupResult
from tiers.host import ArenaRefused, Extents, copy_in, copy_out, map_arena
from tiers.host import copy_bytes  # noqa: F401  (re-exported: connectors/ reach tiers only through kvstore)

Block = tuple  # (hash, parent hash or None, payload buffer)
PARALLEL_COPY_MIN_BYTES = 4 << 20
PARALLEL_COPY_MIN_BLOCK_BYTES = 1 << 20


def daemon_uid(sock: socket.socket, path: str) -> int:
    """The uid of the process on the other end of a Unix socket; OwnershipError unless it is ours or root.

    A socket in a folder another user can write may have been replaced by theirs: talking to
    it would hand them our requests and have us map (and write our KV data into) their file.
    """
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid not in (os.geteuid(), 0):
        raise OwnershipError(f"the kvstore socket {path} is served by uid {uid}, not by uid {os.geteuid()} (us) "
                             f"or root: refused, nothing sent (another user's daemon, or a replaced socket)")
    return uid


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
    ) -> None:
        if not isinstance(copy_threads, int) or copy_threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        self.copy_threads = copy_threads
        self._pool: ThreadPoolExecutor | None = None
        self.socket_path = socket_path or default_socket_path()
        self.tcp = tcp
        self.token = token
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.name = name
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._arena: np.ndarray | None = None
        self._arena_id: str | None = None
        self._daemon_uid: int | None = None  # from SO_PEERCRED: who must own the arena
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
                if self.tcp is not None:
                    sock = socket.create_connection(self.tcp, timeout=self.timeout_s)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                else:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.socket_path)
            except OSError as exc:
                where = f"{self.tcp[0]}:{self.tcp[1]}" if self.tcp else self.socket_path
                raise DaemonUnavailable(f"cannot reach the kvstore daemon at {where}: {exc}") from None
            self._sock = sock
            try:
                if self.tcp is None:
                    self._daemon_uid = daemon_uid(sock, self.socket_path)
                hello = {"token": self.token, "client": self.name, "tenant": self.tenant}
                self.server_info = self._call("hello", hello)
                if self.tcp is None and self.server_info.get("arena_id") != self._arena_id:
                    self._map_arena()
            except BaseException:
                self.close()
                raise

    def _map_arena(self) -> None:
        """A (re)started daemon has a new arena: map it, never keep writing into the old one."""
        info = self.server_info
        try:
            self._arena = map_arena(info["arena_path"], info["arena_bytes"], owner_uid=self._daemon_uid)
        except ArenaRefused as exc:
            raise OwnershipError(str(exc)) from None
        self._arena_id = info.get("arena_id")

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
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
        if self._arena is None:
            raise KVStoreError("no arena: remote (TCP) clients use put/get")
        return self._arena

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
            (length,) = HEADER.unpack(self._recv_exactly(HEADER.size))
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

    def _recv_exactly(self, n: int) -> bytes:
        sock = self._sock
        assert sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
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

    def acquire_with_tiers(
        self, ns_id: str, hashes: Sequence[bytes], prefix: bool = True
    ) -> tuple[list[Extents | None], list[str | None]]:
        """`acquire`, plus the tier each block was found in ("host", "disk", ...) before
        the daemon promoted it into the arena; None where the block is missing."""
        reply = self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=prefix)
        extents = reply["extents"]
        tiers = reply.get("tiers") or [None if e is None else "host" for e in extents]  # an older daemon
        return extents, tiers

    def acquire_inflight(
        self, ns_id: str, hashes: Sequence[bytes]
    ) -> tuple[list[Extents | None], list[str | None], int]:
        """`acquire_with_tiers(prefix=True)`, plus how many leading blocks are committed or in
        flight (reserved or announced by a producer): those a consumer may `wait` for."""
        reply = self.call("acquire", ns=ns_id, hashes=list(hashes), prefix=True, inflight=True)
        extents = reply["extents"]
        tiers = reply.get("tiers") or [None if e is None else "host" for e in extents]
        return extents, tiers, int(reply.get("inflight", 0))

    def wait_committed(self, ns_id: str, hashes: Sequence[bytes], timeout_s: float, appear: bool = False) -> WaitReply:
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
        return WaitReply(int(r["ready"]), tuple(r["waited"]), str(r["reason"]))

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

    # -- convenience: whole payloads ------------------------------------------------
    def put(self, ns_id: str, blocks: Sequence[Block], chunk: int = 32) -> int:
        """Store blocks given as (hash, parent, payload); returns how many were newly stored.

        Locally, chunks are pipelined: the reserve of chunk k+1 is in flight while
        chunk k is copied into the arena, and commits are not waited for until the end.
        """
        if self.tcp is not None:
            return put_inline(self, ns_id, blocks)
        with self._lock:
            chunks = [blocks[i : i + chunk] for i in range(0, len(blocks), chunk)]
            commits: list[int] = []
            next_reserve = self._send_reserve(ns_id, chunks[0]) if chunks else None
            for k, part in enumerate(chunks):
                slots = self.wait(next_reserve)["extents"]
                ahead = None  # the next chunk's reserve, in flight during this chunk's copy
                if k + 1 < len(chunks):
                    next_reserve = ahead = self._send_reserve(ns_id, chunks[k + 1])
                mine = [(extents, h, data) for extents, (h, _, data) in zip(slots, part) if extents is not None]
                written = [h for _, h, _ in mine]
                try:
                    self._copy_batch([(copy_in, (self.arena, ext, data)) for ext, _, data in mine],
                                     sum(length for ext, _, _ in mine for _, length in ext))
                except BaseException:
                    if ahead is not None:  # first: its blocks may be reserved under this chunk's
                        self._undo_ahead(ahead, "abort", ns_id, [h for h, _, _ in chunks[k + 1]])
                    self.abort(ns_id, written)
                    raise
                if written:
                    commits.append(self.send("commit", ns=ns_id, hashes=written))
            return sum(self.wait(m)["committed"] for m in commits)

    def _undo_ahead(self, msgid: int, undo: str, ns_id: str, hashes: Sequence[bytes]) -> None:
        """A copy failed while the next chunk's reserve/acquire was in flight: take its
        answer and abort/release what it granted, so no reservation or pin outlives the call."""
        try:
            extents = self.wait(msgid)["extents"]
            granted = [h for h, ext in zip(hashes, extents) if ext is not None]
            if granted:
                self.call(undo, ns=ns_id, hashes=granted)
        except KVStoreError:
            pass  # daemon gone or refused: its lease expiry releases them

    def _copy_batch(self, copies: list[tuple[Callable, tuple]], nbytes: int) -> None:
        """Run `fn(*args)` for each copy; split over the copy threads when the batch is large.

        Waits for every thread before raising the first failure, so nothing is
        still writing when the caller aborts or releases the blocks.
        """
        k = min(self.copy_threads, len(copies))
        if k <= 1 or nbytes < PARALLEL_COPY_MIN_BYTES or nbytes < PARALLEL_COPY_MIN_BLOCK_BYTES * len(copies):
            for fn, args in copies:
                fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="kvstore-copy")

        def run(part: list) -> None:
            for fn, args in part:
                fn(*args)

        futures = [self._pool.submit(run, copies[j::k]) for j in range(k)]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None:
                raise exc

    def _send_reserve(self, ns_id: str, part: Sequence[Block]) -> int:
        return self.send("reserve", ns=ns_id, blocks=[[h, p] for h, p, _ in part])

    def get_into(self, ns_id: str, hashes: Sequence[bytes], outs: Sequence, chunk: int = 32) -> list[bool]:
        """Copy blocks into the given writable buffers; True where the block was present.

        Pipelined like `put`: the acquire of chunk k+1 is in flight while chunk k
        is copied out, and releases are not waited for until the end.
        """
        if self.tcp is not None:
            found = []
            for data, out in zip(self.get(ns_id, hashes), outs):
                if data is not None:
                    np.frombuffer(out, np.uint8)[:] = data  # type: ignore[call-overload]
                found.append(data is not None)
            return found
        with self._lock:
            parts = [list(range(i, min(i + chunk, len(hashes)))) for i in range(0, len(hashes), chunk)]
            found = [False] * len(hashes)
            releases: list[int] = []
            send_acquire = lambda idx: self.send("acquire", ns=ns_id, hashes=[hashes[i] for i in idx], prefix=False)  # noqa: E731
            next_acquire = send_acquire(parts[0]) if parts else None
            for k, idx in enumerate(parts):
                extents = self.wait(next_acquire)["extents"]
                ahead = None  # the next chunk's acquire, in flight during this chunk's copy
                if k + 1 < len(parts):
                    next_acquire = ahead = send_acquire(parts[k + 1])
                mine = [(i, ext) for i, ext in zip(idx, extents) if ext is not None]
                held = [hashes[i] for i, _ in mine]  # all pinned by the acquire: release them whatever happens
                try:
                    self._copy_batch([(copy_out, (self.arena, ext, outs[i])) for i, ext in mine],
                                     sum(length for _, ext in mine for _, length in ext))
                except BaseException:
                    if ahead is not None:
                        self._undo_ahead(ahead, "release", ns_id, [hashes[i] for i in parts[k + 1]])
                    raise
                finally:
                    if held:
                        releases.append(self.send("release", ns=ns_id, hashes=held))
                for i, _ in mine:
                    found[i] = True
            for m in releases:
                self.wait(m)
            return found

    def get(self, ns_id: str, hashes: Sequence[bytes]) -> list[np.ndarray | None]:
        """Payloads of the given blocks (None where missing); pins are released before returning."""
        if self.tcp is not None:
            return get_inline(self, ns_id, hashes)
        with self._lock:
            extents = self.acquire(ns_id, hashes, prefix=False)
            try:
                return [None if ext is None else copy_out(self.arena, ext) for ext in extents]
            finally:
                self.release(ns_id, [h for h, ext in zip(hashes, extents) if ext is not None])
