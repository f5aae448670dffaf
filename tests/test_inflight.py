"""Waiting for in-flight blocks (kvstore/waits.py) through a real daemon: a consumer's wait ends at
commit, abort, the producer's lease, a withdrawn announcement, or the timeout; never on uncommitted bytes."""

import threading
import time

import pytest

from kvstore.client import KVClient
from kvstore.errors import ProtocolError
from tests.helpers import chain, namespace

NS = namespace("inflight-model")


class Waiter:
    """A consumer's wait on its own connection, in a thread; `result` once it answered."""

    def __init__(self, sock: str, hashes, timeout_s: float, appear: bool = False) -> None:
        self.client = KVClient(sock, name="waiter")
        self.ns = self.client.register(NS)
        self.result = None
        self.elapsed_s = None
        self._t = threading.Thread(target=self._run, args=(hashes, timeout_s, appear), daemon=True)
        self._t.start()

    def _run(self, hashes, timeout_s, appear):
        t0 = time.monotonic()
        self.result = self.client.wait_committed(self.ns, hashes, timeout_s, appear=appear)
        self.elapsed_s = time.monotonic() - t0

    def join(self, timeout=20.0):
        self._t.join(timeout)
        assert not self._t.is_alive(), "the wait did not end"
        self.client.close()
        return self.result


def blocked_waits(daemon) -> int:
    """How often the daemon's waits have blocked: it counts one before each block, never after."""
    return daemon.stats()["counters"].get("inflight_waits", 0)


def until_blocked(daemon, before: int, timeout_s: float = 10.0) -> None:
    """Return once a wait has blocked in the daemon since `blocked_waits` was `before`, so that what the
    test does next happens during the wait (a fixed sleep is too short on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while blocked_waits(daemon) <= before:
        assert time.monotonic() < deadline, f"no wait blocked in the daemon within {timeout_s} s"
        time.sleep(0.01)


def fill(client: KVClient, ns: str, hashes, value: int) -> None:
    exts = client.reserve(ns, [(h, p) for h, p in zip(hashes, [None] + list(hashes[:-1]))])
    arena = client.arena
    for e in exts:
        for off, length in e:
            arena[off : off + length] = value


def test_a_wait_ends_at_commit_and_the_bytes_are_the_committed_ones(daemon):
    hs, _ = chain(1, 4)
    with KVClient(daemon.socket_path) as producer:
        ns = producer.register(NS)
        fill(producer, ns, hs, 7)
        assert producer.acquire_inflight(ns, hs)[2] == 4  # all four are in flight
        n = blocked_waits(daemon)
        waiter = Waiter(daemon.socket_path, hs, timeout_s=10)
        until_blocked(daemon, n)
        assert waiter.result is None, "answered before commit"
        with KVClient(daemon.socket_path) as other:  # the daemon serves others meanwhile
            other.register(NS)
            assert other.lookup(ns, hs).hits == 0
        producer.commit(ns, hs[:2])
        producer.commit(ns, hs[2:])
        res = waiter.join()
        assert (res.ready, res.reason) == (4, "done") and res.waited == (0, 1, 2, 3)
        with KVClient(daemon.socket_path) as reader:
            reader.register(NS)
            out = reader.get(ns, hs)
            assert all(p is not None and (p == 7).all() for p in out)
    assert daemon.check() == []


def test_a_wait_ends_early_at_abort_and_at_the_producers_lease(daemon):
    hs, _ = chain(2, 3)
    producer = KVClient(daemon.socket_path)
    ns = producer.register(NS)
    fill(producer, ns, hs, 1)
    producer.commit(ns, hs[:1])
    n = blocked_waits(daemon)
    waiter = Waiter(daemon.socket_path, hs, timeout_s=30)
    until_blocked(daemon, n)
    producer.abort(ns, hs[1:])
    res = waiter.join()
    assert (res.ready, res.reason) == (1, "aborted") and waiter.elapsed_s < 5

    hs2, _ = chain(3, 3)
    fill(producer, ns, hs2, 2)
    n = blocked_waits(daemon)
    waiter = Waiter(daemon.socket_path, hs2, timeout_s=30)
    until_blocked(daemon, n)
    producer.close()  # the lease: its reservations go with the connection
    res = waiter.join()
    assert (res.ready, res.reason) == (0, "aborted") and waiter.elapsed_s < 5
    assert daemon.check() == []


def test_announced_blocks_are_waited_for_and_the_wait_ends_when_the_announcer_goes(daemon):
    hs, _ = chain(4, 4)
    producer = KVClient(daemon.socket_path)
    ns = producer.register(NS)
    producer.expect(ns, hs)
    with KVClient(daemon.socket_path) as c:
        c.register(NS)
        ext, _, inflight = c.acquire_inflight(ns, hs)
        assert ext == [None] * 4 and inflight == 4
    n = blocked_waits(daemon)
    waiter = Waiter(daemon.socket_path, hs, timeout_s=30)
    until_blocked(daemon, n)
    fill(producer, ns, hs[:2], 3)
    n = blocked_waits(daemon)
    producer.commit(ns, hs[:2])
    until_blocked(daemon, n)  # the wait moved on to the third block: its end is then "aborted", not "absent"
    producer.close()  # killed mid-prefill: the rest never comes
    res = waiter.join()
    assert (res.ready, res.reason) == (2, "aborted") and res.waited == (0, 1) and waiter.elapsed_s < 5

    with KVClient(daemon.socket_path) as p2:
        p2.register(NS)
        hs3, _ = chain(5, 2)
        p2.expect(ns, hs3)
        n = blocked_waits(daemon)
        waiter = Waiter(daemon.socket_path, hs3, timeout_s=30)
        until_blocked(daemon, n)
        p2.withdraw(ns, hs3)
        res = waiter.join()
        assert (res.ready, res.reason) == (0, "aborted")
    assert daemon.check() == []
    assert daemon.stats()["counters"]["inflight_waits"] >= 3


def test_absent_blocks_end_a_wait_at_once_unless_asked_to_appear(daemon):
    hs, _ = chain(6, 2)
    waiter = Waiter(daemon.socket_path, hs, timeout_s=30)
    res = waiter.join()
    assert (res.ready, res.reason) == (0, "absent") and waiter.elapsed_s < 2

    waiter = Waiter(daemon.socket_path, hs, timeout_s=0.3, appear=True)
    res = waiter.join()
    assert (res.ready, res.reason) == (0, "timeout") and 0.25 < waiter.elapsed_s < 3

    n = blocked_waits(daemon)
    waiter = Waiter(daemon.socket_path, hs, timeout_s=30, appear=True)
    until_blocked(daemon, n)
    with KVClient(daemon.socket_path) as producer:
        ns = producer.register(NS)
        fill(producer, ns, hs, 9)
        producer.commit(ns, hs)
    res = waiter.join()
    assert (res.ready, res.reason) == (2, "done") and res.waited == (0, 1)
    assert daemon.check() == []


def test_bad_wait_arguments_are_refused(daemon):
    hs, _ = chain(7, 1)
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        with pytest.raises(ProtocolError):
            c.call("wait", ns=ns, hashes=hs, timeout_s=-1)
        with pytest.raises(ProtocolError):
            c.call("wait", ns=ns, hashes=hs, timeout_s=1e9)
        with pytest.raises(ProtocolError):
            c.call("wait", ns=ns, hashes=hs)
        assert c.ping()


def test_a_pending_wait_does_not_hold_up_the_drain(daemon):
    hs, _ = chain(8, 2)
    producer = KVClient(daemon.socket_path)
    ns = producer.register(NS)
    producer.expect(ns, hs)
    n = blocked_waits(daemon)
    waiter = Waiter(daemon.socket_path, hs, timeout_s=60)
    until_blocked(daemon, n)
    t0 = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - t0 < 8  # the drain allows 10 s for requests in progress: the wait answered first
    res = waiter.join()
    assert (res.ready, res.reason) == (0, "shutdown")
    producer.close()
