"""Data-plane request handlers: one function per op, over one TieredStore.

A handler validates every argument before it changes anything, so a bad
request gets an error reply and leaves the store as it was. Pins and
reservations are owned by the connection (`Session.owner`); when the
connection goes away the daemon calls `store.release_owner` (lease expiry).

Local (Unix-socket) clients move payloads through the shared arena:
`reserve`/`commit` and `acquire`/`release` return and take extents. Remote
(TCP) clients cannot map the arena: `put` and `get` carry payloads inline.

Every op but hello runs under the session's `Grant` (server/auth.py): a TCP
session may only use the ops, models and tenant its token grants; `blocks`
lists only the namespaces the session may use. A `get` whose reply would not
fit in a frame is refused with the number of blocks that would.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from kvstore.errors import AuthError, KVStoreError, NamespaceError, ProtocolError
from kvstore.waits import MAX_WAIT_S
from kvstore.clearing import remove_steps, run_in_steps
from kvstore.entry import Entry
from kvstore.keys import TAG_BYTES, Namespace, key_hash, key_ns, ns_tag
from kvstore.protocol import (PROTOCOL_VERSION, inline_blocks_per_frame, want, want_blocks, want_floats,
                              want_hashes, want_token_blocks)
from kvstore.store import TieredStore
from kvstore.tokens import TokenScope
from kvstore.server.auth import Grant, authenticate, unix_grant

log = logging.getLogger(__name__)
# A reserve's blocks handled at a time, other requests served between (Handlers.reserve): ~1.5 ms of the
# loop a slice into full tiers over a disk tier (64: ~5 ms, and another engine's lookups waited 3x longer
# at the median; docs/benchmarks.md, "Lookups while the daemon replaces its blocks").
RESERVE_SLICE_BLOCKS = 16
# Blocks a listing (`blocks`) examines between two turns of the loop: ~30 ms of it.
LIST_SLICE_BLOCKS = 65_536


@dataclass
class Session:
    owner: int
    transport: str  # "unix" or "tcp"
    authed: bool = False
    grant: Grant | None = None  # set by a successful hello
    client_name: str = ""
    requests: int = 0
    busy: bool = False
    extra: dict = field(default_factory=dict)


class Handlers:
    def __init__(self, store: TieredStore, scopes: tuple[TokenScope, ...], max_batch: int, max_frame: int,
                 info: dict[str, Any], gpu_info: Callable[[], dict] | None = None,
                 stats: Callable[[], dict] | None = None) -> None:
        """`stats`: what the `stats` request answers (the daemon's: the store's and its own; else the store's)."""
        self.store = store
        self._stats = stats
        self.gpu_info = gpu_info or (lambda: {"available": False, "reason": "not configured"})
        self.scopes = scopes
        self.max_batch = max_batch
        self.max_frame = max_frame
        # static facts for hello: arena path and size, gpu availability, the frame and batch limits
        self.info = {**info, "max_frame_bytes": max_frame, "max_batch_blocks": max_batch}
        self.ops: dict[str, Callable[[Session, dict], Any]] = {
            "hello": self.hello,
            "ping": self.ping,
            "register": self.register,
            "lookup": self.lookup,
            "reserve": self.reserve,
            "commit": self.commit,
            "abort": self.abort,
            "acquire": self.acquire,
            "release": self.release,
            "wait": self.wait,
            "expect": self.expect,
            "withdraw": self.withdraw,
            "put": self.put,
            "get": self.get,
            "stats": self.stats,
            "blocks": self.blocks,
            "remove": self.remove,
            "describe": self.describe,
        }
        self.op_counts: Counter = Counter()  # requests served per op (stats "ops": `kvstore top`)
        self._async_ops = {op for op, fn in self.ops.items() if inspect.iscoroutinefunction(fn)}

    async def dispatch(self, session: Session, op: str, args: dict) -> Any:
        handler = self.ops.get(op)
        if handler is None:
            raise ProtocolError(f"unknown op {op!r}")
        if op != "hello":
            grant = session.grant
            if grant is None:
                raise AuthError("say hello first" if session.transport == "unix" else "authenticate with hello first")
            if not grant.unrestricted:  # (a Unix-socket peer may do everything: server/auth.py)
                self._authorize(grant, op, args)
        session.requests += 1
        self.op_counts[op] += 1
        if op in self._async_ops:
            return await handler(session, args)
        return handler(session, args)

    def _authorize(self, grant: Grant, op: str, args: dict) -> None:
        grant.check_op(op)
        ns = args.get("ns")
        if isinstance(ns, str) and not grant.unrestricted:  # a wrong type is the handler's ProtocolError
            grant.check_namespace(self.store.namespace(ns))

    # -- session --------------------------------------------------------------
    def hello(self, s: Session, args: dict) -> dict:
        token = want(args, "token", str, optional=True)
        tenant = want(args, "tenant", str, optional=True)
        s.client_name = want(args, "client", str, optional=True) or ""
        s.grant = authenticate(self.scopes, token, tenant) if s.transport == "tcp" else unix_grant(tenant)
        s.authed = True
        reply = {"version": PROTOCOL_VERSION, "transport": s.transport, "pid": os.getpid(), **self.info,
                 "gpu": self.gpu_info()}
        if s.transport == "tcp":
            reply.pop("arena_path", None)  # remote clients cannot map it
        elif self.store.gpu is not None:
            reply["gpu"]["pools"] = self._pool_handles()
        return reply

    def _pool_handles(self) -> list | None:
        """A fresh export of every device's pool for this connection (None, with the reason logged, when
        the export fails: the client then reads and writes the arena only)."""
        try:
            return self.store.gpu.handles()  # type: ignore[union-attr]
        except Exception as exc:  # a GPU fault never takes the local service down
            log.warning("gpu pool export failed: %r; clients use the host arena", exc)
            return None

    def ping(self, s: Session, args: dict) -> dict:
        return {"pong": True}

    def register(self, s: Session, args: dict) -> dict:
        assert s.grant is not None  # dispatch saw to it
        raw = s.grant.stamp(want(args, "namespace", dict))
        try:
            ns = Namespace.from_dict(raw)
        except ValueError as exc:
            raise NamespaceError(str(exc)) from None
        s.grant.check_namespace(ns)
        return {"ns": self.store.register_namespace(ns)}

    def stats(self, s: Session, args: dict) -> dict:
        return self._stats() if self._stats is not None else self.store.stats()

    async def blocks(self, s: Session, args: dict) -> dict:
        """A listing for inspection tools: [ns, hash, tier, depth, pins, committed, nbytes] rows, the first
        `limit` of the blocks of the namespaces this session may see (of `ns` only, if given), and `total`,
        how many blocks they hold (committed or reserved). The total is the index's tally, and the rows
        are looked for until `limit` are found: a daemon of 10^7 blocks answers without walking them all,
        and a long search lets other requests in every LIST_SLICE_BLOCKS blocks."""
        ns = want(args, "ns", str, optional=True)
        if ns is not None:
            self.store.namespace(ns)
        limit = want(args, "limit", int, optional=True) or 100
        if not 0 < limit <= 100_000:
            raise ProtocolError("limit must be in 1..100000")
        assert s.grant is not None  # dispatch saw to it
        grant = s.grant
        tags = {ns_tag(ns_id) for ns_id, n in self.store.shared.namespaces.items()
                if (ns is None or ns_id == ns) and (grant.unrestricted or grant.may_use(n))}
        wanted = lambda e: e.key[:TAG_BYTES] in tags  # noqa: E731
        found = await _first_entries(self.store.index.entries, wanted, limit)
        resting = self.store.index.resting  # (then the blocks at rest, read in place: kvstore/resting.py)
        if len(found) < limit and resting is not None and len(resting):
            at_rest = resting.peek_all()
            while len(found) < limit and (some := list(itertools.islice(at_rest, LIST_SLICE_BLOCKS // 16))):
                found += itertools.islice(filter(wanted, some), limit - len(found))
                await asyncio.sleep(0)
        rows = [[key_ns(e.key), key_hash(e.key), e.tier, e.depth, e.pins, e.committed, e.nbytes] for e in found]
        return {"blocks": rows, "total": self.store.index.count_blocks(tags)}

    def describe(self, s: Session, args: dict) -> dict:
        """Per hash, what inspection tools show of the block (None: not stored): tier, pins, hits, ..."""
        ns = want(args, "ns", str)
        return {"blocks": self.store.describe(ns, want_hashes(args, self.max_batch))}

    async def remove(self, s: Session, args: dict) -> dict:
        """Remove blocks and their subtrees (skipping any subtree with a pinned or unfinished block), a
        step of blocks per turn of the loop (kvstore/clearing.py)."""
        ns = want(args, "ns", str)
        return {"removed": await run_in_steps(remove_steps(self.store, ns, want_hashes(args, self.max_batch)))}

    # -- reads ----------------------------------------------------------------
    async def lookup(self, s: Session, args: dict) -> dict:
        ns = want(args, "ns", str)
        hashes = want_hashes(args, self.max_batch)
        res = await self.store.find(ns, hashes)
        return {"hits": res.hits, "tiers": list(res.tiers)}

    async def acquire(self, s: Session, args: dict) -> dict:
        self._local_only(s, "acquire")
        ns = want(args, "ns", str)
        hashes = want_hashes(args, self.max_batch)
        prefix = want(args, "prefix", bool, optional=True)
        inflight = want(args, "inflight", bool, optional=True)
        tier = self._reader_tier(args)
        entries, tiers = await self.store.acquire(ns, hashes, s.owner, prefix=prefix is not False, tier=tier,
                                                  lift=False)
        reply = {"extents": [e.location if e is not None else None for e in entries],
                 "tiers": [t if e is not None else None for e, t in zip(entries, tiers)]}
        if tier != "host":  # where each block is read from now (a GPU engine reads the arena too)
            reply["at"] = [e.tier if e is not None else None for e in entries]
        if inflight:  # how many leading blocks are committed or in flight (a consumer may wait for them)
            reply["inflight"] = self.store.count_in_flight(ns, hashes)
        return reply

    async def wait(self, s: Session, args: dict) -> dict:
        """Wait for reserved or announced blocks to commit (kvstore/waits.py). Pins nothing:
        the caller acquires the `ready` blocks afterwards. Occupies this connection while it waits."""
        ns = want(args, "ns", str)
        hashes = want_hashes(args, self.max_batch)
        timeout_s = want(args, "timeout_s", (int, float))
        if not 0 <= timeout_s <= MAX_WAIT_S:
            raise ProtocolError(f"timeout_s must be in 0..{MAX_WAIT_S:g}")
        appear = want(args, "appear", bool, optional=True) or False
        res = await self.store.wait_committed(ns, hashes, float(timeout_s), appear)
        return {"ready": res.ready, "waited": list(res.waited), "reason": res.reason}

    def expect(self, s: Session, args: dict) -> dict:
        self.store.expect(want(args, "ns", str), want_hashes(args, self.max_batch), s.owner)
        return {}

    def withdraw(self, s: Session, args: dict) -> dict:
        self.store.withdraw(want(args, "ns", str), want_hashes(args, self.max_batch), s.owner)
        return {}

    def release(self, s: Session, args: dict) -> dict:
        self.store.release(want(args, "ns", str), want_hashes(args, self.max_batch), s.owner)
        return {}

    async def get(self, s: Session, args: dict) -> dict:
        ns = want(args, "ns", str)
        hashes = want_hashes(args, self.max_batch)
        block_bytes = self.store.namespace(ns).block_bytes
        fit = inline_blocks_per_frame(self.max_frame, block_bytes)
        if len(hashes) > fit:  # the reply would be a frame over the limit, or a huge allocation
            raise ProtocolError(f"a get of {len(hashes)} blocks of {block_bytes} B would not fit in the frame limit "
                                f"of {self.max_frame} B; ask for at most {fit} blocks per get")
        entries, _ = await self.store.acquire(ns, hashes, s.owner, prefix=False)
        held = [key_hash(e.key) for e in entries if e is not None]
        try:
            payloads = [self.store.host.read(e.location) if e is not None else None for e in entries]
        finally:
            self.store.release(ns, held, s.owner)
        return {"payloads": payloads}

    # -- writes ---------------------------------------------------------------
    async def reserve(self, s: Session, args: dict) -> dict:
        """Extents to write each block into; with `tier="gpu"` (an engine that maps the GPU pools) a block
        goes into the GPU tier where it has free pages, else into the arena: `at` says which.

        The blocks are reserved RESERVE_SLICE_BLOCKS at a time, and other clients' requests are served in
        between (as if this client had sent several reserves): a reserve into a full tier with a disk tier
        below costs ~75 us a block here, so one of 512 blocks held every other engine's lookups ~40 ms."""
        self._local_only(s, "reserve")
        ns = want(args, "ns", str)
        prefer = self._reader_tier(args)
        blocks = want_blocks(args, self.max_batch, with_payload=False)
        entries = await self._reserve_sliced(s, ns, blocks, prefer if prefer != "host" else None)
        reply: dict[str, Any] = {"extents": [e.location if e is not None else None for e in entries]}
        if prefer != "host":
            reply["at"] = [e.tier if e is not None else None for e in entries]
        return reply

    async def _reserve_sliced(self, s: Session, ns: str, blocks: list, into: str | None = None,
                              entries: list | None = None) -> list:
        """`store.reserve` of (hash, parent) `blocks`, RESERVE_SLICE_BLOCKS at a time, other requests served
        between the slices; the entries in order (None where a block was not reserved), appended to
        `entries` as each slice is reserved (so a caller can abort what was reserved before a failure)."""
        entries = [] if entries is None else entries
        for i in range(0, len(blocks), RESERVE_SLICE_BLOCKS):
            if i:  # twice: a request that arrived meanwhile is read in the first turn, handled in the second
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            entries += self.store.reserve(ns, blocks[i : i + RESERVE_SLICE_BLOCKS], s.owner, prefer=into)
        return entries

    def _reader_tier(self, args: dict) -> str:
        """The tier a local client reads and writes besides the arena: "host" (default) or "gpu"."""
        tier = want(args, "tier", str, optional=True) or "host"
        if tier not in ("host", "gpu"):
            raise ProtocolError(f"tier must be host or gpu, got {tier!r}")
        if tier == "gpu" and self.store.gpu is None:
            raise ProtocolError("this daemon has no gpu tier (hello says why)")
        return tier

    def commit(self, s: Session, args: dict) -> dict:
        ns = want(args, "ns", str)
        hashes = want_hashes(args, self.max_batch)
        attention = want_floats(args, "attention", len(hashes))
        tokens = want_token_blocks(args, len(hashes))
        return {"committed": self.store.commit(ns, hashes, s.owner, attention, tokens)}

    def abort(self, s: Session, args: dict) -> dict:
        self.store.abort(want(args, "ns", str), want_hashes(args, self.max_batch), s.owner)
        return {}

    async def put(self, s: Session, args: dict) -> dict:
        """A remote client's blocks, payloads inline: reserved a slice at a time as `reserve` does (other
        requests served between), written, then committed together; a failure aborts them all."""
        ns = want(args, "ns", str)
        blocks = want_blocks(args, self.max_batch, with_payload=True)
        tokens = want_token_blocks(args, len(blocks))
        block_bytes = self.store.namespace(ns).block_bytes
        for i, (_, _, payload) in enumerate(blocks):
            if len(payload) != block_bytes:
                raise NamespaceError(f"blocks[{i}] payload is {len(payload)} B; the namespace's blocks are {block_bytes} B")
        entries: list = []
        written, written_tokens = [], []
        try:
            await self._reserve_sliced(s, ns, [(h, p) for h, p, _ in blocks], entries=entries)
            for i, (entry, (h, _, payload)) in enumerate(zip(entries, blocks)):
                if entry is not None:
                    self.store.host.write(entry.location, payload)
                    written.append(h)
                    written_tokens.append(tokens[i] if tokens is not None else None)
        except BaseException:
            self.store.abort(ns, [key_hash(e.key) for e in entries if e is not None], s.owner)
            raise
        self.store.commit(ns, written, s.owner, tokens=written_tokens if tokens is not None else None)
        return {"stored": len(written)}

    @staticmethod
    def _local_only(s: Session, op: str) -> None:
        if s.transport != "unix":
            raise ProtocolError(f"{op} hands out arena extents and is for local clients; remote clients use put/get")


async def _first_entries(entries: dict, wanted: Callable[[Entry], bool], limit: int) -> list[Entry]:
    """The first `limit` entries of `entries` (in the index's order) that are `wanted`. Past
    LIST_SLICE_BLOCKS examined, the rest is read from a snapshot of the keys (a copy in C: ~50 ms at
    10^7 blocks), a slice of them per turn of the loop, each key looked up again (one removed since is
    skipped)."""
    found: list[Entry] = []
    for n, e in enumerate(entries.values()):
        if n == LIST_SLICE_BLOCKS:
            break
        if wanted(e):
            found.append(e)
            if len(found) == limit:
                return found
    else:
        return found
    rest = list(itertools.islice(entries, LIST_SLICE_BLOCKS, None))  # (nothing changed the index since: same order)
    get = entries.get
    for i in range(0, len(rest), LIST_SLICE_BLOCKS):
        await asyncio.sleep(0)
        for key in rest[i : i + LIST_SLICE_BLOCKS]:
            e = get(key)
            if e is not None and wanted(e):
                found.append(e)
                if len(found) == limit:
                    return found
    return found


def error_reply(exc: BaseException) -> dict:
    name = type(exc).__name__ if isinstance(exc, KVStoreError) else "KVStoreError"
    message = str(exc) if isinstance(exc, KVStoreError) else f"internal error: {type(exc).__name__}: {exc}"
    return {"type": name, "message": message}


AsyncHandler = Callable[[Session, str, dict], Awaitable[Any]]
