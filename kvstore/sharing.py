"""Sharing through the remote tier: what the store asks the cluster, what it publishes, and how
remote blocks' bytes are fetched. The asynchronous half of tiers/remote.py; the store has one
(`store.sharing`) where its chain ends in a remote tier, and subscribes it to its listeners.

Lookups. Before the store answers a `find` or an `acquire`, `extend` asks
the cluster about the blocks that follow the local prefix hit, in one batched
existence query, and indexes the leading ones found as *remote entries*
(tier "remote": committed, no local bytes, their location a `RemoteRef`). The
store then counts them as hits in tier "remote", and the promoter
(kvstore/promotion.py) brings them into the arena with the routine it uses
for disk blocks; `fetch` is the part that differs: the whole batch in one
call straight into the host pages the promoter allocated, each block verified
(header names this namespace, hash, parent and length; xxh3 of the payload).
A namespace whose blocks this daemon publishes compressed (`[compression]
remote = true` and the engine opted in, kvstore/compression.py) is asked for
under both names, the exact block's and the encoded one's, and the exact one
wins where both are there (another host may not compress, and the attention
sink is never compressed); an encoded entry is fetched whole and decoded into
its pages. A block that does not verify, or that the cluster evicted since the
query, is a miss: the promoter discards it with its subtree, and for BAD_VALUE_TTL_S
lookups stop before it instead of fetching it again.

Publishing (write-behind; a client's commit never waits on the network). The
config's `publish` policy picks what is sent:
- "committed": every block committed into the host arena;
- "evicted": a block when it leaves the host arena (demoted to disk or
  dropped); its bytes are copied into a registered staging buffer at that
  moment, since its pages are reused at once;
- "hit": a block the first time a client's acquire hits it locally (chains
  that proved reusable);
- "none": this host only reads.
A block whose namespace compresses on this tier is published encoded, under its
own key (the put thread encodes). Publishing pins the blocks of one batch
(owner `PUBLISHER`) while Mooncake reads them out of the arena; the checksums
taken for their headers become their host index checksums (the hasher skips
them: one pass over the bytes, not two). The queue holds at most
`queue_blocks`; past that blocks are not published (counted
`remote_publish_dropped_backlog`).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from kvstore.config import PUBLISH_POLICIES
from kvstore.entry import Entry, Key, Shared
from kvstore.errors import CapacityError
from kvstore.index import BlockIndex
from kvstore.keys import block_key, key_hash, key_ns, ns_tag
from kvstore.placement import Placement
from kvstore.tiers.host import copy_segments
from kvstore.tiers.pages import PageAllocator
from kvstore.tiers.remote import ALREADY_EXISTS, RemoteRef, RemoteUnavailable, object_key

if TYPE_CHECKING:
    from kvstore.compression import StoredCodec
    from kvstore.keys import Namespace
    from kvstore.tiers.remote import MooncakeTier

log = logging.getLogger(__name__)

PUBLISHER = ("kvstore-remote-publisher",)  # the owner of the pins publishing holds
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


@dataclass(frozen=True)
class SharingOptions:
    """How a daemon shares through the remote tier (the config's [remote] section)."""

    publish: str = "committed"  # one of PUBLISH_POLICIES
    timeout_s: float = 2.0  # a query's bound
    transfer_timeout_s: float = 30.0  # a get's or put's bound
    queue_blocks: int = 4096  # blocks waiting to be published, at most
    batch_blocks: int = 64  # blocks per put
    staging_bytes: int = 64 << 20  # where "evicted" blocks wait for their put

    def __post_init__(self) -> None:
        if self.publish not in PUBLISH_POLICIES:
            raise ValueError(f"publish must be one of {PUBLISH_POLICIES}, got {self.publish!r}")


class RemoteSharing:
    """The store's part that talks to the cluster; a listener of the store (commits, hits, evictions)."""

    def __init__(self, tier: "MooncakeTier", index: BlockIndex, placement: Placement, shared: Shared,
                 options: SharingOptions = SharingOptions()) -> None:
        self.tier, self.index, self.placement = tier, index, placement
        self.host = placement.tiers["host"]
        self.compression = placement.compression  # which namespaces' blocks are published encoded (None: none)
        self.namespaces, self.counters = shared.namespaces, shared.counters
        self.publish = options.publish
        self.timeout_s, self.transfer_timeout_s = options.timeout_s, options.transfer_timeout_s
        self.queue_blocks, self.batch_blocks = options.queue_blocks, options.batch_blocks
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
        self._staging_bytes = options.staging_bytes
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
        index = self.index  # (`committed`: blocks at rest count, not woken)
        tag = ns_tag(ns_id)
        k = 0
        while k < len(hashes) and index.committed(tag + hashes[k]):
            k += 1
        if k == len(hashes) or tag + hashes[k] in index.entries:  # all local, or a local write in flight
            return 0
        want = list(hashes[k:])
        codec = self._codec(self.namespaces[ns_id])
        keys = [object_key(ns_id, h) for h in want]
        if codec is not None:  # asked under both names: [exact, encoded] per block
            keys = [key for h, exact in zip(want, keys) for key in (exact, object_key(ns_id, h, codec.profile.digest))]
        try:
            found = await self.call("query", self.tier.exists, keys)
        except RemoteUnavailable:
            return 0
        self._count_codes("query", found)
        encoded: list[bool] = []  # per block found: whether only its encoded value is there
        for i, h in enumerate(want):
            exact, enc = (found[2 * i], found[2 * i + 1]) if codec is not None else (found[i], 0)
            if (exact != 1 and enc != 1) or self._known_bad(ns_id, h):
                break
            encoded.append(exact != 1)
        self.counters["remote_lookup_blocks"] += len(want)
        self.counters["remote_lookup_hit_blocks"] += len(encoded)
        return self._index(ns_id, hashes, k, encoded, codec)

    def _codec(self, ns: "Namespace") -> "StoredCodec | None":
        """The codec this namespace's blocks are published with (beyond its sink blocks), or None."""
        if self.compression is None or "remote" not in self.compression.tiers:
            return None
        return self.compression.codec(ns)

    def _block_codec(self, e: Entry) -> "StoredCodec | None":
        """The codec `e` is published with, or None (exact)."""
        if self.compression is None:
            return None
        return self.compression.for_block(self.namespaces[key_ns(e.key)], e.depth, "remote")

    def _ref(self, key: Key, parent: bytes | None, codec: "StoredCodec | None") -> RemoteRef:
        ns_id, h = key_ns(key), key_hash(key)
        if codec is None:
            return RemoteRef(object_key(ns_id, h), ns_id, h, parent)
        return RemoteRef(object_key(ns_id, h, codec.profile.digest), ns_id, h, parent, codec.tag,
                         codec.stored_bytes, codec.logical_bytes)

    def _known_bad(self, ns_id: str, h: bytes) -> bool:
        """The cluster's value for this block failed to verify recently: a miss without asking again."""
        until = self._bad.get(block_key(ns_id, h))
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._bad[block_key(ns_id, h)]
        return False

    def _index(self, ns_id: str, hashes: Sequence[bytes], k: int, encoded: list[bool],
               codec: "StoredCodec | None") -> int:
        """Add remote entries for hashes[k:k+len(encoded)] under the (re-checked) local prefix, each
        naming its exact value or (where `encoded` says) its value encoded with `codec`."""
        get = self.index.get  # (a block at rest is woken: kvstore/resting.py)
        ns = self.namespaces[ns_id]
        tag = ns_tag(ns_id)
        parent: Key | None = tag + hashes[k - 1] if k and not ns.anchor else None
        if parent is not None and ((pe := get(parent)) is None or not pe.committed):
            return 0  # the prefix changed while the cluster answered
        added = 0
        for h, enc in zip(hashes[k : k + len(encoded)], encoded):
            key = tag + h
            if ns.anchor:  # an attachment hangs under its anchor's block of the same hash, not under hashes[k-1]
                parent = block_key(ns.anchor, h)
            e = get(key)
            if e is not None:
                if not e.committed:
                    break
                parent = key
                continue
            try:
                self.placement.allocate("remote", ns.block_bytes, protect=parent)
            except CapacityError:
                break
            pe = get(parent) if parent is not None else None
            if parent is not None and (pe is None or not pe.committed):
                self.tier.free(None)
                break
            ref = self._ref(key, key_hash(parent) if parent is not None else None, codec if enc else None)
            if ref.codec is not None:
                self.tier.count_compressed(ref, +1)
            self.placement.insert_in_policy([self.index.adopt(key, pe, "remote", ref)])
            parent = key
            added += 1
        return added

    # -- promotion into the arena: the fetch ----------------------------------------------
    async def fetch(self, items: list[tuple[Entry, object]]) -> list[bool | None]:
        """Remote entries' values into their host pages (kvstore/promotion.py allocated them), one
        cluster call: per block True (verified), False (absent, torn or foreign), None (the call failed)."""
        calls = [(e.location, self.host.segments(alloc)) for e, alloc in items]
        try:
            codes = await self.call("get", self.tier.get_into, calls)
        except RemoteUnavailable:
            return [None] * len(items)
        for (e, _), code in zip(items, codes):
            if code is False:
                self._remember_bad(e.key)
        return list(codes)

    async def fetch_encoded(self, entries: list[Entry]) -> list:
        """Remote entries' encoded values as stored, for the GPU tier's expander (kvstore/gpu_decode.py),
        one cluster call: per block its bytes, False (absent, torn or foreign) or None (the call failed)."""
        try:
            blobs = await self.call("get", self.tier.get_encoded, [e.location for e in entries])
        except RemoteUnavailable:
            return [None] * len(entries)
        for e, blob in zip(entries, blobs):
            if blob is None:
                self._remember_bad(e.key)
        return [False if blob is None else blob for blob in blobs]

    def _remember_bad(self, key: Key) -> None:
        """A value that did not verify is not fetched again for a while (it may be re-published)."""
        self._bad[key] = time.monotonic() + BAD_VALUE_TTL_S
        while len(self._bad) > 65536:
            self._bad.popitem(last=False)

    # -- publishing ------------------------------------------------------------------------
    def publishing(self, key: Key) -> bool:
        """A publish is reading this block's host pages now."""
        return self.index.pinned_by(PUBLISHER, key)

    def committed(self, entries: Sequence[Entry]) -> None:
        if self.publish == "committed":
            self._enqueue([e.key for e in entries])

    def hit(self, entries: Sequence[Entry]) -> None:
        if self.publish == "hit":
            self._enqueue([e.key for e in entries if e.key not in self._published and e.tier != "remote"])

    def evicting(self, e: Entry) -> None:
        """`e` is leaving the host arena: copy it out now if the policy publishes evicted blocks."""
        if self.publish != "evicted" or e.tier != "host" or self._task is None or e.key in self._pending:
            return
        if len(self._pending) >= self.queue_blocks:
            self.counters["remote_publish_dropped_backlog"] += 1
            return
        if self._staging is None:
            page = self.host.page_bytes
            self._staging = PageAllocator(max(1, self._staging_bytes // page), page, label="staging")
            self._staging_buf = self.tier.staging(self._staging.num_pages * page)
        extents = self._staging.allocate(e.nbytes)
        if extents is None:
            self.counters["remote_publish_dropped_staging_full"] += 1
            return
        copy_segments([self._staging_buf[o : o + n] for o, n in extents], self.host.segments(e.location))
        self._pending[e.key] = (extents, key_hash(e.parent) if e.parent is not None else None, self._block_codec(e))
        self._wake.set()  # type: ignore[union-attr]

    def _enqueue(self, keys: Sequence[Key]) -> None:
        if self._task is None:
            return
        for key in keys:
            if len(self._pending) >= self.queue_blocks:
                self.counters["remote_publish_dropped_backlog"] += 1
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
        batch = [self._pending.popitem(last=False) for _ in range(min(self.batch_blocks, len(self._pending)))]
        items, pinned, staged = [], [], []
        sources: list[Entry | None] = []  # per item: the host block it is read from (None: the staging buffer)
        for key, staged_at in batch:
            if staged_at is not None:
                extents, parent, codec = staged_at
                staged.append(extents)
                items.append((self._ref(key, parent, codec), [self._staging_buf[o : o + n] for o, n in extents], codec))
                sources.append(None)
                continue
            e = self.index.get(key)
            if e is None or not e.committed or e.tier != "host":
                self.counters["remote_publish_skipped_moved"] += 1
                continue
            self.index.pin([e], PUBLISHER)
            pinned.append(e)
            codec = self._block_codec(e)
            items.append((self._ref(key, key_hash(e.parent) if e.parent is not None else None, codec),
                          self.host.segments(e.location), codec))
            sources.append(e)
        if not items:
            return
        sums: list = []  # each exact block's xxh3, taken for its header: the host index need not take it again
        self.host.busy()  # the host index's hasher waits meanwhile: these blocks are hashed here
        try:
            codes = await self.call("put", self.tier.put_from, items, sums)
        except RemoteUnavailable:
            codes = None
        finally:
            if len(sums) == len(items):  # (the put ran to the end)
                for e, x in zip(sources, sums):
                    if e is not None and x is not None:
                        self.host.offer_checksum(e.location, e.key, x)
            self.host.busy()
            for e in pinned:
                self.index.unpin_failed(e, PUBLISHER)
            for extents in staged:
                self._staging.free(extents)  # type: ignore[union-attr]
        if codes is None:
            self.counters["remote_publish_failed_blocks"] += len(items)
            return
        self._count_codes("put", codes)
        ok = sum(1 for c in codes if c == 0 or c == ALREADY_EXISTS)
        self.counters["remote_published_blocks"] += ok
        for (ref, _, _), c in zip(items, codes):
            if ref.codec is not None and (c == 0 or c == ALREADY_EXISTS):
                self.counters["remote_published_compressed_blocks"] += 1
                self.counters["remote_published_compressed_saved_bytes"] += ref.logical - ref.stored
        self.counters["remote_publish_failed_blocks"] += len(codes) - ok
        if self.publish == "hit":
            for (ref, _, _), c in zip(items, codes):
                if c == 0 or c == ALREADY_EXISTS:
                    self._published[(ref.ns_id, ref.hash)] = None
            while len(self._published) > 1 << 20:
                self._published.popitem(last=False)

    def stats(self) -> dict:
        return {"publish": self.publish, "pending": len(self._pending), "errors": dict(self.errors),
                "stuck": sorted(op for op, f in self._stuck.items() if not f.done()), "last_error": self.last_error}
