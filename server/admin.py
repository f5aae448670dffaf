"""The admin plane: aiohttp on loopback by default.

GET /healthz  -> {"status": "ok"}
GET /metrics  -> Prometheus text: blocks and bytes per tier, hits, misses,
                 evictions, errors, sessions
GET /stats    -> the store's stats as JSON, plus sessions and error counts
GET /check    -> the store's consistency check: {"ok": bool, "problems": [...]}
POST /clear   -> drop every unpinned committed block

Typed app state (web.AppKey), errors mapped to JSON in one middleware, no
global registries: metrics are read from the store at scrape time by a
collector on the daemon's own registry. The daemon passes in what the admin
plane reads (`AdminView`); this module imports nothing of the daemon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.errors import KVStoreError
from kvstore.store import TieredStore


@dataclass(frozen=True, slots=True)
class AdminView:
    """What the admin plane reads and changes, handed in by the daemon."""

    store: TieredStore
    stats: Callable[[], dict]  # the store's stats with the daemon's sessions and error counts


VIEW = web.AppKey("view", AdminView)
REGISTRY = web.AppKey("registry", CollectorRegistry)


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
        disk = s["tiers"].get("disk", {})
        if "checksum_failures" in disk:  # the disk tier is configured
            yield CounterMetricFamily("kvstore_disk_checksum_failures", "Disk blocks whose checksum did not verify (dropped)",
                                      value=disk["checksum_failures"])
            yield GaugeMetricFamily("kvstore_disk_pending_writes", "Demotions not yet durable", value=disk["pending_writes"])
        c = s["counters"]
        yield CounterMetricFamily("kvstore_misses", "Blocks asked for and not present", value=c.get("miss_blocks", 0))
        yield CounterMetricFamily("kvstore_lookup_blocks", "Blocks looked up", value=c.get("lookup_blocks", 0))
        yield CounterMetricFamily("kvstore_lookup_hit_blocks", "Blocks found by lookups", value=c.get("lookup_hit_blocks", 0))
        yield CounterMetricFamily("kvstore_put_blocks", "Blocks committed", value=c.get("put_blocks", 0))
        errors = CounterMetricFamily("kvstore_errors", "Requests answered with an error", labels=["type"])
        for kind, n in s["errors"].items():
            errors.add_metric([kind], n)
        yield errors
        cap = GaugeMetricFamily("kvstore_capacity_bytes", "Tier capacity", labels=["tier"])
        for tier, t in s["tiers"].items():
            if "capacity_bytes" in t:  # the tiers in the chain
                cap.add_metric([tier], t["capacity_bytes"])
        yield cap
        yield GaugeMetricFamily("kvstore_sessions", "Open client connections", value=s["sessions"])


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except KVStoreError as exc:
        return web.json_response({"error": type(exc).__name__, "message": str(exc)}, status=400)
    except Exception as exc:
        return web.json_response({"error": "internal", "message": str(exc)}, status=500)


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
    return web.json_response({"removed": request.app[VIEW].store.clear()})


def make_app(view: AdminView) -> web.Application:
    app = web.Application(middlewares=[errors_middleware])
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(view))
    app[VIEW] = view
    app[REGISTRY] = registry
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/check", check)
    app.router.add_post("/clear", clear)
    return app


async def start_admin(view: AdminView, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_app(view), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]
