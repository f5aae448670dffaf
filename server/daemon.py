"""The daemon: one asyncio process serving the data plane and the admin plane.

Data plane: length-prefixed msgpack RPC (kvstore/protocol.py) over a Unix
socket (mode 0600, local clients, payloads through the shared arena) and,
optionally, TCP (remote clients, payloads inline, a scoped token required:
server/auth.py). Each connection is a session; its pins and reservations are
leases that die with the connection. A frame larger than `max_frame_bytes` gets
an error reply naming the limit and the connection is closed (the stream cannot
be resynchronised); what arrives of a body up to DISCARD_FACTOR times the limit
is read and dropped first, so a client still sending reads that reply rather than
a reset — bounded in time (server/frames.py: a peer that sends no body is closed
after DISCARD_IDLE_S). Any other bad request gets an error reply and the
connection stays usable.

A TCP peer that has not authenticated costs a socket and a read buffer, so until
its hello succeeds: its frames may be at most `tcp_hello_max_frame_bytes` (a
longer one is answered and closed, its body never read); it has
`tcp_hello_timeout_s` to authenticate; at most `tcp_max_unauthenticated` such
peers are kept (more are closed on accept); and its first request must be a
good hello, else it is answered after AUTH_FAIL_DELAY_S and closed (a token
guess costs a connection and the delay). Each refusal is counted in `errors`
(stats and /metrics): tcp_hello_frame_too_large, tcp_hello_timeout,
tcp_unauthenticated_cap, tcp_auth_failed.

Startup refuses a socket folder that is not the daemon's own or that others may
write, then takes the instance lock and writes the admin token there
(server/instance.py); the arena in /dev/shm is never followed or reused if
another user put something at its path (tiers/host.py).

KV events (off unless `[events] endpoint` is set; server/events.py): the
store reports blocks entering and leaving tiers to an `EventPublisher`, which
the daemon flushes after every request (one KVEventBatch per request, as vLLM
sends one per engine step) and every FLUSH_S; a thread publishes them. At
start routers get AllBlocksCleared and the blocks the store recovered; hello
tells clients the endpoints and whether to send token ids with commits.

SIGTERM/SIGINT drain: listeners close, requests in progress finish (new ones are
answered with ShuttingDown), the daemon closes every connection itself, the store
is closed (lower tiers flush; the host arena's pending placement records are
written), the socket, admin token and lock are removed, exit 0. The arena and
its index stay in /dev/shm for the next start to re-adopt (with
`host.persistent = false` the arena is removed, and the host tier is written
down to the disk tier first).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections import Counter

from kvstore.chain import open_store
from kvstore.config import Config, event_loop_of
from kvstore.errors import KVStoreError, ProtocolError, ShuttingDown
from kvstore.promotion import PRESENT_MISS
from kvstore.protocol import HEADER, pack_frame, parse_request, unpack_body
from kvstore.store import TieredStore
from kvstore.server.events import FLUSH_S, EventPublisher
from kvstore.server.frames import Oversize, discard, read_frame
from kvstore.tokens import read_token_file
from kvstore.server.instance import create_admin_token, ensure_private_dir, lock_instance, unlink_quietly
from kvstore.server.rpc import Handlers, Session, error_reply
from kvstore.server.stalls import LoopStalls

log = logging.getLogger(__name__)

DRAIN_S = 10.0  # requests in progress at SIGTERM get this long to finish
CLOSE_S = 5.0  # then connections and listeners get this long to close
DISCARD_FACTOR = 4  # an authenticated peer's oversize frame up to this many limits is drained before closing
LISTEN_BACKLOG = 4096  # pending connects the listeners queue (the kernel caps it at net.core.somaxconn):
# asyncio's default of 100 made local connects fail with EAGAIN when many engine workers started together
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (CPython's default: 700); see tune_gc
GC_NO_FULL = 1 << 30  # middle collections before a full one: never reached, no full collection runs (tune_gc)
# A young collection at least this often while serving (`YoungCollections`): it walks what was allocated
# since the last one, so its pause is bounded by the loop's time, not by how many of those objects died.
GC_YOUNG_EVERY_S = 0.02
AUTH_FAIL_DELAY_S = 0.2  # a failed TCP hello is answered this late: with the cap, guesses/s <= cap / delay
# How long a thread holds the GIL before one waiting for it asks for it (CPython's default: 5 ms). Each LMDB
# call lets the GIL go, and a thread making short calls that do the same (a checksum, a cursor's next record)
# takes it back at once: the loop then waited the whole interval at each of its calls, 355 ms for a
# transaction of 512 deletions (tools/bench/bench_gil.py; 43 ms at 0.5 ms). The daemon's own threads also
# let it go every few items; this bounds what any other does.
SWITCH_INTERVAL_S = 0.0005


def _socket_answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def present_misses(counters: dict) -> dict[str, int]:
    """Present (committed) blocks that reads answered as misses, by reason (kvstore/promotion.py)."""
    return {k[len(PRESENT_MISS):]: n for k, n in counters.items() if k.startswith(PRESENT_MISS)}


def gpu_info(store: TieredStore) -> dict:
    """The gpu tier as clients and stats see it now (the per-connection pool handles are added at hello)."""
    if store.gpu is None:
        return {"available": False, "reason": store.absent.get("gpu", "not configured")}
    from kvstore.tiers.gpu import tier_status

    return tier_status(store.gpu)  # type: ignore[arg-type]


class Daemon:
    def __init__(self, config: Config, store: TieredStore | None = None) -> None:
        self.config = config
        ensure_private_dir(os.path.dirname(config.server.socket_path))  # before anything is put in it
        self._lock_fd = lock_instance(config.lock_path, config.name) if store is None else None
        if store is None:
            gc.disable()  # until `tune_gc`: opening the tiers makes objects per block kept and frees none
        self.store = store if store is not None else open_store(config)
        info = {
            "arena_path": self.store.host.path,
            "arena_id": uuid.uuid4().hex,  # clients remap when a restarted daemon has a new arena
            "arena_bytes": self.store.host.capacity_bytes,
            "page_bytes": self.store.host.page_bytes,
            "events": None,  # {endpoint, replay_endpoint, token_ids} once KV events are published
        }
        sc = config.server
        self.handlers = Handlers(self.store, sc.token_scopes, sc.max_batch_blocks, sc.max_frame_bytes, info,
                                 gpu_info=lambda: gpu_info(self.store), stats=self.full_stats)
        self.errors: Counter = Counter()
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self._admin_runner = None
        self.gc_pauses = GcPauses()
        self.tcp_port: int | None = None
        self.admin_port: int | None = None
        self.events = EventPublisher(config.events, self.store.shared.namespaces) if config.events.enabled else None
        self._flusher: asyncio.Task | None = None
        self._resyncing: asyncio.Task | None = None  # a resync of the KV events under way (`_resync_events`)
        self._young: YoungCollections | None = None
        self.stalls: LoopStalls | None = None  # the event loop's stalls, from its ready line on
        self.frozen_at_start = 0  # objects frozen out of the cyclic collector's scans once it served
        self.event_loop = ""  # the loop it serves on, once started (config.event_loop_of)

    def full_stats(self) -> dict:
        """The store's stats with the daemon's sessions, error counts and collector (admin /stats and /metrics, and
        the `stats` request)."""
        stats = self.store.stats()
        stats["sessions"] = len(self.sessions)
        stats["tcp_unauthenticated"] = sum(map(self._unauthenticated, self.sessions.values()))
        stats["errors"] = dict(self.errors)
        stats["present_misses"] = present_misses(stats["counters"])
        stats["gpu"] = gpu_info(self.store)
        stats["ops"] = dict(self.handlers.op_counts)
        stats["event_loop"] = self.event_loop
        stats["switch_interval_s"] = sys.getswitchinterval()
        # (`gc.get_freeze_count()` walks every frozen object: 0.8 s with 10^7 blocks, on the loop. It is
        # read once, when the daemon starts serving.)
        stats["gc"] = {"threshold": list(gc.get_threshold()), "frozen_at_start": self.frozen_at_start,
                       "collections": [g["collections"] for g in gc.get_stats()], "pauses": self.gc_pauses.stats()}
        if self.stalls is not None:
            stats["event_loop_stalls"] = self.stalls.stats()
        if self.events is not None:
            stats["events"] = self.events.stats()
        return stats

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        sc = self.config.server
        self.event_loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
        sock = sc.socket_path
        if os.path.exists(sock):
            if _socket_answers(sock):
                raise OSError(f"another kvstore daemon is serving on {sock}")
            os.unlink(sock)  # a stale socket of a daemon that died
        limit = sc.max_frame_bytes + HEADER.size
        old_umask = os.umask(0o177)
        try:
            self._servers.append(await asyncio.start_unix_server(self._serve_unix, path=sock, limit=limit,
                                                                 backlog=LISTEN_BACKLOG))
        finally:
            os.umask(old_umask)
        if sc.tcp_port is not None:  # (a TCP peer's stream buffers little until it has said hello: `_serve`)
            srv = await asyncio.start_server(self._serve_tcp, sc.tcp_host, sc.tcp_port,
                                             limit=sc.tcp_hello_max_frame_bytes + HEADER.size, backlog=LISTEN_BACKLOG)
            self.tcp_port = srv.sockets[0].getsockname()[1]
            self._servers.append(srv)
        if self.events is not None:
            self._start_events()
        if sc.admin_port is not None:
            from kvstore.server.admin import AdminView, start_admin  # (aiohttp: ~0.14 s of a start without one)

            events = self.events
            resync = self._resync_events if events is not None else None
            token = (read_token_file(sc.admin_token_file, "server.admin_token_file") if sc.admin_token_file
                     else create_admin_token(self.config.admin_token_path))
            view = AdminView(self.store, self.full_stats, token, resync)
            self._admin_runner, self.admin_port = await start_admin(view, sc.admin_host, sc.admin_port)
        self.store.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        log.info(
            "kvstore serving on %s (tcp %s, admin %s, its token in %s); host tier %d MiB at %s, policy %s, "
            "event loop %s", sock, self.tcp_port, self.admin_port, self.config.admin_token_path,
            self.store.host.capacity_bytes >> 20, self.store.host.path, self.config.policy, self.event_loop,
        )

    def _start_events(self) -> None:
        """Open the KV-event sockets and start from the store's state: AllBlocksCleared, then a
        BlockStored for every block it recovered (replayable for routers that connect later)."""
        assert self.events is not None
        self.handlers.info["events"] = self.events.start()
        self.store.add_listener(self.events)
        self.events.cleared(list(self.store.shared.namespaces))
        self.store.report_all()
        self.events.flush(force=True)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_events())

    async def _flush_events(self) -> None:
        """Events of work no request waits for (promotions in flight, admin clears), and resyncs after drops."""
        assert self.events is not None
        while True:
            await asyncio.sleep(FLUSH_S)
            if self.events.lost and self.events.has_room():
                self._resync_events()
            self.events.flush()

    def _resync_events(self) -> None:
        """Start a resync of the KV events (after drops, or a router's request) unless one is under way:
        a step of blocks per turn of the loop, each once the publisher's queue has room again."""
        if self._resyncing is None or self._resyncing.done():
            self._resyncing = asyncio.get_running_loop().create_task(self._resync_steps())

    async def _resync_steps(self) -> None:
        assert self.events is not None
        for _ in self.events.resync_steps(self.store):
            await asyncio.sleep(0)
            while not self.events.has_room():
                await asyncio.sleep(FLUSH_S / 5)

    async def run(self) -> None:
        await self.start()
        tune_gc()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.frozen_at_start = gc.get_freeze_count()  # (what startup made: recovery adopts the rest after)
        gc.callbacks.append(self.gc_pauses)
        self._young = YoungCollections(asyncio.get_running_loop())
        self.stalls = LoopStalls(asyncio.get_running_loop())
        events = self.handlers.info.get("events") or {}
        print(f"kvstore ready socket={self.config.server.socket_path} admin_port={self.admin_port} "
              f"tcp_port={self.tcp_port} events={events.get('endpoint')} "
              f"events_replay={events.get('replay_endpoint')}", flush=True)
        await self._stopped.wait()
        await self.stop()

    async def stop(self) -> None:
        """Drain: refuse new connections and requests, let requests in progress finish (bounded), then
        close every client connection ourselves. Since Python 3.12 `Server.wait_closed` waits for the
        connections too, so an idle engine's connection would otherwise hold the daemon up."""
        log.info("draining")
        self._stopped.set()
        self.store.waits.close()  # waits for in-flight blocks answer now rather than hold the drain
        for srv in self._servers:
            srv.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        while any(s.busy for s in self.sessions.values()) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_S)
        for srv in self._servers:
            try:
                await asyncio.wait_for(srv.wait_closed(), timeout=CLOSE_S)
            except asyncio.TimeoutError:
                log.warning("a listener did not close within %s s; stopping anyway", CLOSE_S)
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            if not self.config.server.admin_token_file:  # (a token file given to the daemon is not its own)
                unlink_quietly(self.config.admin_token_path)
        await self.store.stop()  # what is queued for the remote tier is published (bounded)
        if self._flusher is not None:
            self._flusher.cancel()
        if self._resyncing is not None:
            self._resyncing.cancel()
        if self._young is not None:
            self._young.cancel()
        if self.stalls is not None:
            self.stalls.close()
        await asyncio.get_running_loop().run_in_executor(None, self.store.close)
        if self.events is not None:
            self.events.close()  # after the store's close: blocks persisted at close are reported too
        unlink_quietly(self.config.server.socket_path)
        if self._lock_fd is not None:
            unlink_quietly(self.config.lock_path)  # still held: no other daemon of this name is running
            os.close(self._lock_fd)
        if self.gc_pauses in gc.callbacks:
            gc.callbacks.remove(self.gc_pauses)
        log.info("stopped")

    # -- connections ----------------------------------------------------------
    async def _serve_unix(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, "unix")

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, "tcp")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport: str) -> None:
        if transport == "tcp" and not self._admit_tcp():
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        session = Session(owner=next(self._ids), transport=transport)
        self.sessions[session.owner] = session
        hello_by = asyncio.get_running_loop().time() + self.config.server.tcp_hello_timeout_s
        small_buffer = transport == "tcp"  # until its hello (`_buffer_frames_of`)
        try:
            while not self._stopped.is_set():
                body = await self._next_frame(session, reader, writer, hello_by)
                if body is None:
                    return
                if self._stopped.is_set():  # arrived during the drain: answered, not served
                    writer.write(pack_frame(self._refuse(body)))
                    await writer.drain()
                    return
                session.busy = True
                try:
                    reply = await self._handle(session, body)
                    if self._unauthenticated(session):  # a TCP peer's first request was not a good hello
                        self.errors["tcp_auth_failed"] += 1
                        writer.transport.pause_reading()  # else what it sends during the delay piles up here
                        await asyncio.sleep(AUTH_FAIL_DELAY_S)
                    elif small_buffer:
                        _buffer_frames_of(reader, self.config.server.max_frame_bytes)
                        small_buffer = False
                    writer.write(pack_frame(reply))
                finally:
                    session.busy = False
                    if self.events is not None:
                        self.events.flush()  # one batch per request, like vLLM's one per engine step
                await writer.drain()
                if self._unauthenticated(session):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.store.release_owner(session.owner)
            del self.sessions[session.owner]
            self._tasks.discard(task)
            writer.close()

    @staticmethod
    def _unauthenticated(session: Session) -> bool:
        return session.transport == "tcp" and not session.authed

    def _admit_tcp(self) -> bool:
        """Room for one more TCP peer that has not authenticated yet? Each holds a socket and a buffer."""
        waiting = sum(map(self._unauthenticated, self.sessions.values()))
        if waiting < self.config.server.tcp_max_unauthenticated:
            return True
        self.errors["tcp_unauthenticated_cap"] += 1
        return False

    async def _next_frame(self, session: Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          hello_by: float) -> bytes | None:
        """The next request's body, or None when the connection is to close."""
        sc = self.config.server
        if not self._unauthenticated(session):
            return await self._frame_within(reader, writer, sc.max_frame_bytes, pre_hello=False)
        left = hello_by - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(
                self._frame_within(reader, writer, sc.tcp_hello_max_frame_bytes, pre_hello=True), max(left, 0.0))
        except asyncio.TimeoutError:
            self.errors["tcp_hello_timeout"] += 1
            return None

    async def _frame_within(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int,
                            pre_hello: bool) -> bytes | None:
        got = await read_frame(reader, limit)
        if not isinstance(got, Oversize):
            return got
        self.errors["tcp_hello_frame_too_large" if pre_hello else "ProtocolError"] += 1
        where = "server.tcp_hello_max_frame, before hello" if pre_hello else "server.max_frame"
        err = ProtocolError(f"frame of {got.length} B exceeds the limit of {limit} B ({where})")
        writer.write(pack_frame([0, error_reply(err), None]))
        await writer.drain()
        if not pre_hello and got.length <= DISCARD_FACTOR * limit:
            await discard(reader, got.length)  # its send completes and it reads the reply, not a reset
        return None

    def _refuse(self, body: bytes) -> list:
        try:
            msgid = parse_request(unpack_body(body))[0]
        except KVStoreError:
            msgid = 0
        self.errors["ShuttingDown"] += 1
        return [msgid, error_reply(ShuttingDown("the daemon is shutting down; retry on its successor")), None]

    async def _handle(self, session: Session, body: bytes) -> list:
        msgid = 0
        try:
            msgid, op, args = parse_request(unpack_body(body))
            return [msgid, None, await self.handlers.dispatch(session, op, args)]
        except KVStoreError as exc:
            self.errors[type(exc).__name__] += 1
            return [msgid, error_reply(exc), None]
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error handling a request")
            self.errors["internal"] += 1
            return [msgid, error_reply(exc), None]


def tune_gc() -> None:
    """Once the daemon serves: what startup made (modules, the blocks recovered from the kept arena and
    the disk) is frozen out of the cyclic collector's scans, young collections run every
    GC_GEN0_THRESHOLD allocations instead of 700, what survives one joins the frozen objects, and no full
    collection runs. `untune_gc` undoes it (for a process that goes on: benchmarks, tests).

    The store's per-block objects (entries, the policy's values, the index's records) are freed by
    reference counting; the cyclic collector finds nothing among them, yet at the default threshold it
    ran several young collections per 512-block batch and a full one every few thousand blocks over every
    object the process holds. bench_control_plane, 512-block batches, four runs each way alternating: the
    daemon's CPU per block written into a full tier 27.3-27.8 -> 22.8-23.7 us with the default policy;
    reads unchanged (docs/benchmarks.md, "Control plane"). Cyclic garbage (asyncio's exceptions and
    futures) still goes, at most GC_GEN0_THRESHOLD allocations later. No collection runs first: with
    millions of blocks recovered it would walk every one of their objects before the daemon serves (the
    collector is off from the daemon's start to here: what startup made is kept, not garbage).

    Every collection stops the event loop for as long as it walks its generation (docs/benchmarks.md,
    "Collector pauses"). A full one walks every block's objects: 0.64 s at 10^6 blocks, ~6 s at 10^7,
    each time the survivors of young collections have grown by a quarter (a daemon replacing its blocks:
    every few million blocks written). A middle one walked the survivors of ten young ones: up to 146 ms
    while a daemon replaced its blocks. So the objects that survive a young collection, nearly all of
    them blocks' state, are frozen at once (`_freeze_survivors`: a list splice), and the full threshold is
    past reach (GC_NO_FULL): young collections alone run, over what was allocated since the last one. The
    price: a garbage cycle that lived through a young collection (a few ms) and died later stays until the
    process ends. `GcPauses` shows what the collector costs the daemon."""
    gc.freeze()
    _, gen1, _ = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, GC_NO_FULL)
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)
    gc.enable()


def untune_gc(threshold: tuple[int, ...]) -> None:
    """Undo `tune_gc` in a process that goes on: survivors are no longer frozen, what was frozen is the
    collector's again, and `threshold` (what `gc.get_threshold()` said before) is back."""
    if _freeze_survivors in gc.callbacks:
        gc.callbacks.remove(_freeze_survivors)
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _freeze_survivors(phase: str, info: dict) -> None:
    """A `gc.callbacks` entry: after a young collection, what survived it is frozen (`tune_gc`)."""
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


class YoungCollections:
    """A young collection every `every_s` of the event loop's time (`GC_YOUNG_EVERY_S`), beside those
    CPython starts itself (`tune_gc`).

    CPython starts one when its count of tracked objects, allocations less deallocations, passes the
    threshold, and the collection walks every object allocated since the last one that is still alive. A
    daemon replacing its blocks frees an old block's objects for each new block's: the count barely
    moves, while the new blocks' objects pile up in the young generation, and the collection that came
    at last walked all of them with the event loop stopped (up to 200 ms at 10^5 blocks). On the loop's
    clock the young generation holds only what the daemon allocated in `every_s`: a pause of a few
    milliseconds (docs/benchmarks.md, "Collector pauses"). The price: a block's objects are walked once
    even when it is evicted within seconds, 3-4% of the CPU of full-tier writes. An idle daemon's
    collection finds nearly nothing."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float = GC_YOUNG_EVERY_S) -> None:
        self._loop, self._every_s = loop, every_s
        self._handle = loop.call_later(every_s, self._collect)

    def _collect(self) -> None:
        gc.collect(0)
        self._handle = self._loop.call_later(self._every_s, self._collect)

    def cancel(self) -> None:
        self._handle.cancel()


class GcPauses:
    """The cyclic collector's pauses per generation (young, middle, full): how many, the longest and
    their sum, as `gc.callbacks` sees them (stats()["gc"]["pauses"], and /metrics). A collection holds
    the GIL, so whichever thread it runs in, the event loop waits for it."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.longest_s = [0.0, 0.0, 0.0]
        self.total_s = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        g, took = info["generation"], time.perf_counter() - self._start
        self.count[g] += 1
        self.total_s[g] += took
        if took > self.longest_s[g]:
            self.longest_s[g] = took

    def stats(self) -> list[dict]:
        return [{"collections": n, "longest_ms": round(longest * 1e3, 3), "total_s": round(total, 3)}
                for n, longest, total in zip(self.count, self.longest_s, self.total_s)]


def _buffer_frames_of(reader: asyncio.StreamReader, max_frame_bytes: int) -> None:
    """Let an authenticated TCP peer's stream buffer a whole frame before it pauses reading. Until its
    hello a TCP stream pauses past 2 x server.tcp_hello_max_frame: a peer that never says hello costs a
    few KiB however fast it sends (uvloop reads a fast sender's bytes in as they come; with the
    64 MiB limit two such peers grew the daemon by 17 MiB before it hung up). asyncio.StreamReader
    has no public setter for its limit."""
    reader._limit = max_frame_bytes + HEADER.size  # type: ignore[attr-defined]


def serve(config: Config) -> int:
    """Run a daemon until SIGTERM/SIGINT; the CLI's `serve`. After a clean stop (every tier closed, what
    they hold durable) the process exits at once: the interpreter's teardown would free every block's
    objects one by one, and collect over them first, for seconds per million blocks and nothing."""
    loop = event_loop_of(config.server.event_loop)

    async def main() -> None:
        await Daemon(config).run()

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
