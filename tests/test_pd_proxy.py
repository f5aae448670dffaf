"""server/pd_proxy.py against small fake aiohttp engines (no vLLM): routing, streaming, health checks,
and bad input answered with clear errors, never a hang. Real engines behind it: tests/test_vllm_pd.py."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvstore.server.pd_proxy import AFFINITY_HEADER, PREFILL_ERROR_HEADER, POOLS, ProxyConfig, check_engines, make_app


@pytest.fixture
def dead_url():
    """An engine URL that refuses connections: its port stays bound, not listening, for the whole test, so no
    server the test starts can be given it (a released free port could be, once in a few thousand runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


class FakeEngine:
    """An OpenAI-ish engine: records bodies, answers with `status`, streams when asked."""

    def __init__(self, name: str, status: int = 200, healthy: bool = True) -> None:
        self.name, self.status, self.healthy = name, status, healthy
        self.bodies: list[dict] = []
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'engine': self.name, 'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"engine": self.name, "choices": [{"text": "ok"}]})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def proxy_for(prefill: list[str], decode: list[str], **kw) -> TestClient:
    # dead ports refuse at once: a short connect timeout would only mark a healthy engine down when the loop
    # stalls on a loaded machine
    cfg = ProxyConfig(tuple(prefill), tuple(decode), health_interval_s=kw.pop("health_interval_s", 60),
                      connect_timeout_s=10.0, request_timeout_s=10.0, **kw)
    client = TestClient(TestServer(make_app(cfg), host="127.0.0.1"))
    await client.start_server()
    return client


def test_requests_go_to_a_prefill_engine_with_max_tokens_1_and_to_a_decode_engine_marked_to_wait():
    async def scenario():
        p, d1, d2 = FakeEngine("p"), FakeEngine("d1"), FakeEngine("d2")
        for e in (p, d1, d2):
            await e.server.start_server()
        client = await proxy_for([p.url], [d1.url, d2.url])
        try:
            body = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream_options": {"x": 1}}
            answered = []
            for _ in range(4):
                r = await client.post("/v1/completions", json=body)
                assert r.status == 200
                answered.append((await r.json())["engine"])
            assert answered == ["d1", "d2", "d1", "d2"]  # round-robin
            assert len(p.bodies) == 4 and all(b["max_tokens"] == 1 and b["stream"] is False for b in p.bodies)
            assert "stream_options" not in p.bodies[0] and "kv_transfer_params" not in p.bodies[0]
            assert d1.bodies[0]["max_tokens"] == 16 and d1.bodies[0]["kv_transfer_params"] == {"kvstore_wait": True}
            # session affinity: the same session always lands on the same decode engine
            seen = set()
            for _ in range(4):
                r = await client.post("/v1/chat/completions", json={"messages": [], "max_completion_tokens": 9},
                                      headers={AFFINITY_HEADER: "session-42"})
                seen.add((await r.json())["engine"])
            assert len(seen) == 1 and p.bodies[-1]["max_completion_tokens"] == 1
            # streaming passes through chunk by chunk
            r = await client.post("/v1/completions", json={**body, "stream": True})
            text = await r.text()
            assert r.status == 200 and text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
        finally:
            await client.close()
            for e in (p, d1, d2):
                await e.server.close()

    run(scenario())


def test_a_dead_or_unhealthy_engine_is_skipped(dead_url):
    async def scenario():
        p, d_ok, d_sick = FakeEngine("p"), FakeEngine("ok"), FakeEngine("sick", healthy=False)
        for e in (p, d_ok, d_sick):
            await e.server.start_server()
        dead = dead_url
        client = await proxy_for([dead, p.url], [d_sick.url, dead, d_ok.url])
        try:
            await check_engines(client.server.app)
            pools = client.server.app[POOLS]
            assert pools["decode"].up == {d_sick.url: False, dead: False, d_ok.url: True}
            for _ in range(3):
                r = await client.post("/v1/completions", json={"prompt": "x"})
                assert r.status == 200 and (await r.json())["engine"] == "ok"
            assert len(p.bodies) == 3
            r = await client.get("/health")
            assert r.status == 200
        finally:
            await client.close()
            for e in (p, d_ok, d_sick):
                await e.server.close()

    run(scenario())


def test_bad_input_gets_clear_errors_and_never_hangs(dead_url):
    async def scenario():
        p, d500, d400 = FakeEngine("p"), FakeEngine("d500", status=500), FakeEngine("d400", status=400)
        p_down = FakeEngine("p500", status=500)
        for e in (p, d500, d400, p_down):
            await e.server.start_server()
        nobody = [dead_url]
        client = await proxy_for(nobody, nobody)
        try:
            # nothing up: found by connecting (502), or already by the first health check (503)
            r = await client.post("/v1/completions", json={"prompt": "x"})
            msg = (await r.json())["error"]["message"]
            assert (r.status, "unreachable" in msg) == (502, True) or (r.status, "is up" in msg) == (503, True)
            await check_engines(client.server.app)
            r = await client.post("/v1/completions", json={"prompt": "x"})
            err = (await r.json())["error"]
            assert r.status == 503 and "no decode engine is up" in err["message"]
            assert (await client.get("/health")).status == 503
            r = await client.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            r = await client.post("/v1/completions", json=[1, 2])
            assert r.status == 400 and "JSON object" in (await r.json())["error"]["message"]
        finally:
            await client.close()

        client = await proxy_for([p.url], [d500.url])
        try:
            r = await client.post("/v1/completions", json={"prompt": "x"})
            err = (await r.json())["error"]
            assert r.status == 502 and d500.url in err["message"] and "500" in err["message"] and "says no" in err["message"]
        finally:
            await client.close()

        client = await proxy_for([p.url], [d400.url])
        try:
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status == 400 and "d400 says no" in (await r.json())["error"]["message"]
        finally:
            await client.close()

        # a failed prefill does not fail the request: the decode engine recomputes, the header says why
        ok = FakeEngine("d")
        await ok.server.start_server()
        client = await proxy_for([p_down.url], [ok.url], mode="sequential")
        try:
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status == 200 and "500" in r.headers[PREFILL_ERROR_HEADER]
        finally:
            await client.close()
        client = await proxy_for(nobody, [ok.url])  # no prefill engine up at all: decode-only
        try:
            await check_engines(client.server.app)
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status == 200 and "no prefill engine is up" in r.headers[PREFILL_ERROR_HEADER]
        finally:
            await client.close()
            for e in (p, d500, d400, p_down, ok):
                await e.server.close()

    run(scenario())


def test_bad_proxy_config_is_refused():
    import pytest

    with pytest.raises(ValueError, match="at least one"):
        ProxyConfig((), ("http://x",))
    with pytest.raises(ValueError, match="http://"):
        ProxyConfig(("localhost:1",), ("http://x",))
    with pytest.raises(ValueError, match="mode"):
        ProxyConfig(("http://a",), ("http://b",), mode="sideways")


def test_router_mode_forwards_unchanged_to_one_pool_with_affinity_and_skips_a_dead_engine(dead_url):
    async def scenario():
        e1, e2 = FakeEngine("e1"), FakeEngine("e2")
        for e in (e1, e2):
            await e.server.start_server()
        dead = dead_url
        cfg = ProxyConfig((), (), engines=(e1.url, e2.url, dead), health_interval_s=60, connect_timeout_s=10.0,
                          request_timeout_s=10.0)  # 10 s: a healthy engine must not be marked down by a stall
        assert cfg.mode == "router"
        client = TestClient(TestServer(make_app(cfg), host="127.0.0.1"))
        await client.start_server()
        try:
            await check_engines(client.server.app)
            assert client.server.app[POOLS]["engine"].up == {e1.url: True, e2.url: True, dead: False}
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
            answered = []
            for _ in range(4):
                r = await client.post("/v1/completions", json=body)
                assert r.status == 200
                answered.append((await r.json())["engine"])
            assert sorted(answered) == ["e1", "e1", "e2", "e2"]  # round-robin over the live ones
            assert all(b == body for b in e1.bodies + e2.bodies)  # no prefill step, no kv_transfer_params
            per_session = {}
            # the order hashes the engines' URLs, whose ports are random: 32 sessions all on one engine
            # happens once in 2**31 runs (8 sessions failed CI once, 1 in 128)
            for s in range(32):
                for _ in range(3):
                    r = await client.post("/v1/completions", json=body, headers={AFFINITY_HEADER: f"s{s}"})
                    per_session.setdefault(s, set()).add((await r.json())["engine"])
            assert all(len(v) == 1 for v in per_session.values())  # a session keeps its engine
            assert len(set().union(*per_session.values())) == 2  # and sessions spread over both
            # an engine going down: its sessions move to the other one
            e2.healthy = False
            await check_engines(client.server.app)
            for s in range(32):
                r = await client.post("/v1/completions", json=body, headers={AFFINITY_HEADER: f"s{s}"})
                assert (await r.json())["engine"] == "e1"
            r = await client.post("/v1/completions", json={**body, "stream": True})
            assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
            e1.healthy = False
            await check_engines(client.server.app)
            r = await client.post("/v1/completions", json=body)
            assert r.status == 503 and "no engine is up" in (await r.json())["error"]["message"]
        finally:
            await client.close()
            for e in (e1, e2):
                await e.server.close()

    run(scenario())


def test_router_config_refuses_mixing_modes():
    import pytest

    with pytest.raises(ValueError, match="not both"):
        ProxyConfig(("http://a",), ("http://b",), engines=("http://c",))


def test_affinity_with_bounded_loads_spreads_a_hot_session_and_keeps_it_home_when_idle():
    from contextlib import ExitStack

    from kvstore.server.pd_proxy import Pool

    urls = ("http://a:1", "http://b:1", "http://c:1")
    pure, bounded = Pool("engine", urls, 0.0), Pool("engine", urls, 1.25)
    home = pure.pick("hot")
    assert bounded.pick("hot") == home  # nothing in flight: the session's own engine
    with ExitStack() as held:
        for _ in range(12):  # 12 concurrent requests of one session
            held.enter_context(pure.busy(pure.pick("hot")))
            held.enter_context(bounded.busy(bounded.pick("hot")))
        assert pure.inflight[home] == 12  # pure rendezvous hashing piles them on one engine
        assert max(bounded.inflight.values()) <= 5  # ceil(1.25 * 12 / 3)
        assert bounded.inflight[home] == max(bounded.inflight.values())
        assert sum(bounded.inflight.values()) == 12
    assert set(bounded.inflight.values()) == {0}  # released
    assert bounded.pick("hot") == home
    bounded.up[home] = False  # a dead engine is still skipped
    assert bounded.pick("hot") != home


def test_a_load_bound_below_one_is_refused():
    import pytest

    with pytest.raises(ValueError, match="load-bound"):
        ProxyConfig((), (), engines=("http://a:1",), load_bound=0.5)
