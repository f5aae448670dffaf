"""The admin plane: aiohttp on loopback by default.

GET /healthz  -> {"status": "ok"}
GET /metrics  -> Prometheus text: blocks and bytes per tier, hits, misses,
                 evictions, errors, sessions; per model (server/metrics.py)
                 blocks, bytes and counters; requests per op; KV events
GET /stats    -> the store's stats as JSON, plus sessions and error counts
GET /check    -> the store's consistency check: {"ok": bool, "problems": [...]}
POST /clear   -> drop every unpinned committed block
POST /events/resync -> publish AllBlocksCleared and a BlockStored for every block (in the background, a step at a time)
                 held (a router whose gap the replay buffer cannot fill asks for it)

Who may ask (`guard_middleware`, before any handler), since any local user can
reach a loopback port, and a web page can too through DNS rebinding:
- a Host header other than 127.0.0.1, localhost or [::1] (any port; or the
  configured admin_host) is refused, 421;
- /healthz answers any peer (it says "ok", nothing else: what a Kubernetes
  probe from the node asks); /metrics (read-only counters) is open to loopback
  peers, for scrapers; every other path needs `Authorization: Bearer <token>`,
  the token the daemon writes to `<socket folder>/<name>.admin-token` (0600) at
  start, or reads from `server.admin_token_file` (a Secret), 401;
- a POST must be application/json, 415: a cross-site form or text/plain post
  is a "simple request" a browser sends without asking.
Refusals are JSON like every other error.

Typed app state (web.AppKey), errors mapped to JSON in one middleware, no
global registries: metrics are read from the store at scrape time by a
collector on the daemon's own registry. The daemon passes in what the admin
plane reads (`AdminView`); this module imports nothing of the daemon.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.clearing import clear_in_steps
from kvstore.errors import AuthError, KVStoreError
from kvstore.store import TieredStore
from kvstore.server.metrics import daemon_families, namespace_families


@dataclass(frozen=True, slots=True)
class AdminView:
    """What the admin plane reads and changes, handed in by the daemon."""

    store: TieredStore
    stats: Callable[[], dict]  # the store's stats with the daemon's sessions and error counts
    token: str  # the bearer token every path but OPEN_PATHS needs
    resync_events: Callable[[], None] | None = None  # None: KV events are off


class WrongHost(KVStoreError):
    """The Host header names no loopback address: a rebound DNS name, or a misdirected request."""


class WrongContentType(KVStoreError):
    """A POST that is not application/json: what a cross-site form or text/plain post looks like."""


VIEW = web.AppKey("view", AdminView)
REGISTRY = web.AppKey("registry", CollectorRegistry)
HOSTS = web.AppKey("hosts", frozenset)
OPEN_PATHS = frozenset({"/healthz", "/metrics"})
HEALTH_PATH = "/healthz"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
STATUS = {AuthError: 401, WrongHost: 421, WrongContentType: 415}


class StoreCollector:
    def __init__(self, view: AdminView) -> None:
        self.view = view

    def collect(self):
        s = self.view.stats()
        blocks = GaugeMetricFamily("kvstore_blocks", "Committed blocks per tier", labels=["tier"])
        nbytes = GaugeMetricFamily("kvstore_bytes", "Bytes of committed blocks per tier", labels=["tier"])
        hits = CounterMetricFamily("kvstore_hits", "Blocks acquired (hits) per tier", labels=["tier"])
        evictions = CounterMetricFamily("kvstore_evictions", "Blocks evicted per tier", labels=["tier"])
        promotions = CounterMetricFamily("kvstore_promotions", "Blocks promoted into a tier", labels=["tier"])
        demotions = CounterMetricFamily("kvstore_demotions", "Blocks demoted into a tier", labels=["tier"])
        for tier, t in s["tiers"].items():
            blocks.add_metric([tier], t["blocks"])
            nbytes.add_metric([tier], t["bytes"])
            hits.add_metric([tier], t["hits"])
            evictions.add_metric([tier], t["evictions"])
            promotions.add_metric([tier], t.get("promotions_in", 0))
            demotions.add_metric([tier], t.get("demotions_in", 0))
        yield from (blocks, nbytes, hits, evictions, promotions, demotions)
        history = [(tier, t) for tier, t in s["tiers"].items() if "policy_history_ghosts" in t]
        if history:  # the policy's memory of evicted blocks (eviction/ghosts.py: capped at MAX_GHOSTS a table)
            ghosts = GaugeMetricFamily("kvstore_policy_history_ghosts",
                                       "Evicted blocks a tier's eviction policy remembers (ghosts)", labels=["tier"])
            ghost_bytes = GaugeMetricFamily("kvstore_policy_history_bytes",
                                            "Bytes of the arrays holding a tier's policy history", labels=["tier"])
            for tier, t in history:
                ghosts.add_metric([tier], t["policy_history_ghosts"])
                ghost_bytes.add_metric([tier], t["policy_history_bytes"])
            yield from (ghosts, ghost_bytes)
        disk = s["tiers"].get("disk", {})
        if "checksum_failures" in disk:  # the disk tier is configured
            yield CounterMetricFamily("kvstore_disk_checksum_failures", "Disk blocks whose checksum did not verify (dropped)",
                                      value=disk["checksum_failures"])
            yield GaugeMetricFamily("kvstore_disk_pending_writes", "Demotions not yet durable", value=disk["pending_writes"])
        compressed = [(tier, tag, row) for tier, t in s["tiers"].items() for tag, row in t.get("compressed", {}).items()]
        if compressed:  # lossy storage is on and holds blocks
            logical = GaugeMetricFamily("kvstore_compressed_logical_bytes",
                                        "Decoded size of the compressed blocks a tier holds", labels=["tier", "codec"])
            stored = GaugeMetricFamily("kvstore_compressed_stored_bytes",
                                       "Stored size of the compressed blocks a tier holds", labels=["tier", "codec"])
            count = GaugeMetricFamily("kvstore_compressed_blocks", "Compressed blocks a tier holds",
                                      labels=["tier", "codec"])
            for tier, tag, row in compressed:
                logical.add_metric([tier, tag], row["logical_bytes"])
                stored.add_metric([tier, tag], row["stored_bytes"])
                count.add_metric([tier, tag], row["blocks"])
            yield from (logical, stored, count)
        if "compaction" in s:  # the disk tier compresses: what demotions stored exact and compaction encoded since
            c = s["counters"]
            yield CounterMetricFamily("kvstore_disk_stored_exact_busy",
                                      "Opted-in blocks demoted exact because every encoder thread was busy",
                                      value=c.get("disk_stored_exact_busy", 0))
            yield CounterMetricFamily("kvstore_disk_compacted", "Blocks stored exact, encoded later in place",
                                      value=c.get("disk_compacted", 0))
            yield CounterMetricFamily("kvstore_disk_encoded_copies_dropped",
                                      "Encoded disk copies of promoted blocks dropped for room (such a block is "
                                      "encoded again, from its decoded image, when demoted)",
                                      value=c.get("disk_encoded_copies_dropped", 0))
            yield GaugeMetricFamily("kvstore_disk_compaction_waiting", "Blocks stored exact waiting for compaction",
                                    value=s["compaction"]["waiting_blocks"])
        host = s["tiers"].get("host", {})
        if "pending_records" in host:  # the arena is kept across restarts
            yield GaugeMetricFamily("kvstore_host_pending_records",
                                    "Committed host blocks whose placement record is not written yet (a kill loses them)",
                                    value=host["pending_records"])
            yield GaugeMetricFamily("kvstore_host_unchecked_records",
                                    "Host placement records without their checksum yet (taken when the store is quiet)",
                                    value=host["unchecked_records"])
            yield GaugeMetricFamily("kvstore_host_adopted_blocks", "Host blocks re-adopted from the arena at start",
                                    value=host["adopted_blocks"])
        if "recovery" in s:  # a restart's recovery is in progress: how far each tier's has come
            kept = GaugeMetricFamily("kvstore_recovery_kept_records", "Block records a tier kept across the restart",
                                     labels=["tier", "stage"])
            adopted = GaugeMetricFamily("kvstore_recovery_adopted_blocks", "Kept blocks adopted so far",
                                        labels=["tier", "stage"])
            for tier, r in s["recovery"].items():
                kept.add_metric([tier, r["stage"]], r["kept_records"])
                adopted.add_metric([tier, r["stage"]], r["adopted_blocks"])
            yield from (kept, adopted)
        c = s["counters"]
        yield CounterMetricFamily("kvstore_misses", "Blocks asked for and not present", value=c.get("miss_blocks", 0))
        yield CounterMetricFamily("kvstore_lookup_blocks", "Blocks looked up", value=c.get("lookup_blocks", 0))
        yield CounterMetricFamily("kvstore_lookup_hit_blocks", "Blocks found by lookups", value=c.get("lookup_hit_blocks", 0))
        yield CounterMetricFamily("kvstore_put_blocks", "Blocks committed", value=c.get("put_blocks", 0))
        present = CounterMetricFamily("kvstore_present_block_misses",
                                      "Present (committed) blocks that reads answered as misses, by reason",
                                      labels=["reason"])
        for reason, n in s.get("present_misses", {}).items():
            present.add_metric([reason], n)
        yield present
        errors = CounterMetricFamily("kvstore_errors", "Requests answered with an error", labels=["type"])
        for kind, n in s["errors"].items():
            errors.add_metric([kind], n)
        yield errors
        cap = GaugeMetricFamily("kvstore_capacity_bytes", "Tier capacity", labels=["tier"])
        for tier, t in s["tiers"].items():
            if "capacity_bytes" in t:  # the tiers in the chain
                cap.add_metric([tier], t["capacity_bytes"])
        yield cap
        cap_blocks = GaugeMetricFamily("kvstore_capacity_blocks", "The most blocks a tier holds (each is indexed in "
                                       "the daemon's memory: [disk] max_blocks)", labels=["tier"])
        held = GaugeMetricFamily("kvstore_held_blocks", "Blocks a capped tier holds, copies and writes in flight "
                                 "included (what its capacity in blocks counts)", labels=["tier"])
        for tier, t in s["tiers"].items():
            if "max_blocks" in t:
                cap_blocks.add_metric([tier], t["max_blocks"])
                held.add_metric([tier], t["held_blocks"])
        yield cap_blocks
        yield held
        gpu = s["tiers"].get("gpu", {})
        if "devices" in gpu:  # per device of the gpu tier
            dev_bytes = GaugeMetricFamily("kvstore_device_bytes", "Bytes of committed blocks per device of a tier",
                                          labels=["tier", "device"])
            dev_cap = GaugeMetricFamily("kvstore_device_capacity_bytes", "Capacity per device of a tier",
                                        labels=["tier", "device"])
            for device, d in gpu["devices"].items():
                dev_bytes.add_metric(["gpu", device], gpu.get("device_bytes", {}).get(device, 0))
                dev_cap.add_metric(["gpu", device], d["capacity_bytes"])
            yield dev_bytes
            yield dev_cap
        if "gpu_decode" in s:  # a gpu tier and a tier that compresses (kvstore/gpu_decode.py)
            yield CounterMetricFamily("kvstore_gpu_expanded_blocks",
                                      "Encoded blocks a GPU reader got expanded on the GPU into the gpu tier",
                                      value=c.get("gpu_expanded_blocks", 0))
            yield CounterMetricFamily("kvstore_gpu_decode_errors",
                                      "GPU expansions that failed (their blocks were decoded on the CPU)",
                                      value=c.get("gpu_decode_errors", 0))
        yield GaugeMetricFamily("kvstore_sessions", "Open client connections", value=s["sessions"])
        if "remote" in s:  # the remote tier is in the chain
            remote_errors = CounterMetricFamily("kvstore_remote_errors", "Remote tier operations that failed or timed out",
                                                labels=["op"])
            for op in ("query", "get", "put"):
                remote_errors.add_metric([op], s["remote"]["errors"].get(op, 0))
            yield remote_errors
            for name, help_ in (("remote_published_blocks", "Blocks published to the remote tier"),
                                ("remote_promotions", "Blocks fetched from the remote tier (into the host arena, or expanded into the gpu tier)"),
                                ("remote_lookup_hit_blocks", "Blocks a lookup found in the remote tier")):
                yield CounterMetricFamily(f"kvstore_{name}", help_, value=c.get(name, 0))
        yield from namespace_families(s)  # per model, bounded (server/metrics.py)
        yield from daemon_families(s)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except KVStoreError as exc:
        status = STATUS.get(type(exc), 400)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.json_response({"error": type(exc).__name__, "message": str(exc)}, status=status, headers=headers)
    except Exception as exc:
        return web.json_response({"error": "internal", "message": str(exc)}, status=500)


def _host_name(header: str) -> str:
    """The host part of a Host header, lowercased: "127.0.0.1:8321" -> "127.0.0.1", "[::1]:80" -> "[::1]"."""
    name, sep, port = header.rpartition(":")
    if sep and port.isdigit() and not name.endswith(":"):  # not the inside of a bare IPv6 literal
        header = name
    return header.lower()


def _from_loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


def _check_token(request: web.Request) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), request.app[VIEW].token.encode()):
        raise AuthError(f"{request.path} needs 'Authorization: Bearer <token>'; the token is in the daemon's "
                        f"socket folder, <name>.admin-token, readable by its user only")


@web.middleware
async def guard_middleware(request: web.Request, handler):
    """Refuse, before any handler runs, what a local user without the token or a web page could send."""
    if _host_name(request.headers.get("Host", "")) not in request.app[HOSTS]:
        raise WrongHost(f"Host {request.headers.get('Host', '')!r} is not this daemon's loopback address")
    if request.method in ("GET", "HEAD") and request.path == HEALTH_PATH:
        pass  # liveness, for any peer (a Kubernetes probe comes from the node): it says "ok" and nothing else
    elif not (request.path in OPEN_PATHS and request.method in ("GET", "HEAD") and _from_loopback(request)):
        _check_token(request)
    if request.method == "POST" and request.content_type != "application/json":
        raise WrongContentType(f"POST {request.path} needs Content-Type: application/json, "
                               f"got {request.content_type!r}")
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    return web.Response(text=json.dumps(request.app[VIEW].stats(), indent=1), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def check(request: web.Request) -> web.Response:
    problems = request.app[VIEW].store.check()
    return web.json_response({"ok": not problems, "problems": problems})


async def clear(request: web.Request) -> web.Response:
    """A step of blocks per turn of the loop (kvstore/clearing.py): engines are served meanwhile."""
    return web.json_response({"removed": await clear_in_steps(request.app[VIEW].store)})


async def resync_events(request: web.Request) -> web.Response:
    resync = request.app[VIEW].resync_events
    if resync is None:
        raise KVStoreError("KV events are off: set [events] endpoint in the daemon's config")
    resync()
    return web.json_response({"resynced": True})


def allowed_hosts(admin_host: str) -> frozenset:
    """Host names the admin plane answers to: loopback, and the bind address if it names one host."""
    names = set(LOOPBACK_NAMES)
    if admin_host not in ("", "0.0.0.0", "::"):
        names.add(f"[{admin_host}]" if ":" in admin_host else admin_host.lower())
    return frozenset(names)


def make_app(view: AdminView, admin_host: str = "127.0.0.1") -> web.Application:
    # errors_middleware first: the guard's refusals become JSON like every other error
    app = web.Application(middlewares=[errors_middleware, guard_middleware])
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(view))
    GCCollector(registry=registry)  # python_gc_*: the daemon's cyclic collections (server/daemon.py, tune_gc)
    app[VIEW] = view
    app[REGISTRY] = registry
    app[HOSTS] = allowed_hosts(admin_host)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/check", check)
    app.router.add_post("/clear", clear)
    app.router.add_post("/events/resync", resync_events)
    return app


async def start_admin(view: AdminView, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_app(view, host), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]
