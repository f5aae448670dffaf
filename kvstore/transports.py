"""How a client's payloads reach the daemon: the two transports of `KVClient` (kvstore/client.py).

- `ArenaTransport`, local clients: a Unix socket, and the daemon's shared
  arena mapped read-write. `put`/`get`/`get_into` reserve or acquire extents
  and copy the bytes in or out of the arena themselves; no payload byte
  crosses the socket. Chunks are pipelined: the reserve (acquire) of chunk
  k+1 is in flight while chunk k is copied, and commits (releases) are not
  waited for until the end. A batch's blocks are copied on `copy_threads`
  threads when it holds at least PARALLEL_COPY_MIN_BYTES in blocks of at least
  PARALLEL_COPY_MIN_BLOCK_BYTES (one core's memcpy does not saturate memory
  bandwidth: 2 MiB blocks move ~1.2x faster on a 2-core VM); smaller blocks
  stay on the calling thread, where the daemon's per-block work is the limit
  and copy threads only take its CPU. A local client trusts only a daemon of
  its own user or root: it reads the daemon's uid off the socket (SO_PEERCRED)
  before saying anything, and maps the arena only if that uid owns the file.
- `InlineTransport`, remote clients: TCP, payloads inline in the frames. A put
  or a get is sent as requests of at most `inline_blocks_per_frame` blocks (and
  at most `max_batch_blocks`), so no request, and no reply asked for, is over
  the frame limit the daemon announced at hello: a large put is several
  frames, never a reset. A block that fits in no frame raises ProtocolError
  naming the limit before anything is sent. A get needs the namespace's block
  size, which the client learns when it registers the namespace; for one it
  did not register it sends one request and the daemon says how many blocks
  fit. Requests go one after the other: a put's blocks are committed frame by
  frame, so a child in a later frame finds its parent already stored.

A transport talks to the daemon only through the `Rpc` it is given (the
client), and holds no lock: the client holds its own around every call.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kvstore.errors import KVStoreError, OwnershipError, ProtocolError
from kvstore.protocol import inline_blocks_per_frame
from kvstore.tiers.arena import ArenaRefused, copy_in_many, copy_out, copy_out_many, map_arena

Block = tuple  # (hash, parent hash or None, payload buffer)
PARALLEL_COPY_MIN_BYTES = 4 << 20
PARALLEL_COPY_MIN_BLOCK_BYTES = 1 << 20
CONNECT_RETRY_S = 0.01  # a Unix connect refused with EAGAIN (the listener's queue is full) is retried this often


class Rpc(Protocol):
    """What a transport needs of the client: its requests and what the daemon said at hello."""

    server_info: dict

    def call(self, op: str, **args: Any) -> Any: ...

    def send(self, op: str, **args: Any) -> int: ...

    def wait(self, msgid: int) -> Any: ...

    def block_bytes_of(self, ns_id: str) -> int | None: ...


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


class ArenaTransport:
    """A local client's transport: the Unix socket and the mapped arena."""

    def __init__(self, socket_path: str, copy_threads: int = 2) -> None:
        if not isinstance(copy_threads, int) or copy_threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        self.socket_path, self.copy_threads = socket_path, copy_threads
        self.pool: ThreadPoolExecutor | None = None  # the copy threads, started by the first large batch
        self._arena: np.ndarray | None = None
        self._arena_id: str | None = None
        self._daemon_uid: int | None = None  # from SO_PEERCRED: who must own the arena
        self._pools: list | None = None  # the GPU pools as this process mapped them, per device slot

    @property
    def where(self) -> str:
        return self.socket_path

    def open(self, timeout_s: float) -> socket.socket:
        """Connect within `timeout_s`. A Unix connect with a timeout fails at once with EAGAIN while the
        daemon's listen queue is full (a storm of engine workers starting together): retried until then."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout_s)
                sock.connect(self.socket_path)
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() + CONNECT_RETRY_S > deadline:
                    raise
                time.sleep(CONNECT_RETRY_S)
            except OSError:
                sock.close()
                raise

    def greet(self, sock: socket.socket) -> None:
        """Before hello: the daemon must be ours (or root's)."""
        self._daemon_uid = daemon_uid(sock, self.socket_path)

    def welcomed(self, info: dict) -> None:
        """After hello: a (re)started daemon has a new arena: map it, never keep writing into the old one."""
        if info.get("arena_id") == self._arena_id:
            return
        self._pools = None  # a new daemon: its pools too are new
        try:
            self._arena = map_arena(info["arena_path"], info["arena_bytes"], owner_uid=self._daemon_uid)
        except ArenaRefused as exc:
            raise OwnershipError(str(exc)) from None
        self._arena_id = info.get("arena_id")

    @property
    def arena(self) -> np.ndarray:
        if self._arena is None:
            raise KVStoreError("no arena: the client is not connected")
        return self._arena

    def pools(self, handles: list[dict]) -> list:
        """The daemon's GPU pools mapped here, once per daemon (kvstore.tiers.gpu.open_pool: a CUDA tensor by IPC, or
        the emulated pool's shared memory, mapped only if the daemon's user owns it)."""
        if self._pools is None:
            from kvstore.tiers.gpu import open_pool  # imports torch only for CUDA handles

            try:
                self._pools = [open_pool(h, self._daemon_uid) for h in handles]
            except ArenaRefused as exc:
                raise OwnershipError(str(exc)) from None
        return self._pools

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    # -- payloads ---------------------------------------------------------------------------
    def put(self, rpc: Rpc, ns_id: str, blocks: Sequence[Block], chunk: int) -> int:
        chunks = [blocks[i : i + chunk] for i in range(0, len(blocks), chunk)]
        commits: list[int] = []
        send_reserve = lambda part: rpc.send("reserve", ns=ns_id, blocks=[[h, p] for h, p, _ in part])  # noqa: E731
        next_reserve = send_reserve(chunks[0]) if chunks else None
        for k, part in enumerate(chunks):
            slots = rpc.wait(next_reserve)["extents"]
            ahead = None  # the next chunk's reserve, in flight during this chunk's copy
            if k + 1 < len(chunks):
                next_reserve = ahead = send_reserve(chunks[k + 1])
            mine = [(extents, h, data) for extents, (h, _, data) in zip(slots, part) if extents is not None]
            written = [h for _, h, _ in mine]
            try:
                self._copy_batch(copy_in_many, [ext for ext, _, _ in mine], [data for _, _, data in mine])
            except BaseException:
                if ahead is not None:  # first: its blocks may be reserved under this chunk's
                    _undo_ahead(rpc, ahead, "abort", ns_id, [h for h, _, _ in chunks[k + 1]])
                rpc.call("abort", ns=ns_id, hashes=written)
                raise
            if written:
                commits.append(rpc.send("commit", ns=ns_id, hashes=written))
        return sum(rpc.wait(m)["committed"] for m in commits)

    def get_into(self, rpc: Rpc, ns_id: str, hashes: Sequence[bytes], outs: Sequence, chunk: int) -> list[bool]:
        parts = [list(range(i, min(i + chunk, len(hashes)))) for i in range(0, len(hashes), chunk)]
        found = [False] * len(hashes)
        releases: list[int] = []
        send_acquire = lambda idx: rpc.send("acquire", ns=ns_id, hashes=[hashes[i] for i in idx], prefix=False)  # noqa: E731
        next_acquire = send_acquire(parts[0]) if parts else None
        for k, idx in enumerate(parts):
            extents = rpc.wait(next_acquire)["extents"]
            ahead = None  # the next chunk's acquire, in flight during this chunk's copy
            if k + 1 < len(parts):
                next_acquire = ahead = send_acquire(parts[k + 1])
            mine = [(i, ext) for i, ext in zip(idx, extents) if ext is not None]
            held = [hashes[i] for i, _ in mine]  # all pinned by the acquire: release them whatever happens
            try:
                self._copy_batch(copy_out_many, [ext for _, ext in mine], [outs[i] for i, _ in mine])
            except BaseException:
                if ahead is not None:
                    _undo_ahead(rpc, ahead, "release", ns_id, [hashes[i] for i in parts[k + 1]])
                raise
            finally:
                if held:
                    releases.append(rpc.send("release", ns=ns_id, hashes=held))
            for i, _ in mine:
                found[i] = True
        for m in releases:
            rpc.wait(m)
        return found

    def get(self, rpc: Rpc, ns_id: str, hashes: Sequence[bytes]) -> list[np.ndarray | None]:
        extents = rpc.call("acquire", ns=ns_id, hashes=list(hashes), prefix=False)["extents"]
        try:
            return [None if ext is None else copy_out(self.arena, ext) for ext in extents]
        finally:
            held = [h for h, ext in zip(hashes, extents) if ext is not None]
            if held:
                rpc.call("release", ns=ns_id, hashes=held)

    def _copy_batch(self, copy_many: Callable, extents: list, bufs: list) -> None:
        """`copy_many(arena, extents, bufs)` (tiers/arena.py: copy_in_many, copy_out_many); split over
        the copy threads when the batch is large.

        Waits for every thread before raising the first failure, so nothing is
        still writing when the caller aborts or releases the blocks.
        """
        k = min(self.copy_threads, len(extents))
        if k > 1:
            nbytes = sum(length for ext in extents for _, length in ext)
            if nbytes < PARALLEL_COPY_MIN_BYTES or nbytes < PARALLEL_COPY_MIN_BLOCK_BYTES * len(extents):
                k = 1
        if k <= 1:
            copy_many(self.arena, extents, bufs)
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="kvstore-copy")
        arena = self.arena
        futures = [self.pool.submit(copy_many, arena, extents[j::k], bufs[j::k]) for j in range(k)]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None:
                raise exc


def _undo_ahead(rpc: Rpc, msgid: int, undo: str, ns_id: str, hashes: Sequence[bytes]) -> None:
    """A copy failed while the next chunk's reserve/acquire was in flight: take its answer and
    abort/release what it granted, so no reservation or pin outlives the call."""
    try:
        extents = rpc.wait(msgid)["extents"]
        granted = [h for h, ext in zip(hashes, extents) if ext is not None]
        if granted:
            rpc.call(undo, ns=ns_id, hashes=granted)
    except KVStoreError:
        pass  # daemon gone or refused: its lease expiry releases them


class InlineTransport:
    """A remote client's transport: TCP, payloads inline in frames under the daemon's limit."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def open(self, timeout_s: float) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def greet(self, sock: socket.socket) -> None:
        pass  # the token at hello is the check

    def welcomed(self, info: dict) -> None:
        pass

    @property
    def arena(self) -> np.ndarray:
        raise KVStoreError("no arena: remote (TCP) clients use put/get")

    def close(self) -> None:
        pass

    # -- payloads ---------------------------------------------------------------------------
    def put(self, rpc: Rpc, ns_id: str, blocks: Sequence[Block], chunk: int) -> int:
        if not blocks:
            return 0
        per = _blocks_per_frame(rpc, max(memoryview(data).nbytes for _, _, data in blocks), len(blocks))
        stored = 0
        for i in range(0, len(blocks), per):
            wire = [[h, p, bytes(memoryview(data).cast("B"))] for h, p, data in blocks[i : i + per]]
            stored += rpc.call("put", ns=ns_id, blocks=wire)["stored"]
        return stored

    def get(self, rpc: Rpc, ns_id: str, hashes: Sequence[bytes]) -> list[np.ndarray | None]:
        block_bytes = rpc.block_bytes_of(ns_id)
        per = len(hashes) if block_bytes is None else _blocks_per_frame(rpc, block_bytes, len(hashes))
        out: list[np.ndarray | None] = []
        for i in range(0, len(hashes), max(per, 1)):
            payloads = rpc.call("get", ns=ns_id, hashes=list(hashes[i : i + per]))["payloads"]
            out += [None if p is None else np.frombuffer(p, np.uint8) for p in payloads]
        return out

    def get_into(self, rpc: Rpc, ns_id: str, hashes: Sequence[bytes], outs: Sequence, chunk: int) -> list[bool]:
        found = []
        for data, out in zip(self.get(rpc, ns_id, hashes), outs):
            if data is not None:
                np.frombuffer(out, np.uint8)[:] = data  # type: ignore[call-overload]
            found.append(data is not None)
        return found


def _blocks_per_frame(rpc: Rpc, block_bytes: int, wanted: int) -> int:
    max_frame = rpc.server_info.get("max_frame_bytes")
    per = wanted if max_frame is None else inline_blocks_per_frame(max_frame, block_bytes)
    if per == 0:
        raise ProtocolError(f"a block of {block_bytes} B does not fit in the daemon's frame limit of {max_frame} B "
                            "(server.max_frame): raise it to send such blocks over TCP")
    return max(1, min(per, rpc.server_info.get("max_batch_blocks") or per))
