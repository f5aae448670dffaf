"""The disk tier against a real daemon process: SIGKILL in a write storm, SIGTERM restarts.

Acknowledged (tiers/disk.py): a block is durable once its LMDB record is
committed. A chain is servable from its root only, so after a crash the blocks
a restart must serve are the *prefix-closed* acknowledged set: records whose
ancestors all have records too (a block demoted before its parent, whose parent
was still only in the host tier at the kill, is an orphan and is dropped).

Each round: start the daemon on the same disk folder, verify every block of
the previous round's acknowledged set is served byte-identical (and nothing
ever served differs from what was put), run a put storm from a thread, and
SIGKILL the daemon after a random number of acknowledged puts. The index is
then opened read-only (it must open cleanly) to get the acknowledged set.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading

import lmdb
import msgpack
import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from tests.helpers import chain_hashes, namespace, payload_for, poll
from kvstore.tools.harness.daemon_proc import start_daemon

BLOCK = 64 * 1024
NS = namespace("crash-model", BLOCK, dtype="bf16")


def acknowledged(disk_path: str, ns_id: str = NS.id) -> tuple[dict[bytes, bytes | None], list[bytes]]:
    """Open the index read-only (it must open cleanly): records as {hash: parent}, and the prefix-closed ones."""
    env = lmdb.open(os.path.join(disk_path, "index.lmdb"), subdir=True, readonly=True, max_dbs=4, lock=True)
    try:
        parents = {}
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            for key, raw in txn.cursor():
                rec_ns, h = msgpack.unpackb(key)
                assert rec_ns == ns_id
                parents[h] = msgpack.unpackb(raw)["p"]
    finally:
        env.close()
    closed: dict[bytes, bool] = {}

    def servable(h: bytes) -> bool:
        path = []
        while h not in closed:
            path.append(h)
            p = parents.get(h, ...)
            if p is ...:
                closed[h] = False
                break
            if p is None:
                closed[h] = True
                break
            h = p
        result = closed[h]
        for x in path:
            closed[x] = result
        return result

    return parents, [h for h in parents if servable(h)]


def exact(h: bytes, data: np.ndarray) -> bool:
    """Whether a block was served as what was put (this file's payloads)."""
    return np.array_equal(data, payload_for(h, BLOCK))


def put_payload(h: bytes) -> np.ndarray:
    return payload_for(h, BLOCK)


class Storm:
    """Puts random chains from a thread until the daemon dies; counts acknowledged puts.

    With `read_from`, it also reads back random chains (promotions, record deletions, evictions
    under a small disk: slot reuse) and records any served block that `right(hash, bytes)` refuses.
    `ns`, `payload` (a hash's block) and `right`: this file's unless given (tests/test_compression_crash.py).
    """

    def __init__(self, socket_path: str, first_salt: int, read_from: list[list[bytes]] | None = None,
                 ns: Namespace = NS, payload=put_payload, right=exact) -> None:
        self.client = KVClient(socket_path=socket_path, timeout_s=10)
        self.ns_id = self.client.register(ns)
        self.salt = first_salt
        self.read_from = read_from
        self.payload, self.right = payload, right
        self.chains: list[list[bytes]] = []
        self.acked = 0
        self.reads = 0
        self.wrong: list[bytes] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rng = random.Random(self.salt)
        try:
            while True:
                hashes = chain_hashes(self.salt, rng.randint(1, 6))
                self.salt += 1
                self.chains.append(hashes)
                self.client.put(self.ns_id, [(h, p, self.payload(h)) for h, p in zip(hashes, [None] + hashes[:-1])])
                self.acked += 1
                if self.read_from is not None and rng.random() < 0.5:
                    pick = rng.choice(self.read_from + self.chains)
                    got = self.client.get(self.ns_id, pick)
                    self.wrong += [h for h, data in zip(pick, got) if data is not None and not self.right(h, data)]
                    self.reads += 1
        except (KVStoreError, OSError) as exc:  # the daemon was killed under us
            self.error = exc


def verify(socket_path: str, must_serve: list[bytes], chains: list[list[bytes]], ns: Namespace = NS,
           right=exact) -> int:
    """Every block of `must_serve` is served and `right`, and nothing of `chains` is served wrong; returns the
    number of blocks served. Chains are read root first (a deep block alone is not promoted)."""
    must = set(must_serve)
    served = 0
    with KVClient(socket_path=socket_path, timeout_s=30) as client:
        ns_id = client.register(ns)
        for hashes in chains:
            for h, data in zip(hashes, client.get(ns_id, hashes)):
                if data is None:
                    assert h not in must, f"acknowledged block {h.hex()[:16]} is not served after the restart"
                    continue
                served += 1
                must.discard(h)
                assert right(h, data), f"block {h.hex()[:16]} served with wrong bytes"
    assert not must, f"{len(must)} acknowledged blocks belong to no chain the test put"
    return served


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True], ids=["puts", "puts+reads+small-disk"])
def test_kill_9_during_a_write_storm_then_restart(tmp_path, mixed):
    """`puts`: a disk large enough for everything. `puts+reads+small-disk`: reads promote blocks
    (record deletions) and a 6 MiB disk (96 blocks) evicts, so slots are reused under the kills."""
    disk_path = str(tmp_path / "disk")
    disk_blocks = 96 if mixed else 4096
    args = ("--disk-path", disk_path, "--disk-bytes", str(disk_blocks * BLOCK))
    rng = random.Random(1234 + mixed)
    must_serve: list[bytes] = []
    all_chains: list[list[bytes]] = []
    total_acknowledged = 0
    for round_no in range(5):
        d = start_daemon(tmp_path, *args, host_bytes="2MiB", page_bytes="64KiB", disk=True)
        try:
            verify(d.socket_path, must_serve, all_chains)
            assert d.check() == []
            stats = d.stats()["tiers"]["disk"]
            assert stats["checksum_failures"] == 0, "a torn block reached the index"
            assert stats["used_bytes"] <= stats["capacity_bytes"]
            storm = Storm(d.socket_path, 1000 * (round_no + 1), read_from=list(all_chains) if mixed else None)
            target = rng.randint(20, 120)
            poll(lambda: storm.acked >= target or storm.error is not None, 60, f"{target} acknowledged puts")
            assert storm.error is None, storm.error
            d.proc.send_signal(signal.SIGKILL)
            assert d.proc.wait(timeout=30) == -signal.SIGKILL
            storm.thread.join(timeout=30)
            assert not storm.thread.is_alive()
            storm.client.close()
            assert storm.wrong == [], "wrong bytes served during the storm"
        finally:
            if d.alive():
                d.stop(signal.SIGKILL)
            d.cleanup()
        all_chains += storm.chains
        records, must_serve = acknowledged(disk_path)
        total_acknowledged += len(must_serve)
        assert set(must_serve) <= set(records)
        assert len(records) <= disk_blocks
        print(f"round {round_no}: killed after {storm.acked} puts, {storm.reads} reads; {len(records)} records, "
              f"{len(must_serve)} servable, {len(records) - len(must_serve)} orphans")
    assert total_acknowledged > 50, "the storms never reached the disk: the test proves nothing"
    # A clean stop of a daemon whose arena is not kept (host.persistent = false) writes the host tier
    # down: a SIGTERM restart serves everything the daemon held (as far as the disk holds it). A kept
    # arena serves it from the arena: tests/test_host_restart.py.
    args += ("--no-persistent-host",)
    d = start_daemon(tmp_path, *args, host_bytes="2MiB", page_bytes="64KiB", disk=True)
    try:
        verify(d.socket_path, must_serve, all_chains)
        with KVClient(socket_path=d.socket_path) as client:
            ns_id = client.register(NS)
            held = [h for c in all_chains for h, t in zip(c, client.lookup(ns_id, c).tiers)]
        assert d.check() == []
        assert d.stop(signal.SIGTERM) == 0
        _, after_stop = acknowledged(disk_path)
        if len(held) <= disk_blocks:
            assert set(held) <= set(after_stop)
        else:
            assert len(after_stop) >= disk_blocks - 6  # full, but for a chain that did not fit
        d = start_daemon(tmp_path, *args, host_bytes="2MiB", page_bytes="64KiB", disk=True)
        verify(d.socket_path, after_stop, all_chains)
        assert d.check() == []
        assert d.stats()["tiers"]["disk"]["checksum_failures"] == 0
    finally:
        if d.alive():
            assert d.stop(signal.SIGTERM) == 0


def test_daemon_reports_disk_tier_stats_and_metrics(tmp_path):
    d = start_daemon(tmp_path, "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "32MiB",
                     host_bytes="1MiB", page_bytes="64KiB", disk=True)
    try:
        chains = [chain_hashes(s, 4) for s in range(1, 11)]  # 40 blocks, the host tier holds 16
        with KVClient(socket_path=d.socket_path) as client:
            ns_id = client.register(NS)
            for hashes in chains:
                client.put(ns_id, [(h, p, payload_for(h, BLOCK)) for h, p in zip(hashes, [None] + hashes[:-1])])
            assert client.lookup(ns_id, chains[0]).tiers == ("disk",) * 4  # lookups report disk hits
            got = client.get(ns_id, chains[0])
            assert all(np.array_equal(g, payload_for(h, BLOCK)) for g, h in zip(got, chains[0]))
            disk = client.stats()["tiers"]["disk"]
        assert disk["demotions_in"] >= 24 and disk["promotions_out"] == 4 and disk["hits"] == 4
        assert disk["checksum_failures"] == 0 and disk["direct_io"] is True
        assert disk["used_bytes"] <= disk["capacity_bytes"] == 32 << 20
        status, body = d.http("/metrics")
        text = body.decode()
        assert status == 200
        assert 'kvstore_demotions_total{tier="disk"}' in text and 'kvstore_promotions_total{tier="host"} 4.0' in text
        assert "kvstore_disk_checksum_failures_total 0.0" in text
        assert 'kvstore_capacity_bytes{tier="disk"}' in text
        assert f'kvstore_capacity_blocks{{tier="disk"}} {float(disk["max_blocks"])}' in text and disk["max_blocks"] >= 1
        human = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", d.socket_path],
                               capture_output=True, text=True, timeout=30)
        assert f"capacity 32.0 MiB, {disk['max_blocks']} blocks" in human.stdout  # (the disk tier's cap too)
        assert d.check() == []
    finally:
        assert d.stop(signal.SIGTERM) == 0


def test_reads_do_not_make_blocks_less_durable(tmp_path):
    """Tiers are inclusive downward: a block promoted from disk keeps its disk record, so a kill -9
    after reads loses nothing that was on disk, and demoting the unchanged block again writes nothing.
    (The arena is not kept here: the first stop writes every block down, the restarts read the disk.)"""
    args = ("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "32MiB", "--no-persistent-host")
    chains = [chain_hashes(s, 4) for s in range(1, 11)]  # 40 blocks; the host tier holds 16
    d = start_daemon(tmp_path, *args, host_bytes="1MiB", page_bytes="64KiB", disk=True)
    try:
        with KVClient(socket_path=d.socket_path) as client:
            ns_id = client.register(NS)
            for hashes in chains:
                client.put(ns_id, [(h, p, payload_for(h, BLOCK)) for h, p in zip(hashes, [None] + hashes[:-1])])
        assert d.stop(signal.SIGTERM) == 0  # everything reaches the disk
        d = start_daemon(tmp_path, *args, host_bytes="1MiB", page_bytes="64KiB", disk=True, name=d.name)
        with KVClient(socket_path=d.socket_path) as client:
            ns_id = client.register(NS)
            assert all(client.lookup(ns_id, c).tiers == ("disk",) * 4 for c in chains)
            writes_before = client.stats()["tiers"]["disk"]["writes"]
            for hashes in chains + chains[:3]:  # promote all, so host blocks are demoted back
                assert all(np.array_equal(g, payload_for(h, BLOCK)) for g, h in zip(client.get(ns_id, hashes), hashes))
            stats = client.stats()
            in_host = sum(t == "host" for c in chains for t in client.lookup(ns_id, c).tiers)
        assert in_host == 16 and stats["tiers"]["disk"]["copies"] == 16
        assert stats["counters"]["disk_writes_saved"] >= 24  # every demotion after a read found its copy
        d.stop(signal.SIGKILL)
        d.proc.wait(timeout=30)
        assert stats["tiers"]["disk"]["writes"] == writes_before, "demoting an unchanged block rewrote it"
        d = start_daemon(tmp_path, *args, host_bytes="1MiB", page_bytes="64KiB", disk=True, name=d.name)
        assert verify(d.socket_path, [h for c in chains for h in c], chains) == 40
        assert d.check() == []
    finally:
        if d.alive():
            assert d.stop(signal.SIGTERM) == 0
        d.cleanup()
