"""The daemon's KV-event publisher: what enters and leaves each tier, in vLLM's format, over ZMQ.

Two halves, so publishing never blocks the store:

- On the event loop, `EventPublisher` is one of the store's listeners
  (kvstore/block_events.py): each call appends one small `RawEvent` to a
  list. `flush()` (the daemon calls it after every request and every
  FLUSH_S) hands that list, as one batch, to a bounded queue. When the queue
  holds `max_queue_events` already, the batch is dropped, counted, and the
  publisher is marked `lost`; the daemon then resyncs once there is room
  (`resync_steps`, a step of blocks per turn of its loop, each step waiting
  for room in the queue): an AllBlocksCleared and a BlockStored for
  everything the store holds, so a router's view is whole again.
- A thread owns the ZMQ sockets: it turns each batch into one KVEventBatch
  per topic (server/event_wire.py), sends `(topic, seq, payload)` on the PUB
  socket with one gapless sequence over all topics, keeps the last
  `buffer_batches` messages, and answers the ROUTER replay socket: a request
  `[identity, b"", start_seq (8 bytes big-endian)]` gets every kept message
  from that seq as `[identity, b"", topic, seq, payload]`, then
  `[identity, b"", b"", seq -1, b""]` (vLLM's ZmqEventPublisher does the same).

Which namespaces are published: TP rank 0 only (a block of a TP engine
exists once per rank; rank 0 stands for them), not a hybrid model's attachments
(an anchored namespace: a router matches prefixes on the spine blocks, whose
hashes the attachments share), and TCP tenants' only with `[events] tenants =
true`: the events carry token ids, and anyone who can reach the endpoint reads them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Iterable, Iterator

from kvstore.config import EventsConfig
from kvstore.entry import Entry
from kvstore.keys import Namespace, key_hash, key_ns
from kvstore.server.event_wire import CLEARED, REMOVED, STORED, RawEvent, encode_batch, group_by_topic

if TYPE_CHECKING:
    from kvstore.store import TieredStore

log = logging.getLogger(__name__)

FLUSH_S = 0.05  # the daemon's periodic flush (events of background promotions, admin clears)
RESYNC_STEP_BLOCKS = 4096  # blocks a resync reports between two turns of the daemon's loop (`resync_steps`)
WAIT_S = 0.05  # the thread's wait for a batch; also how often it looks at the replay socket
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    def __init__(self, config: EventsConfig, namespaces: dict[str, Namespace], host: str | None = None) -> None:
        self.config = config
        self._namespaces = namespaces  # the store's: read when a namespace is first seen
        self._host = host or socket.gethostname()
        self._topics: dict[str, bytes | None] = {}  # ns id -> topic, or None: not published
        self._lock = threading.Lock()  # the store reports from the loop, and from an executor at close
        self._pending: list[RawEvent] = []
        self._queue: deque[list[RawEvent]] = deque()
        self._queued_events = 0
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.lost = False
        self.counts: Counter = Counter()
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None

    # -- the store's sink (event loop) -----------------------------------------------------
    def _topic(self, ns_id: str) -> bytes | None:
        try:
            return self._topics[ns_id]
        except KeyError:
            ns = self._namespaces.get(ns_id)
            topic = None
            if ns is not None and ns.tp_rank == 0 and not ns.anchor and (not ns.tenant or self.config.tenants):
                topic = self.config.topic.format(host=self._host, model=ns.model, ns=ns_id).encode()
            if ns is not None:
                self._topics[ns_id] = topic
            return topic

    def stored(self, entry: Entry, tier: str) -> None:
        ns_id = key_ns(entry.key)
        topic = self._topic(ns_id)
        if topic is not None:
            ns = self._namespaces[ns_id]
            ev = RawEvent(STORED, topic, ns.block_tokens, key_hash(entry.key),
                          key_hash(entry.parent) if entry.parent else None, entry.tokens, tier)
            with self._lock:
                self._pending.append(ev)

    def removed(self, entry: Entry, tier: str) -> None:
        topic = self._topic(key_ns(entry.key))
        if topic is not None:
            with self._lock:
                self._pending.append(RawEvent(REMOVED, topic, block_hash=key_hash(entry.key), tier=tier))

    def cleared(self, ns_ids: Iterable[str]) -> None:
        topics = dict.fromkeys(t for t in map(self._topic, ns_ids) if t is not None)
        with self._lock:
            self._pending.extend(RawEvent(CLEARED, t) for t in topics)

    def flush(self, force: bool = False) -> None:
        """Hand the pending events to the thread as one batch; dropped (and `lost` set) when the queue
        is full, unless `force`."""
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        with self._wake:
            if not force and self._queued_events + len(batch) > self.config.max_queue_events:
                self.counts["events_dropped"] += len(batch)
                if not self.lost:
                    log.warning("KV events: the publisher is %d events behind; dropping, resync to follow",
                                self._queued_events)
                self.lost = True
                return
            self._queue.append(batch)
            self._queued_events += len(batch)
            self._wake.notify()

    def has_room(self) -> bool:
        return self._queued_events < self.config.max_queue_events // 2

    def resync(self, store: "TieredStore") -> None:
        """After drops: AllBlocksCleared, then BlockStored for every block the store holds, at once."""
        for _ in self.resync_steps(store):
            pass

    def resync_steps(self, store: "TieredStore", step: int = RESYNC_STEP_BLOCKS) -> Iterator[None]:
        """`resync`, `step` blocks of the store at a time: each step's events are handed to the thread as
        a batch, then it yields. The daemon waits between steps until the queue has room again
        (`has_room`) and serves requests meanwhile, so a resync of 10^7 blocks neither stops its loop for
        seconds nor queues 10^7 events at once. What changes meanwhile is reported as it happens, after
        the AllBlocksCleared; the walk reports each block as it finds it then."""
        self.flush(force=True)  # what came since the drop goes first; the snapshot below supersedes it
        self.lost = False
        self.cleared(list(store.shared.namespaces))
        for _ in store.report_steps(step):
            self.flush(force=True)
            yield
        self.flush(force=True)
        self.counts["resyncs"] += 1

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> dict:
        """Bind (or connect) the sockets on the publisher thread; the endpoints they got, for hello."""
        try:
            import zmq  # noqa: F401
        except ImportError:
            raise OSError("[events] needs pyzmq: pip install 'kvstore[tools]'") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self._running = False
            raise OSError(f"KV events: cannot open {self.config.endpoint}: {self._error}")
        log.info("KV events on %s (replay %s), topic %r", self.endpoint, self.replay_endpoint, self.config.topic)
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "token_ids": self.config.token_ids}

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (bounded by `timeout_s`), then close the sockets."""
        self.flush(force=True)
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "queued_events": self._queued_events, "lost": self.lost, **self.counts}

    # -- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            import zmq

            ctx = zmq.Context.instance()
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            if self.config.bind:
                pub.bind(self.config.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.config.endpoint)
                self.endpoint = self.config.endpoint
            replay = None
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:  # a bad or busy address: start() reports it
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _loop(self, pub, replay) -> None:
        seq = 0
        kept: deque[tuple[int, bytes, bytes]] = deque(maxlen=self.config.buffer_batches)
        while True:
            if replay is not None:
                self._serve_replay(replay, kept)
            with self._wake:
                if not self._queue:
                    if not self._running:
                        return
                    self._wake.wait(WAIT_S)
                    continue
                batch = self._queue.popleft()
            try:
                now = time.time()
                for topic, runs in group_by_topic(batch).items():
                    payload = encode_batch(runs, now, self.config.encoding)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    kept.append((seq, topic, payload))
                    seq += 1
                    self.counts["batches"] += 1
                self.counts["events"] += len(batch)
            except Exception:  # never let one bad batch stop the thread
                log.exception("KV events: publishing a batch failed")
                self.counts["publish_errors"] += 1
            finally:
                with self._wake:
                    self._queued_events -= len(batch)

    def _serve_replay(self, replay, kept: deque) -> None:
        import zmq

        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self.counts["replay_bad_requests"] += 1
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, topic, payload in list(kept):
                    if seq >= start_seq:
                        replay.send_multipart((ident, b"", topic, seq.to_bytes(8, "big"), payload))
                replay.send_multipart((ident, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("KV events: replay to a subscriber failed: %s", exc)
            self.counts["replays"] += 1
