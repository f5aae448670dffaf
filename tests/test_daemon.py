"""The daemon in its own process: sharing through the arena, TCP, admin plane, drain."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import AuthError, DaemonUnavailable, NamespaceError
from kvstore.keys import Namespace

from tests.conftest import ROOT
from kvstore.tiers.gpu import cuda_available
from tests.helpers import chain, namespace

NS = namespace(block_bytes=256 * 1024)


def run_client(code: str, sock: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOCK": sock}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60)


def test_two_client_processes_share_blocks_through_the_arena(daemon):
    writer = run_client("""
        import os, numpy as np
        from kvstore.client import KVClient
        from tests.test_daemon import NS, chain
        hs, ps = chain(1, 8)
        with KVClient(os.environ["SOCK"]) as c:
            ns = c.register(NS)
            payloads = [np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8) for i in range(8)]
            print(c.put(ns, list(zip(hs, ps, payloads))))
    """, daemon.socket_path)
    assert writer.returncode == 0, writer.stderr
    assert writer.stdout.strip() == "8"
    readers = [run_client("""
        import os, numpy as np
        from kvstore.client import KVClient
        from tests.test_daemon import NS, chain
        hs, ps = chain(1, 8)
        with KVClient(os.environ["SOCK"]) as c:
            ns = c.register(NS)
            assert c.lookup(ns, hs).hits == 8
            got = c.get(ns, hs)
            want = [np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8) for i in range(8)]
            print(all(np.array_equal(g, w) for g, w in zip(got, want)))
    """, daemon.socket_path) for _ in range(2)]
    for r in readers:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "True"
    stats = daemon.stats()
    assert stats["tiers"]["host"]["blocks"] == 8
    assert stats["tiers"]["host"]["hits"] == 16
    assert stats["sessions"] == 0  # clients went away
    assert daemon.check() == []


def test_lookup_counts_leading_blocks_only(daemon):
    hs, ps = chain(2, 6)
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        payload = np.zeros(NS.block_bytes, np.uint8)
        assert c.put(ns, [(h, p, payload) for h, p in zip(hs[:4], ps[:4])]) == 4
        assert c.lookup(ns, hs).hits == 4
        assert c.lookup(ns, hs[1:]).hits == 3  # leading run from where asked
        other, _ = chain(3, 2)
        assert c.lookup(ns, other + hs).hits == 0
        assert c.put(ns, [(hs[5], hs[4], payload)]) == 0, "a block whose parent is absent is not stored"
    assert daemon.check() == []


def test_a_reserve_of_several_slices_stores_every_block_byte_exact(daemon):
    """A reserve larger than RESERVE_SLICE_BLOCKS is reserved a slice at a time, other requests served in
    between (server/rpc.py): one request's chain comes back whole, every block in order and byte-exact."""
    from kvstore.server.rpc import RESERVE_SLICE_BLOCKS

    n = 3 * RESERVE_SLICE_BLOCKS + 5
    hs, ps = chain(9, n)
    payloads = [np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8) for i in range(n)]
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        assert c.put(ns, list(zip(hs, ps, payloads)), chunk=n) == n  # (one reserve of n blocks)
        assert c.lookup(ns, hs).hits == n
        assert all(np.array_equal(g, w) for g, w in zip(c.get(ns, hs), payloads))
    assert daemon.stats()["ops"]["reserve"] == 1
    assert daemon.check() == []


def test_namespaces_do_not_share_blocks(daemon):
    hs, ps = chain(4, 2)
    with KVClient(daemon.socket_path) as c:
        a = c.register(NS)
        b = c.register(Namespace("test-model", "bfloat16", 2, 2, 64, 16, 256 * 1024, tp_rank=1, tp_size=2))
        c.put(a, [(h, p, np.ones(NS.block_bytes, np.uint8)) for h, p in zip(hs, ps)])
        assert c.lookup(a, hs).hits == 2 and c.lookup(b, hs).hits == 0
        with pytest.raises(NamespaceError):
            c.lookup("ns-unknown", hs)


def test_tcp_clients_need_the_token_and_carry_payloads_inline(daemon_factory):
    token = "t" * 24
    d = daemon_factory("--tcp-port", "0", "--tcp-token", token)
    hs, ps = chain(5, 3)
    payloads = [np.full(NS.block_bytes, i, np.uint8) for i in range(3)]
    with KVClient(tcp=("127.0.0.1", d.tcp_port), token=token) as remote:
        ns = remote.register(NS)
        assert remote.put(ns, list(zip(hs, ps, payloads))) == 3
        assert all(np.array_equal(g, w) for g, w in zip(remote.get(ns, hs), payloads))
        with pytest.raises(Exception, match="local clients"):
            remote.reserve(ns, [(hs[0], None)])
    with KVClient(d.socket_path) as local:
        assert all(np.array_equal(g, w) for g, w in zip(local.get(local.register(NS), hs), payloads))
    for bad in ("wrong-token-wrong-token", None):
        with pytest.raises(AuthError):
            KVClient(tcp=("127.0.0.1", d.tcp_port), token=bad)
    assert d.check() == []


def test_a_tcp_put_of_several_slices_stores_every_block_byte_exact(daemon_factory):
    """A remote client's put larger than RESERVE_SLICE_BLOCKS is reserved a slice at a time, other
    requests served in between (server/rpc.py `put`), and committed together: one request's chain comes
    back whole, in order and byte-exact, to the remote client and to a local one."""
    from kvstore.server.rpc import RESERVE_SLICE_BLOCKS

    token = "s" * 24
    d = daemon_factory("--tcp-port", "0", "--tcp-token", token)
    small = namespace(block_bytes=4096)
    n = 2 * RESERVE_SLICE_BLOCKS + 7
    hs, ps = chain(11, n)
    payloads = [np.random.default_rng(i).integers(0, 256, small.block_bytes, dtype=np.uint8) for i in range(n)]
    with KVClient(tcp=("127.0.0.1", d.tcp_port), token=token) as remote:
        ns = remote.register(small)
        assert remote.put(ns, list(zip(hs, ps, payloads))) == n
        assert all(np.array_equal(g, w) for g, w in zip(remote.get(ns, hs), payloads))
    with KVClient(d.socket_path) as local:
        ns = local.register(small)
        assert local.lookup(ns, hs).hits == n
        assert all(np.array_equal(g, w) for g, w in zip(local.get(ns, hs), payloads))
    assert d.stats()["ops"]["put"] == 1  # (one request: its slices were the daemon's doing)
    assert d.check() == []


def test_a_listing_looks_for_its_rows_a_slice_at_a_time_and_skips_what_left_meanwhile(monkeypatch):
    """`blocks` (kvstore ls) on a daemon of millions of blocks: the rows are looked for until `limit`
    are found, and past LIST_SLICE_BLOCKS examined the loop serves other requests between slices of a
    snapshot of the keys; a block removed meanwhile is not listed."""
    import asyncio
    from types import SimpleNamespace

    from kvstore.server import rpc

    monkeypatch.setattr(rpc, "LIST_SLICE_BLOCKS", 10)
    entries = {i: SimpleNamespace(key=i, odd=i % 2 == 1) for i in range(100)}
    turns: list[int] = []

    async def other_requests() -> None:  # runs whenever the listing yields
        for _ in range(20):
            turns.append(len(entries))
            entries.pop(95, None)  # a block the listing has not reached yet leaves
            entries[1000 + len(turns)] = SimpleNamespace(key=-1, odd=True)  # (new ones: after the snapshot)
            await asyncio.sleep(0)

    async def run() -> tuple[list, list]:
        task = asyncio.ensure_future(other_requests())
        first = await rpc._first_entries(entries, lambda e: e.odd, 3)
        assert not turns, "found within the first slice: no turn given"
        every = await rpc._first_entries(entries, lambda e: e.odd, 1000)
        await task
        return first, every

    first, every = asyncio.run(run())
    assert [e.key for e in first] == [1, 3, 5]
    assert [e.key for e in every] == [k for k in range(1, 100, 2) if k != 95]
    assert turns, "the loop served other requests during the long listing"


def test_admin_plane(daemon):
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        hs, ps = chain(6, 2)
        c.put(ns, [(h, p, np.ones(NS.block_bytes, np.uint8)) for h, p in zip(hs, ps)])
        c.get(ns, hs)
        with pytest.raises(Exception):
            c.call("no-such-op")
    status, body = daemon.http("/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = daemon.http("/metrics")
    text = body.decode()
    assert status == 200
    assert 'kvstore_blocks{tier="host"} 2.0' in text
    assert 'kvstore_hits_total{tier="host"} 2.0' in text
    assert 'kvstore_errors_total{type="ProtocolError"} 1.0' in text
    assert "kvstore_evictions_total" in text and "kvstore_misses_total" in text
    stats = daemon.stats()
    assert stats["blocks"] == 2 and stats["gpu"]["available"] is False and stats["gpu"]["reason"]
    assert daemon.http("/clear", method="POST")[0] == 200
    assert daemon.stats()["blocks"] == 0


def test_a_serving_daemon_has_frozen_its_startup_objects_and_collects_young_objects_less_often(daemon):
    """server/daemon.py's tune_gc ran once the daemon served: its stats and /metrics say so."""
    from kvstore.server.daemon import GC_GEN0_THRESHOLD, GC_NO_FULL

    gc_stats = daemon.stats()["gc"]
    assert gc_stats["threshold"][0] == GC_GEN0_THRESHOLD > 700
    assert gc_stats["threshold"][2] == GC_NO_FULL  # no full collection
    assert gc_stats["frozen_at_start"] > 10_000  # modules, classes, functions: everything startup made
    assert len(gc_stats["collections"]) == 3
    assert [set(p) for p in gc_stats["pauses"]] == [{"collections", "longest_ms", "total_s"}] * 3
    text = daemon.http("/metrics")[1].decode()
    assert 'python_gc_collections_total{generation="0"}' in text
    assert 'kvstore_gc_pause_seconds_total{generation="2"}' in text
    assert 'kvstore_gc_pause_longest_seconds{generation="0"}' in text
    # the GIL asked for after 0.5 ms, not 5 (SWITCH_INTERVAL_S: a thread taking it back at once held the
    # loop that long at each of its LMDB calls)
    from kvstore.server.daemon import SWITCH_INTERVAL_S

    assert daemon.stats()["switch_interval_s"] == SWITCH_INTERVAL_S < 0.005
    # and the event loop's stalls (server/stalls.py), from its ready line on
    assert set(daemon.stats()["event_loop_stalls"]) == {"stalls", "total_s", "longest_ms", "recent"}
    assert "kvstore_event_loop_stalls_total" in text and "kvstore_event_loop_stall_longest_seconds" in text


@pytest.mark.parametrize("choice,serves_on", [("auto", "uvloop"), ("asyncio", "asyncio")])
def test_the_daemon_serves_on_the_event_loop_configured(daemon_factory, tmp_path, choice, serves_on):
    """[server] event_loop: uvloop (a dependency) unless asyncio's own is asked for; both serve."""
    config = tmp_path / "loop.toml"
    config.write_text(f'[server]\nevent_loop = "{choice}"\n')
    d = daemon_factory("--config", str(config))
    assert d.stats()["event_loop"] == serves_on
    hashes, parents = chain(7, 3)
    with KVClient(d.socket_path) as c:
        ns = c.register(namespace(block_bytes=4096))
        assert c.put(ns, [(h, p, np.full(4096, i, np.uint8)) for i, (h, p) in enumerate(zip(hashes, parents))]) == 3
        assert c.lookup(ns, hashes).hits == 3 and bytes(c.get(ns, hashes)[2]) == bytes([2]) * 4096


def test_stats_cli(daemon):
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--json", "--socket", daemon.socket_path],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["tiers"]["host"]["capacity_bytes"] == 64 << 20
    assert stats["policy"] == "attention"  # the default; the half-life it runs with now (eviction/halflife.py):
    assert stats["tiers"]["host"]["policy_half_life_s"] in (30.0, 240.0, 2000.0)
    human = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", daemon.socket_path],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert "host" in human.stdout and "capacity 64.0 MiB" in human.stdout


def test_stats_cli_reports_a_daemon_that_is_down(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", str(tmp_path / "none.sock")],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "cannot reach the kvstore daemon" in out.stderr


def test_sigterm_drains_and_cleans_up(daemon):
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        hs, ps = chain(7, 1)
        c.put(ns, [(hs[0], None, np.ones(NS.block_bytes, np.uint8))])
        arena = c.server_info["arena_path"]
        assert os.path.exists(arena)
        assert daemon.stop(signal.SIGTERM) == 0
        with pytest.raises(DaemonUnavailable):
            c.lookup(ns, hs)
    assert not os.path.exists(daemon.socket_path)
    assert not os.path.exists(arena)


def test_second_daemon_with_the_same_name_refuses_to_start(daemon, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "serve", "--name", daemon.name, "--socket",
                          str(tmp_path / "other.sock"), "--host-bytes", "16MiB", "--no-admin", "--no-disk"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "another kvstore daemon" in out.stderr
    with KVClient(daemon.socket_path) as c:
        assert c.ping()  # the first one is untouched


def test_client_reconnects_after_daemon_restart(daemon_factory, tmp_path):
    d = daemon_factory(name="restart-me")
    c = KVClient(d.socket_path, timeout_s=2)
    assert c.ping()
    d.stop()
    with pytest.raises(DaemonUnavailable):
        c.ping()
    d2 = daemon_factory(name="restart-me")
    assert d2.socket_path == d.socket_path
    assert c.ping()  # reconnects on the next call
    ns = c.register(NS)
    hs, _ = chain(8, 1)
    c.put(ns, [(hs[0], None, np.full(NS.block_bytes, 7, np.uint8))])  # must land in the new arena
    with KVClient(d2.socket_path) as fresh:
        assert np.array_equal(fresh.get(ns, hs)[0], np.full(NS.block_bytes, 7, np.uint8))
    c.close()


def test_ls_and_evict_cli(daemon):
    hs, ps = chain(9, 3)
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        c.put(ns, [(h, p, np.ones(NS.block_bytes, np.uint8)) for h, p in zip(hs, ps)])
    cli = lambda *a: subprocess.run([sys.executable, "-m", "kvstore.tools.cli", *a, "--socket", daemon.socket_path],  # noqa: E731
                                    cwd=ROOT, capture_output=True, text=True, timeout=30)
    listing = json.loads(cli("ls", "--json", "--ns", ns).stdout)
    assert listing["total"] == 3
    with KVClient(daemon.socket_path) as c:  # a reservation is a block of the listing's total too
        other, _ = chain(10, 1)
        c.reserve(c.register(NS), [(other[0], None)])
        rows, total = c.list_blocks(ns, limit=2)
        assert total == 4 and len(rows) == 2
    assert {b["hash"] for b in listing["blocks"]} == {h.hex() for h in hs}
    assert sorted(b["depth"] for b in listing["blocks"]) == [0, 1, 2]
    out = cli("evict", "--ns", ns, hs[1].hex())  # removes block 1 and its child
    assert out.returncode == 0 and "removed 2 blocks" in out.stdout
    with KVClient(daemon.socket_path) as c:
        assert c.lookup(ns, hs).hits == 1
    assert "1 of 1 blocks" in cli("ls").stdout
    assert daemon.check() == []


def test_arena_and_socket_are_private_to_the_user(daemon):
    with KVClient(daemon.socket_path) as c:
        arena = c.server_info["arena_path"]
        assert arena.startswith("/dev/shm/")
        assert os.stat(arena).st_mode & 0o777 == 0o600
        assert c.server_info["arena_bytes"] == 64 << 20  # the configured budget, whole pages
    assert os.stat(daemon.socket_path).st_mode & 0o777 == 0o600


def test_a_stopped_daemon_leaves_nothing_in_dev_shm(daemon_factory):
    """The lock is beside the socket (tests/test_local_security.py says why), not in /dev/shm."""
    d = daemon_factory()
    shm = f"/dev/shm/kvstore-{os.getuid()}-{d.name}"
    assert os.path.exists(shm) and os.path.exists(d.lock_path)
    assert d.stop() == 0
    assert not os.path.exists(shm) and not os.path.exists(d.lock_path)
    killed = daemon_factory()
    shm = f"/dev/shm/kvstore-{os.getuid()}-{killed.name}"
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(timeout=30)
    assert os.path.exists(shm), "a killed daemon cannot clean up"
    killed.cleanup()  # what a restart (or the test harness) does with a stale instance
    assert not os.path.exists(shm) and not os.path.exists(killed.lock_path)


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_large_batches_copy_on_threads_byte_exact(daemon, copy_threads):
    """Chunks of 8 x 1 MiB: big enough for the copy threads (PARALLEL_COPY_MIN_*), 3 of them split it."""
    big = Namespace("test-model", "bfloat16", 8, 2, 64, 16, 1 << 20)
    rng = np.random.default_rng(copy_threads)
    hs, ps = chain(40 + copy_threads, 24)
    payloads = [rng.integers(0, 256, big.block_bytes, dtype=np.uint8) for _ in hs]
    with KVClient(daemon.socket_path, copy_threads=copy_threads) as c:
        ns = c.register(big)
        assert c.put(ns, list(zip(hs, ps, payloads)), chunk=8) == len(hs)
        outs = [np.zeros(big.block_bytes, np.uint8) for _ in hs]
        assert c.get_into(ns, hs, outs, chunk=8) == [True] * len(hs)
        assert all(np.array_equal(a, b) for a, b in zip(outs, payloads))
        assert (c.transport.pool is not None) == (copy_threads > 1), "the threaded path ran (or not) as configured"
        # A short destination in the first chunk: ValueError, and no pin stays behind, also
        # none of the second chunk, whose acquire was in flight during the failed copy.
        short = [np.zeros(big.block_bytes, np.uint8) for _ in hs]
        short[5] = short[5][:-1]
        with pytest.raises(ValueError):
            c.get_into(ns, hs, short, chunk=8)
        assert c.remove(ns, [hs[0]]) == len(hs), "every block released: the whole chain can be removed"
        # A wrong-sized payload in the first chunk: nothing is committed, and the second
        # chunk's reservation (in flight during the failed copy) is aborted too.
        bad = list(payloads)
        bad[5] = bad[5][:-1]
        with pytest.raises(ValueError):
            c.put(ns, list(zip(hs, ps, bad)), chunk=8)
        assert c.lookup(ns, hs).hits == 0
        assert c.put(ns, list(zip(hs, ps, payloads)), chunk=8) == len(hs), "no reservation left behind"


def test_copy_threads_must_be_positive():
    with pytest.raises(ValueError, match="copy_threads"):
        KVClient("/nonexistent.sock", copy_threads=0, connect=False)


def test_the_chain_comes_from_the_config_and_stats_say_why_a_tier_is_absent(daemon_factory, tmp_path):
    """[gpu] on the emulated device puts a gpu tier above host and disk; without it, stats give the reason.
    A CPU client's puts land in the host arena and its reads are served from there."""
    conf = tmp_path / "chain.toml"
    conf.write_text('[gpu]\nenabled = true\ndevice = "cpu"\ncapacity = "2MiB"\npage_size = "64KiB"\n')
    d = daemon_factory("--config", str(conf), "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "16MiB",
                       disk=True)
    stats = d.stats()
    assert stats["chain"] == ["gpu", "host", "disk"]
    assert stats["tiers"]["gpu"]["capacity_bytes"] == 2 << 20 and stats["tiers"]["gpu"]["device"] == "cpu"
    assert stats["tiers"]["remote"]["absent"] == "not configured"
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        hs, ps = chain(7, 4)
        payloads = [np.full(NS.block_bytes, i, np.uint8) for i in range(4)]
        c.put(ns, [(h, p, x) for h, p, x in zip(hs, ps, payloads)])
        assert c.lookup(ns, hs).tiers == ("host",) * 4
        assert all(np.array_equal(a, b) for a, b in zip(c.get(ns, hs), payloads))
    assert d.http("/check")[0] == 200 and json.loads(d.http("/check")[1])["ok"] is True
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", d.socket_path],
                         capture_output=True, text=True, check=True).stdout
    assert "chain gpu -> host -> disk" in out and "remote absent: not configured" in out
    assert d.stop() == 0

    plain = daemon_factory()  # the defaults: no [gpu], --no-disk
    absent = plain.stats()["tiers"]
    assert plain.stats()["chain"] == ["host"]
    assert "enabled = false" in absent["gpu"]["absent"] and "disabled" in absent["disk"]["absent"]
    cuda = tmp_path / "cuda.toml"
    cuda.write_text('[gpu]\nenabled = true\ndevice = "cuda:0"\n')
    no_cuda = daemon_factory("--config", str(cuda))  # starts on a host without CUDA, gpu tier left out
    reason = no_cuda.stats()["tiers"]["gpu"].get("absent")
    ok, why = cuda_available()
    assert reason == (None if ok else why)


def test_spin_us_must_be_a_bounded_number_of_microseconds():
    for bad in (-1, "50", True, 1e9):
        with pytest.raises(ValueError, match="spin_us"):
            KVClient("/nonexistent.sock", spin_us=bad, connect=False)


def test_a_reply_is_polled_for_briefly_then_awaited_asleep_within_the_timeout(daemon):
    """The client polls for a reply for `spin_us`, then sleeps in the kernel: a reply that comes after the
    spin is still read whole, and a daemon that does not answer is unavailable after the timeout, not
    waited for in the spin."""
    import threading
    import time

    with KVClient(daemon.socket_path, timeout_s=0.5, spin_us=200) as c:
        ns = c.register(NS)
        hs, ps = chain(9, 4)
        payloads = [np.full(NS.block_bytes, i, np.uint8) for i in range(4)]
        assert c.put(ns, list(zip(hs, ps, payloads))) == 4
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # answers 0.1 s late: long after the 200 us spin
        threading.Timer(0.1, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
        t0 = time.monotonic()
        assert c.lookup(ns, hs).hits == 4
        assert time.monotonic() - t0 >= 0.09
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable):
                c.ping()
            assert 0.45 <= time.monotonic() - t0 < 2.0
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        outs = [np.empty(NS.block_bytes, np.uint8) for _ in hs]
        assert c.get_into(ns, hs, outs) == [True] * 4  # reconnected
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    with KVClient(daemon.socket_path, spin_us=0) as c:  # no spin: the same replies
        assert c.lookup(ns, hs).hits == 4


def test_polling_reads_what_arrived_and_gives_up_after_the_spin():
    """`_arrived`: what is there is read at once, nothing is waited for `spin_s` at most, a closed peer is
    EOF."""
    import socket
    import time

    from kvstore.client import _arrived

    a, b = socket.socketpair()
    a.settimeout(5)  # the client's sockets: timeout mode, non-blocking underneath
    buf = bytearray(16)
    try:
        b.sendall(b"reply")
        assert _arrived(a, memoryview(buf), 0.0) == 5 and bytes(buf[:5]) == b"reply"
        t0 = time.perf_counter()
        assert _arrived(a, memoryview(buf), 0.02) == 0
        assert 0.02 <= time.perf_counter() - t0 < 1.0
        b.close()
        with pytest.raises(EOFError):
            _arrived(a, memoryview(buf), 0.02)
    finally:
        a.close()
        b.close()


def test_a_connection_storm_is_queued_not_refused(daemon):
    """Protocol fuzzing: local connects failed with EAGAIN under connection storms (the Unix
    listener's backlog was asyncio's 100). With the daemon stopped (it accepts nothing), 600 clients
    connect at once, as many engine workers starting together would: every connect is queued, and
    once the daemon runs again every connection is served."""
    import socket

    from tests.helpers import frame

    socks, refused = [], 0
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(600):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)  # what the client does: a connect that cannot queue fails at once (EAGAIN)
            try:
                s.connect(daemon.socket_path)
                socks.append(s)
            except BlockingIOError:
                refused += 1
                s.close()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    try:
        assert refused == 0
        for i, s in enumerate(socks):
            s.sendall(frame([i, "ping", {}]))
        for s in socks:
            assert s.recv(64)  # served
    finally:
        for s in socks:
            s.close()
    assert daemon.check() == []


def test_a_client_connect_refused_with_eagain_is_retried(daemon, monkeypatch):
    """A Unix connect with a timeout fails at once with EAGAIN while the listen queue is full: the client
    retries within its timeout instead of reporting the daemon unavailable."""
    import socket

    import kvstore.transports as transports

    refusals = []

    class Busy(socket.socket):
        def connect(self, address):
            if len(refusals) < 3:
                refusals.append(address)
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return super().connect(address)

    monkeypatch.setattr(transports.socket, "socket", Busy)
    with KVClient(daemon.socket_path, timeout_s=5) as c:
        assert c.ping()
    assert len(refusals) == 3
