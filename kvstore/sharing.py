"""Sharing through the remote tier: what the store asks the cluster, what it publishes, and how
remote blocks reach the arena. The asynchronous half of tiers/remote.py (a part of TieredStore,
`store.sharing`; None without a remote tier).

Lookups. Before the daemon answers a `lookup` or an `acquire`, `extend` asks
the cluster about the blocks that follow the local prefix hit, in one batched
existence query, and indexes the leading ones found as *remote entries*
(tier "remote": committed, no local bytes, their location a `RemoteRef`). The
store then counts them as hits in tier "remote", and `prepare_read` promotes
them like disk blocks: `promote` allocates host pages root first, fetches the
whole batch in one call straight into them, verifies each block (header names
this namespace, hash, parent and length; xxh3 of the payload) and re-tiers it
once its parent sits in host or faster. A block that does not verify, or that
the cluster evicted since the query, is a miss: it is discarded with its
subtree (other readers' pins become ghost pins), never served, and for
BAD_VALUE_TTL_S lookups stop before it instead of fetching it again.

Publishing (write-behind; a client's commit never waits on the network). The
config's `publish` policy picks what is sent:
- "committed": every block committed into the host arena;
- "evicted": a block when it leaves the host arena (demoted to disk or
  dropped); its bytes are copied into a registered staging buffer at that
  moment, since its pages are reused at once;
- "hit": a block the first time a client's acquire hits it locally (chains
  that proved reusable);
- "none": this host only reads.
Publishing pins the blocks of one batch (owner `PUBLISHER`) while Mooncake
reads them out of the arena. The queue holds at most `queue_blocks`; past that
blocks are not published (counted `remote_publish_dropped_backlog`).

Faults. Each kind of cluster call (query, get, put) has its own daemon thread,
so a slow put never delays a lookup and a hung call never holds up exit. Every
call is bounded: `timeout_s` for queries, `transfer_timeout_s` for transfers.
A call that timed out keeps its thread until Mooncake returns; until then calls
of that kind fail at once instead of queueing behind it. Failures are counted
per op (`errors`, exported as kvstore_remote_errors_total{op}) and answered as
misses; local tiers keep serving. Mooncake's client reconnects to a restarted
master by itself (the objects the master forgot are then misses).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

from kvstore.entry import RANK, Entry, Key, link_child
from kvstore.errors import CapacityError
from tiers.host import copy_segments
from tiers.pages import PageAllocator
from tiers.remote import ALREADY_EXISTS, RemoteRef, RemoteUnavailable, object_key

if TYPE_CHECKING:
    from kvstore.store import TieredStore
    from tiers.remote import MooncakeTier

log = logging.getLogger(__name__)

PUBLISHER = ("kvstore-remote-publisher",)  # the owner of the pins publishing holds
PUBLISH_POLICIES = ("committed", "evicted", "hit", "none")
OPS = ("query", "get", "put")
BAD_VALUE_TTL_S = 60.0  # a value that did not verify is not fetched again for this long (it may be re-published)


class _Worker:
    """One daemon thread running submitted calls in order (a hung call never blocks interpreter exit,
    as a ThreadPoolExecutor's would)."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(exc)

    def stop(self) -> None:
        self._q.put(None)


class RemoteSharing:
    def __init__(self, store: "TieredStore", tier: "MooncakeTier", publish: str = "committed",
                 timeout_s: float = 2.0, transfer_timeout_s: float = 30.0, queue_blocks: int = 4096,
                 batch_blocks: int = 64, staging_bytes: int = 64 << 20) -> None:
        if publish not in PUBLISH_POLICIES:
            raise ValueError(f"publish must be one of {PUBLISH_POLICIES}, got {publish!r}")
        self.store, self.tier, self.publish = store, tier, publish
        self.timeout_s, self.transfer_timeout_s = timeout_s, transfer_timeout_s
        self.queue_blocks, self.batch_blocks = queue_blocks, batch_blocks
        self.errors: Counter = Counter()
        self.last_error = ""
        self._workers = {op: _Worker(f"kvstore-remote-{op}") for op in OPS}
        self._stuck: dict[str, concurrent.futures.Future] = {}
        self._pending: OrderedDict[Key, object] = OrderedDict()  # key -> None (from the arena) or staging extents
        self._published: OrderedDict[Key, None] = OrderedDict()  # "hit": what was sent already (bounded)
        self._bad: OrderedDict[Key, float] = OrderedDict()  # blocks whose value did not verify -> until when
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._staging: PageAllocator | None = None
        self._staging_bytes = staging_bytes
        self._idle: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the publisher (on the daemon's loop)."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = asyncio.ensure_future(self._publisher())

    async def stop(self, drain_s: float = 5.0) -> None:
        """Publish what is queued (bounded by `drain_s`), then stop the publisher and the threads."""
        if self._task is not None:
            if self._pending and self._idle is not None:
                assert self._wake is not None
                self._wake.set()
                try:
                    await asyncio.wait_for(self._drained(), drain_s)
                except asyncio.TimeoutError:
                    log.warning("remote tier: %d blocks not published at shutdown", len(self._pending))
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for w in self._workers.values():
            w.stop()

    async def _drained(self) -> None:
        while self._pending or not self._idle.is_set():  # type: ignore[union-attr]
            await asyncio.sleep(0.01)

    # -- calls into the cluster ------------------------------------------------------
    async def call(self, op: str, fn: Callable, *args):
        stuck = self._stuck.get(op)
        if stuck is not None:
            if not stuck.done():
                self.errors[op] += 1
                raise RemoteUnavailable(f"an earlier remote {op} is still waiting on the cluster")
            del self._stuck[op]
        fut = self._workers[op].submit(fn, *args)
        timeout = self.timeout_s if op == "query" else self.transfer_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
        except asyncio.TimeoutError:
            self._stuck[op] = fut
            self._fail(op, f"remote {op} timed out after {timeout} s")
        except Exception as exc:  # noqa: BLE001 - any Mooncake failure is a miss, never a crash
            self._fail(op, f"remote {op} failed: {type(exc).__name__}: {exc}")

    def _fail(self, op: str, message: str):
        self.errors[op] += 1
        if message != self.last_error:
            log.warning("%s", message)
        self.last_error = message
        raise RemoteUnavailable(message)

    def _count_codes(self, op: str, codes: Sequence[int]) -> None:
        bad = [c for c in codes if c < 0 and c != ALREADY_EXISTS]
        if bad:
            self.errors[op] += 1
            self.last_error = f"remote {op}: Mooncake error {bad[0]}"

    # -- lookups -----------------------------------------------------------------------
    async def extend(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Index the blocks that follow the local prefix of `hashes` and that the cluster holds.
        Returns how many remote entries were added."""
        store = self.store
        entries = store.entries
        k = 0
        while k < len(hashes) and (e := entries.get((ns_id, hashes[k]))) is not None and e.committed:
            k += 1
        if k == len(hashes) or (ns_id, hashes[k]) in entries:  # all local, or a local write in flight
            return 0
        want = list(hashes[k:])
        try:
            found = await self.call("query", self.tier.exists, [object_key(ns_id, h) for h in want])
        except RemoteUnavailable:
            return 0
        self._count_codes("query", found)
        n = 0
        while n < len(found) and found[n] == 1 and not self._known_bad(ns_id, want[n]):
            n += 1
        store.counters["remote_lookup_blocks"] += len(want)
        store.counters["remote_lookup_hit_blocks"] += n
        return self._index(ns_id, hashes, k, n)

    def _known_bad(self, ns_id: str, h: bytes) -> bool:
        """The cluster's value for this block failed to verify recently: a miss without asking again."""
        until = self._bad.get((ns_id, h))
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._bad[(ns_id, h)]
        return False

    def _index(self, ns_id: str, hashes: Sequence[bytes], k: int, n: int) -> int:
        """Add remote entries for hashes[k:k+n] under the (re-checked) local prefix."""
        store, entries = self.store, self.store.entries
        ns = store.namespace(ns_id)
        parent: Key | None = (ns_id, hashes[k - 1]) if k else None
        if parent is not None and (parent not in entries or not entries[parent].committed):
            return 0  # the prefix changed while the cluster answered
        added = 0
        for h in hashes[k : k + n]:
            key = (ns_id, h)
            e = entries.get(key)
            if e is not None:
                if not e.committed:
                    break
                parent = key
                continue
            try:
                store.allocate("remote", ns.block_bytes, protect=parent)
            except CapacityError:
                break
            pe = entries.get(parent) if parent is not None else None
            if parent is not None and pe is None:
                self.tier.free(None)
                break
            ref = RemoteRef(object_key(ns_id, h), ns_id, h, parent[1] if parent is not None else None)
            entry = Entry(key, parent, pe.depth + 1 if pe is not None else 0, ns.block_bytes, "remote", ref, None,
                          committed=True)
            entries[key] = entry
            if pe is not None:
                pe.children[RANK["remote"]] += 1
                link_child(pe, key)
            store.policies["remote"].on_insert(store.info(entry))
            if store.events is not None:
                store.events.stored(entry, "remote")  # known to be in the cluster (kvstore/block_events.py)
            parent = key
            added += 1
        return added

    # -- promotion into the arena -----------------------------------------------------
    async def promote(self, batch: list[Entry]) -> dict[Key, bool]:
        """Bring remote entries into host pages in one cluster call (root first); key -> served."""
        store = self.store
        try:
            return await self._promote(batch)
        finally:
            for e in batch:
                store._promoting.pop(e.key, None)
                held = store._inflight.pop(e.key, None)
                if held is not None:
                    store.tiers[held[0]].free(held[1])

    async def _promote(self, batch: list[Entry]) -> dict[Key, bool]:
        store, host = self.store, self.store.host
        result: dict[Key, bool] = {e.key: False for e in batch}
        todo: list[tuple[Entry, object]] = []
        for e in sorted(batch, key=lambda e: e.depth):
            try:
                alloc = store.allocate("host", e.nbytes, protect=e.parent)
            except CapacityError:
                store.counters["promotions_failed_host_full"] += 1
                continue
            if store.entries.get(e.key) is not e or e.tier != "remote":
                host.free(alloc)
                continue
            store._inflight[e.key] = ("host", alloc)
            todo.append((e, alloc))
        if not todo:
            return result
        items = [(e.location, host.segments(alloc)) for e, alloc in todo]
        try:
            codes = await self.call("get", self.tier.get_into, items)
        except RemoteUnavailable:
            codes = [None] * len(todo)
        this = asyncio.current_task()
        for (e, alloc), code in zip(todo, codes):
            parent_task = store._promoting.get(e.parent) if e.parent is not None else None
            if parent_task is not None and parent_task is not this:
                await asyncio.shield(parent_task)  # a parent coming up from disk
            if store.entries.get(e.key) is not e or e.tier != "remote":
                continue  # discarded with an ancestor meanwhile
            if code is not True:
                why = "remote_read_errors" if code is None else "remote_checksum_failures"
                store.counters[why] += 1
                if code is False:
                    self._bad[e.key] = time.monotonic() + BAD_VALUE_TTL_S
                    while len(self._bad) > 65536:
                        self._bad.popitem(last=False)
                    log.warning("remote tier: block %s did not verify (absent, torn or foreign); a miss",
                                e.key[1].hex()[:16])
                store.discard(e)
                continue
            parent = store.entries.get(e.parent) if e.parent is not None else None
            if parent is not None and RANK[parent.tier] > RANK["host"]:
                store.counters[f"promotions_skipped_parent_on_{parent.tier}"] += 1
                continue
            del store._inflight[e.key]
            store.move(e, "host", alloc)
            store.counters["promotions"] += 1
            store.counters["remote_promotions"] += 1
            result[e.key] = True
        return result

    # -- publishing ------------------------------------------------------------------------
    def publishing(self, key: Key) -> bool:
        """A publish is reading this block's host pages now."""
        pins = self.store.pins_by_owner.get(PUBLISHER)
        return bool(pins and pins.get(key))

    def on_commit(self, keys: Sequence[Key]) -> None:
        if self.publish == "committed":
            self._enqueue(keys)

    def on_hit(self, keys: Sequence[Key]) -> None:
        if self.publish == "hit":
            entries = self.store.entries
            self._enqueue([k for k in keys if k not in self._published and entries[k].tier != "remote"])

    def on_evict(self, e: Entry) -> None:
        """`e` is leaving the host arena: copy it out now if the policy publishes evicted blocks."""
        if self.publish != "evicted" or e.tier != "host" or self._task is None or e.key in self._pending:
            return
        if len(self._pending) >= self.queue_blocks:
            self.store.counters["remote_publish_dropped_backlog"] += 1
            return
        if self._staging is None:
            page = self.store.host.page_bytes
            self._staging = PageAllocator(max(1, self._staging_bytes // page), page, label="staging")
            self._staging_buf = self.tier.staging(self._staging.num_pages * page)
        extents = self._staging.allocate(e.nbytes)
        if extents is None:
            self.store.counters["remote_publish_dropped_staging_full"] += 1
            return
        copy_segments([self._staging_buf[o : o + n] for o, n in extents], self.store.host.segments(e.location))
        self._pending[e.key] = (extents, e.parent[1] if e.parent is not None else None)
        self._wake.set()  # type: ignore[union-attr]

    def _enqueue(self, keys: Sequence[Key]) -> None:
        if self._task is None:
            return
        for key in keys:
            if len(self._pending) >= self.queue_blocks:
                self.store.counters["remote_publish_dropped_backlog"] += 1
                continue
            self._pending[key] = None
        if self._pending:
            self._wake.set()  # type: ignore[union-attr]

    async def _publisher(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                self._idle.clear()
                try:
                    await self._publish_batch()
                except Exception:  # noqa: BLE001 - the publisher must outlive any one batch
                    log.exception("remote tier: a publish batch failed")
                finally:
                    self._idle.set()

    async def _publish_batch(self) -> None:
        store = self.store
        batch = [self._pending.popitem(last=False) for _ in range(min(self.batch_blocks, len(self._pending)))]
        items, pinned, staged = [], [], []
        for key, staged_at in batch:
            if staged_at is not None:
                extents, parent = staged_at
                staged.append(extents)
                items.append((RemoteRef(object_key(*key), key[0], key[1], parent),
                              [self._staging_buf[o : o + n] for o, n in extents]))
                continue
            e = store.entries.get(key)
            if e is None or not e.committed or e.tier != "host":
                store.counters["remote_publish_skipped_moved"] += 1
                continue
            e.pins += 1
            store.pins_by_owner[PUBLISHER][key] += 1
            pinned.append(e)
            items.append((RemoteRef(object_key(*key), key[0], key[1], e.parent[1] if e.parent is not None else None),
                          store.host.segments(e.location)))
        if not items:
            return
        try:
            codes = await self.call("put", self.tier.put_from, items)
        except RemoteUnavailable:
            codes = None
        finally:
            for e in pinned:
                store.unpin_failed(e, PUBLISHER)
            for extents in staged:
                self._staging.free(extents)  # type: ignore[union-attr]
        if codes is None:
            store.counters["remote_publish_failed_blocks"] += len(items)
            return
        self._count_codes("put", codes)
        ok = sum(1 for c in codes if c == 0 or c == ALREADY_EXISTS)
        store.counters["remote_published_blocks"] += ok
        store.counters["remote_publish_failed_blocks"] += len(codes) - ok
        if self.publish == "hit":
            for (ref, _), c in zip(items, codes):
                if c == 0 or c == ALREADY_EXISTS:
                    self._published[(ref.ns_id, ref.hash)] = None
            while len(self._published) > 1 << 20:
                self._published.popitem(last=False)

    def stats(self) -> dict:
        return {"publish": self.publish, "pending": len(self._pending), "errors": dict(self.errors),
                "stuck": sorted(op for op, f in self._stuck.items() if not f.done()), "last_error": self.last_error}
