"""A prefill/decode disaggregation proxy (or a plain router) in front of vLLM OpenAI servers that share a
kvstore daemon.

    kvstore proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    kvstore proxy --engine http://127.0.0.1:8100 --engine http://127.0.0.1:8101 --port 8000   # router

(the command line is tools/proxy_cmd.py; this module is the service.)

Router mode (`--engine`, no --prefill/--decode): one pool of kv_both engines;
each request is forwarded unchanged to one engine (round-robin, or by
`x-session-affinity`), with the same health checks and errors as below (the
"decode engine" of the messages is then just "engine"). tools/bench/bench_serving.py
uses it.

Each /v1/completions or /v1/chat/completions request goes to a prefill engine
(kv_role kv_producer) with max_tokens=1, and to a decode engine (kv_role
kv_consumer) as given, marked with kv_transfer_params {"kvstore_wait": true}:
the decode engine's connector then waits for the prompt's blocks that the
prefill engine is computing (connectors/vllm_scheduler.py) and loads them
instead of recomputing. By default both are sent at once (`--mode parallel`:
the decode engine's admission overlaps the prefill); `--mode sequential` sends
the decode request once the prefill one has answered (the blocks are committed
by then: no wait). The decode engine's answer, streamed or not, is the reply.

Engines are chosen round-robin among those up, or by the `x-session-affinity`
header (rendezvous hashing: a session keeps its engine while it is up and not
over `--load-bound` (1.25) times its share of the requests in flight; then the
next engine of the session's order takes it: bounded-load consistent hashing,
so skewed sessions cannot pile onto one engine). A
background task GETs each engine's /health every `--health-interval-s`; an
engine that fails a check or a connection is skipped until it passes again.

Errors, always as OpenAI-style JSON {"error": {"message", "type", "code"}}:
malformed JSON or a body that is not an object -> 400; no engine of a kind up
-> 503 for decode engines; a decode engine's own 4xx -> passed through as is; its
5xx or an unreachable engine -> 502 naming the engine. A failed prefill (or no
prefill engine up) does not fail the request: the decode engine computes what it
could not load (its wait ends at the prefill engine's withdrawal, lease, or its
wait_s) and a non-streamed reply says so in the `x-pd-prefill-error` header.
Every upstream call is bounded by timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

AFFINITY_HEADER = "x-session-affinity"
PREFILL_ERROR_HEADER = "x-pd-prefill-error"


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    mode: str = "parallel"  # or "sequential"; "router" when `engines` are given
    health_interval_s: float = 2.0
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    engines: tuple[str, ...] = ()  # router mode: one pool, no prefill step
    load_bound: float = 1.25  # affinity with bounded loads (Pool); 0: pure rendezvous hashing

    def __post_init__(self) -> None:
        if self.engines:
            if self.prefill or self.decode:
                raise ValueError("give either --engine (router) or --prefill and --decode, not both")
            object.__setattr__(self, "mode", "router")
        elif not self.prefill or not self.decode:
            raise ValueError("give at least one --prefill and one --decode engine URL (or --engine URLs)")
        elif self.mode not in ("parallel", "sequential"):
            raise ValueError(f"mode must be parallel or sequential, not {self.mode!r}")
        if self.load_bound and self.load_bound < 1:
            raise ValueError(f"--load-bound must be >= 1 (or 0: off), not {self.load_bound}")
        for url in self.prefill + self.decode + self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, kind: str = "upstream_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Pool:
    """The engines of one kind, which of them are up, and how many requests each has in flight.

    `load_bound` (c >= 1, 0 = off) bounds session affinity (consistent hashing with bounded loads,
    Mirrokni et al. 2018): a session's engine is the first of its rendezvous order that has fewer
    than ceil(c * (requests in flight + 1) / engines up) requests in flight, so one engine never
    takes much more than its share however the sessions hash. Round-robin ignores it.
    """

    kind: str
    urls: tuple[str, ...]
    load_bound: float = 0.0
    up: dict[str, bool] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.load_bound and self.load_bound < 1:
            raise ValueError(f"load bound must be >= 1 (or 0: off), not {self.load_bound}")
        self.up = {u: True for u in self.urls}  # optimistic until the first check says otherwise
        self.inflight = {u: 0 for u in self.urls}

    def pick(self, affinity: str | None) -> str:
        live = [u for u in self.urls if self.up[u]]
        if not live:
            raise UpstreamError(503, f"no {self.what} is up (configured: {', '.join(self.urls)})",
                                "service_unavailable")
        if affinity:
            order = sorted(live, key=lambda u: hashlib.sha256(f"{affinity}|{u}".encode()).digest(), reverse=True)
            if not self.load_bound:
                return order[0]
            cap = math.ceil(self.load_bound * (sum(self.inflight[u] for u in live) + 1) / len(live))
            return next((u for u in order if self.inflight[u] < cap), order[0])
        return live[next(self._rr) % len(live)]

    @contextlib.contextmanager
    def busy(self, url: str):
        """Count a request in flight on `url` for the bounded-load choice."""
        self.inflight[url] += 1
        try:
            yield
        finally:
            self.inflight[url] -= 1

    @property
    def what(self) -> str:
        return "engine" if self.kind == "engine" else f"{self.kind} engine"

    def mark(self, url: str, up: bool) -> None:
        if self.up.get(url) != up:
            log.warning("%s %s is %s", self.what, url, "up" if up else "DOWN")
        self.up[url] = up


CONFIG = web.AppKey("config", ProxyConfig)
POOLS = web.AppKey("pools", dict)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def error_json(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except UpstreamError as exc:
        return error_json(exc.status, exc.message, exc.kind)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug here must still answer, not hang the client
        log.exception("proxy error")
        return error_json(500, f"proxy error: {type(exc).__name__}: {exc}", "internal_error")


async def read_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise UpstreamError(400, f"the request body is not valid JSON: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise UpstreamError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


def prefill_body(body: dict) -> dict:
    out = dict(body, max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: dict) -> dict:
    params = dict(body.get("kv_transfer_params") or {})
    params["kvstore_wait"] = True
    return dict(body, kv_transfer_params=params)


async def prefill(app: web.Application, path: str, body: dict, affinity: str | None) -> str | None:
    """Run the prefill; None when it went well, else why not (the decode engine recomputes)."""
    pool = app[POOLS]["prefill"]
    try:
        url = pool.pick(affinity)
    except UpstreamError as exc:
        return exc.message
    try:
        with pool.busy(url):
            async with app[SESSION].post(url + path, json=prefill_body(body)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return f"prefill engine {url} answered {resp.status}: {text[:300]}"
                return None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        pool.mark(url, False)
        return f"prefill engine {url} unreachable: {type(exc).__name__}: {exc}"


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await read_body(request)
    affinity = request.headers.get(AFFINITY_HEADER)
    path = request.path
    if app[CONFIG].mode == "router":
        pool = app[POOLS]["engine"]
        return await forward_decode(request, pool, pool.pick(affinity), path, body, None)
    decode_pool = app[POOLS]["decode"]
    decode_url = decode_pool.pick(affinity)
    prefill_task = asyncio.ensure_future(prefill(app, path, body, affinity))
    try:
        if app[CONFIG].mode == "sequential":
            await asyncio.shield(prefill_task)
        return await forward_decode(request, decode_pool, decode_url, path, body, prefill_task)
    finally:
        if not prefill_task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(prefill_task), app[CONFIG].request_timeout_s)


async def forward_decode(request: web.Request, pool: Pool, url: str, path: str, body: dict,
                         prefill_task: asyncio.Future | None) -> web.StreamResponse:
    """Forward to `url` of `pool`; prefill_task None: router mode, the body goes as is."""
    with pool.busy(url):
        return await _forward(request, pool, url, path, body, prefill_task)


async def _forward(request: web.Request, pool: Pool, url: str, path: str, body: dict,
                   prefill_task: asyncio.Future | None) -> web.StreamResponse:
    session = request.app[SESSION]
    try:
        resp_cm = session.post(url + path, json=body if prefill_task is None else decode_body(body))
        resp = await resp_cm.__aenter__()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        pool.mark(url, False)
        raise UpstreamError(502, f"{pool.what} {url} unreachable: {type(exc).__name__}: {exc}") from None
    out = None
    try:
        if resp.status != 200:
            text = await resp.text()
            if resp.status >= 500:
                raise UpstreamError(502, f"{pool.what} {url} answered {resp.status}: {text[:500]}")
            return web.Response(status=resp.status, text=text, content_type=resp.content_type or "application/json")
        headers = {}
        if body.get("stream"):
            out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        data = await resp.read()
        if prefill_task is not None and prefill_task.done() and prefill_task.result():
            headers[PREFILL_ERROR_HEADER] = prefill_task.result()[:200].replace("\n", " ")
            log.warning("%s", prefill_task.result())
        return web.Response(status=200, body=data, headers=headers,
                            content_type=resp.content_type or "application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        pool.mark(url, False)
        if out is not None:  # a stream already started: cut it short (no [DONE]); the client sees that
            log.warning("%s %s failed mid-stream: %s", pool.what, url, exc)
            with contextlib.suppress(Exception):
                await out.write_eof()
            return out
        raise UpstreamError(502, f"{pool.what} {url} failed mid-answer: {type(exc).__name__}: {exc}") from None
    finally:
        await resp_cm.__aexit__(None, None, None)


async def models(request: web.Request) -> web.Response:
    pool = request.app[POOLS]["engine" if request.app[CONFIG].mode == "router" else "decode"]
    url = pool.pick(None)
    try:
        async with request.app[SESSION].get(url + "/v1/models") as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        pool.mark(url, False)
        raise UpstreamError(502, f"{pool.what} {url} unreachable: {exc}") from None


async def health(request: web.Request) -> web.Response:
    pools = request.app[POOLS]
    state = {kind: {u: ok for u, ok in p.up.items()} for kind, p in pools.items()}
    ok = all(any(p.up.values()) for p in pools.values())
    return web.json_response({"ok": ok, "engines": state}, status=200 if ok else 503)


async def check_engines(app: web.Application) -> None:
    session, cfg = app[SESSION], app[CONFIG]
    timeout = aiohttp.ClientTimeout(total=max(cfg.connect_timeout_s, 0.5))

    async def one(pool: Pool, url: str) -> None:
        try:
            async with session.get(url + "/health", timeout=timeout) as resp:
                pool.mark(url, resp.status == 200)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pool.mark(url, False)

    await asyncio.gather(*(one(p, u) for p in app[POOLS].values() for u in p.urls))


async def _health_loop(app: web.Application) -> None:
    while True:
        await check_engines(app)
        await asyncio.sleep(app[CONFIG].health_interval_s)


async def _resources(app: web.Application):
    cfg = app[CONFIG]
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s,
                                    connect=cfg.connect_timeout_s)
    app[SESSION] = aiohttp.ClientSession(timeout=timeout)
    task = asyncio.create_task(_health_loop(app))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await app[SESSION].close()


def make_app(cfg: ProxyConfig) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 << 20)
    app[CONFIG] = cfg
    if cfg.mode == "router":
        app[POOLS] = {"engine": Pool("engine", cfg.engines, cfg.load_bound)}
    else:
        app[POOLS] = {"prefill": Pool("prefill", cfg.prefill, cfg.load_bound),
                      "decode": Pool("decode", cfg.decode, cfg.load_bound)}
    app.cleanup_ctx.append(_resources)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def serve(cfg: ProxyConfig, host: str, port: int) -> None:
    """Run the proxy until interrupted (`kvstore proxy`: tools/proxy_cmd.py)."""
    if cfg.mode == "router":
        print(f"router on http://{host}:{port} engines={list(cfg.engines)}", flush=True)
    else:
        print(f"pd proxy on http://{host}:{port} prefill={list(cfg.prefill)} decode={list(cfg.decode)}", flush=True)
    web.run_app(make_app(cfg), host=host, port=port, print=None, shutdown_timeout=5.0)
