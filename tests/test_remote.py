"""The remote tier on a real Mooncake Store cluster: two daemons on two "hosts" share chains.

Real parts only: the wheel's `mooncake_master`, each daemon a Mooncake client
contributing its own segment, TCP between network namespaces made by the test
(tools/harness/remote_env.py). Faults: the master killed and restarted, a peer daemon
killed -9, values written wrong under a block's key (exact and encoded), bad
configuration. Compression on the remote tier: blocks published encoded, decoded
by the other host, never served to a namespace that did not opt in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.codec import BlockLayout, Budget, decode, encode, from_float32
from kvstore.keys import Namespace
from kvstore.tools.harness.remote_env import Master, make_hosts, mooncake_or_skip, remote_config, remove_hosts
from kvstore.tools.harness.daemon_proc import ROOT, start_daemon
from tests.helpers import chain, namespace

NS = namespace("remote-test-model", 256 * 1024)


LAYOUT = BlockLayout(2, 2, 16, 64, "bfloat16", "HKTVND")  # what "cpu/LBHNC" is to the codec
LOSSY = Namespace("remote-lossy-model", "bfloat16", 2, 2, 64, 16, LAYOUT.block_bytes, layout="cpu/LBHNC",
                  codec="mixed")
EXACT = Namespace(**{**LOSSY.to_dict(), "codec": ""})
MIXED_BITS = [[[8, 4], [4, 2]], [[3, 2], [4, 3]]]  # per layer, KV head: (key, value) bits


def compressing_config(tmp_path, master, **remote) -> str:
    """remote_config (with `remote`'s keys) plus `[compression] remote = true` with the profile "mixed"
    (its first block exact)."""
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / "mixed.json").write_text(json.dumps({"format": "kvstore-codec-profile/1", "name": "mixed",
                                                   "bits": MIXED_BITS, "sink_blocks": 1}))
    path = remote_config(tmp_path / "remote.toml", master, **remote)
    with open(path, "a") as f:
        f.write(f"[compression]\nremote = true\nprofile_dir = {json.dumps(str(folder))}\n")
    return path


def kv_payloads(seed: int, n: int) -> list[np.ndarray]:
    """bfloat16 KV blocks (normal values: what the codec is for) as bytes."""
    rng = np.random.default_rng(seed)
    return [from_float32(rng.standard_normal(LAYOUT.block_bytes // 2).astype(np.float32), "bfloat16")
            for _ in range(n)]


def lossy(payload: np.ndarray) -> np.ndarray:
    """What an engine that opted into "mixed" gets back for a block past the sink."""
    return decode(encode(payload, LAYOUT, Budget(np.array(MIXED_BITS))), LAYOUT)


def chain_payloads(seed: int, n: int):
    """(hashes, parents, payloads) of a chain (tests/helpers.py), random payloads drawn from the seed."""
    hs, ps = chain(seed, n)
    payloads = [np.random.default_rng([seed, i]).integers(0, 256, NS.block_bytes, dtype=np.uint8) for i in range(n)]
    return hs, ps, payloads


def put_chain(d, seed: int, n: int):
    hs, parents, payloads = chain_payloads(seed, n)
    with d.client() as c:
        ns = c.register(NS)
        assert c.put(ns, list(zip(hs, parents, payloads))) == n
    return ns, hs, payloads


def wait_counter(d, name: str, at_least: int, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = d.stats()
        if stats["counters"].get(name, 0) >= at_least or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def mooncake():
    mooncake_or_skip()


@pytest.fixture
def two_hosts(mooncake):
    hosts = make_hosts()
    yield hosts
    remove_hosts(hosts)


@pytest.fixture
def started(tmp_path):
    procs: list = []
    yield procs
    # daemons before masters: a daemon leaving unmounts its segment, which waits out its retries on a dead master
    for p in sorted(reversed(procs), key=lambda p: not hasattr(p, "stop")):
        if hasattr(p, "stop"):
            if p.alive():
                p.stop(signal.SIGTERM, timeout=30)
            p.cleanup()
        else:
            p.kill()


def test_two_hosts_share_chains_through_mooncake(tmp_path, two_hosts, started):
    a, b = two_hosts
    master = Master(a.prefix, a.addr, log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)
    da = start_daemon(tmp_path, "--config", cfg, name="hostA", prefix=a.prefix, log_path=str(tmp_path / "a.log"))
    started.append(da)
    db = start_daemon(tmp_path, "--config", cfg, name="hostB", prefix=b.prefix, log_path=str(tmp_path / "b.log"))
    started.append(db)
    assert da.stats()["tiers"]["remote"]["local_hostname"] == a.addr
    assert db.stats()["tiers"]["remote"]["local_hostname"] == b.addr

    chains = [put_chain(da, seed, 6) for seed in range(3)]
    assert wait_counter(da, "remote_published_blocks", 18)["counters"]["remote_published_blocks"] == 18

    with db.client() as c:
        ns = c.register(NS)
        assert ns == chains[0][0]  # the same model on two hosts: the same namespace, hence shared keys
        other = c.register(Namespace("another-model", "bfloat16", 2, 2, 64, 16, 256 * 1024))
        for _, hs, payloads in chains:
            res = c.lookup(ns, hs)
            assert (res.hits, set(res.tiers)) == (6, {"remote"})
            got = c.get(ns, hs)
            assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, payloads))
            assert c.lookup(ns, hs).tiers == ("host",) * 6  # promoted into B's arena: the next read is local
        assert c.lookup(other, chains[0][1]).hits == 0  # nothing leaks across namespaces
        # a prefix held locally, the rest remotely: one lookup joins them
        hs, _, payloads = chain_payloads(7, 8)
        c.put(ns, list(zip(hs[:3], [None] + hs[:2], payloads[:3])))
    put_chain(da, 7, 8)
    wait_counter(da, "remote_published_blocks", 18 + 8)
    with db.client() as c:
        assert c.lookup(ns, hs).tiers == ("host",) * 3 + ("remote",) * 5
        assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, hs), payloads))
    sb = db.stats()
    assert sb["tiers"]["remote"]["hits"] >= 18 + 5
    assert sb["counters"]["remote_promotions"] == 18 + 5
    assert sb["counters"].get("remote_checksum_failures", 0) == 0
    assert da.check() == [] and db.check() == []
    metrics = db.http("/metrics")[1].decode()
    assert 'kvstore_hits_total{tier="remote"}' in metrics and 'kvstore_remote_errors_total{op="get"} 0.0' in metrics


def test_a_corrupt_or_foreign_remote_value_is_a_miss_never_a_wrong_block(tmp_path, mooncake, started):
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)
    db = start_daemon(tmp_path, "--config", cfg, name="reader", log_path=str(tmp_path / "b.log"))
    started.append(db)
    hs, parents, payloads = chain_payloads(3, 6)
    ns_id = NS.id
    # Another "host" publishes the chain with its own Mooncake client, but block 2's bytes change
    # after its checksum was taken (torn), and block 4's header names another parent (foreign).
    code = f"""
import numpy as np, pickle, sys
sys.path.insert(0, {str(ROOT)!r})
from kvstore.tiers import remote as r
hs, parents, payloads = pickle.loads(sys.stdin.buffer.read())
class Arena: buf = np.zeros(1 << 20, dtype=np.uint8)
t = r.MooncakeTier({master.url!r}, Arena(), segment_bytes=64 << 20, buffer_bytes=16 << 20)
items = []
for i, (h, p, data) in enumerate(zip(hs, parents, payloads)):
    ref = r.RemoteRef(r.object_key({ns_id!r}, h), {ns_id!r}, h, p)
    data = data.copy()
    if i == 2:
        header = r.pack_header(ref, data.nbytes, r.payload_checksum([data]))
        data[100] ^= 0xFF
        assert t.put_raw(ref.key, header + data.tobytes()) == 0
        continue
    if i == 4:
        ref = r.RemoteRef(ref.key, ref.ns_id, h, bytes(16))
    items.append((ref, [data], None))
assert all(c == 0 for c in t.put_from(items)), "put failed"
import time; time.sleep(30)
"""
    import pickle

    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    started.append(writer)
    writer.stdin.write(pickle.dumps((hs, parents, payloads)))
    writer.stdin.close()
    with db.client() as c:
        ns = c.register(NS)
        deadline = time.monotonic() + 20
        while c.lookup(ns, hs).hits < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.lookup(ns, hs).hits == 6  # all six keys exist in the cluster
        got = c.get(ns, hs)
        assert [g is not None for g in got] == [True, True, False, False, False, False]
        assert all(np.array_equal(g, p) for g, p in zip(got[:2], payloads[:2]))
        assert c.lookup(ns, hs).hits == 2  # the bad value is remembered: not offered (nor fetched) again
    assert db.stats()["counters"]["remote_checksum_failures"] >= 1
    assert db.check() == []


def test_master_down_local_service_goes_on_and_sharing_resumes(tmp_path, mooncake, started):
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)
    da = start_daemon(tmp_path, "--config", cfg, name="hostA", log_path=str(tmp_path / "a.log"))
    db = start_daemon(tmp_path, "--config", cfg, name="hostB", log_path=str(tmp_path / "b.log"))
    started += [da, db]
    ns, hs1, p1 = put_chain(da, 1, 4)
    wait_counter(da, "remote_published_blocks", 4)

    master.kill()
    ns, hs2, p2 = put_chain(da, 2, 4)  # commits do not wait on the dead cluster
    with da.client() as c:
        assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, hs1 + hs2), p1 + p2))  # local hits go on
    with db.client() as c:
        c.register(NS)
        t0 = time.monotonic()
        assert c.lookup(ns, hs1).hits == 0  # the cluster is gone: a miss, fast
        assert time.monotonic() - t0 < 2.0
    stats = wait_counter(da, "remote_publish_failed_blocks", 4)
    assert stats["counters"]["remote_publish_failed_blocks"] >= 4
    assert db.stats()["remote"]["errors"]["query"] >= 1
    assert 'kvstore_remote_errors_total{op="query"} 0.0' not in db.http("/metrics")[1].decode()

    started.append(Master(port=master.port, log_path=tmp_path / "master2.log").start())  # same address
    deadline = time.monotonic() + 30
    seed = 10
    while True:  # the clients reconnect by themselves; the new master knows only what is put from now on
        ns, hs3, p3 = put_chain(da, seed, 3)
        time.sleep(0.5)
        with db.client() as c:
            c.register(NS)
            if c.lookup(ns, hs3).hits == 3:
                assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, hs3), p3))
                break
        assert time.monotonic() < deadline, "sharing did not resume after the master came back"
        seed += 1
    assert da.check() == [] and db.check() == []


def test_a_killed_peer_is_a_clean_miss_on_the_other_host(tmp_path, two_hosts, started):
    a, b = two_hosts
    master = Master(a.prefix, a.addr, log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)
    da = start_daemon(tmp_path, "--config", cfg, name="hostA", prefix=a.prefix, log_path=str(tmp_path / "a.log"))
    db = start_daemon(tmp_path, "--config", cfg, name="hostB", prefix=b.prefix, log_path=str(tmp_path / "b.log"))
    started += [da, db]
    ns, hs, payloads = put_chain(da, 5, 6)
    wait_counter(da, "remote_published_blocks", 6)
    with db.client() as c:
        c.register(NS)
        assert c.lookup(ns, hs).hits == 6  # indexed on B; the bytes are in A's segment
        da.proc.kill()
        da.proc.wait()
        t0 = time.monotonic()
        got = c.get(ns, hs)
        took = time.monotonic() - t0
        # A's segment went with A: a miss (or, had Mooncake put a block elsewhere, the right bytes)
        assert all(g is None or np.array_equal(g, p) for g, p in zip(got, payloads))
        assert got[0] is None
        assert took < 10.0
        mine, my_hs, my_payloads = put_chain(db, 6, 3)  # B's own service goes on
        assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, my_hs), my_payloads))
    assert db.alive()
    counters = db.stats()["counters"]
    assert counters.get("remote_read_errors", 0) + counters.get("remote_checksum_failures", 0) >= 1
    assert db.check() == []


def test_bad_remote_config_is_a_clear_error_or_a_warning_when_not_required(tmp_path, mooncake):
    from kvstore.tools.harness.remote_env import free_port

    from kvstore.tiers.host import remove_stale_arena

    dead = f"mooncake://127.0.0.1:{free_port()}"
    arena = Path(f"/dev/shm/kvstore-{os.getuid()}-badremote")
    remove_stale_arena(str(arena))  # one left by an earlier version of this test would be adopted
    cmd = [sys.executable, "-m", "kvstore.tools.cli", "serve", "--name", "badremote", "--socket", str(tmp_path / "s.sock"),
           "--host-bytes", "16MiB", "--page-bytes", "64KiB", "--no-disk", "--no-admin"]
    t0 = time.monotonic()
    r = subprocess.run(cmd + ["--remote", dead], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cannot reach the Mooncake master at 127.0.0.1" in r.stderr
    assert time.monotonic() - t0 < 20  # not Mooncake's own 90 s of retries
    assert not arena.exists() and not Path(f"{arena}.index").exists()  # the arena this failed start created is gone
    # An arena a previous daemon kept is kept through a failed start, blocks and all.
    kept = start_daemon(tmp_path, name="keptarena", host_bytes="16MiB", log_path=str(tmp_path / "k.log"))
    hs, parents, payloads = chain_payloads(1, 2)
    with kept.client() as c:
        assert c.put(c.register(NS), list(zip(hs, parents, payloads))) == 2
    assert kept.stop(keep_arena=True) == 0
    r = subprocess.run([*cmd[:5], "keptarena", *cmd[6:], "--remote", dead], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and Path(f"/dev/shm/kvstore-{os.getuid()}-keptarena").exists()
    kept = start_daemon(tmp_path, name="keptarena", host_bytes="16MiB", log_path=str(tmp_path / "k2.log"))
    try:
        with kept.client() as c:
            got = c.get(c.register(NS), hs)
        assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, payloads))
    finally:
        assert kept.stop() == 0
    r = subprocess.run(cmd + ["--remote", "http://example:1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "mooncake://host:port" in r.stderr
    cfg = tmp_path / "optional.toml"
    cfg.write_text(f'[remote]\nkind = "mooncake"\nmaster = "{dead}"\nrequired = false\n')
    d = start_daemon(tmp_path, "--config", str(cfg), name="optional", log_path=str(tmp_path / "d.log"))
    try:
        stats = d.stats()
        assert stats["chain"] == ["host"] and "cannot reach the Mooncake master" in stats["tiers"]["remote"]["absent"]
        hs, parents, payloads = chain_payloads(1, 2)
        with d.client() as c:
            ns = c.register(NS)
            assert c.put(ns, list(zip(hs, parents, payloads))) == 2 and c.lookup(ns, hs).hits == 2
    finally:
        assert d.stop() == 0
    assert "remote tier left out" in (tmp_path / "d.log").read_text()


@pytest.mark.parametrize("publish", ["hit", "evicted", "none"])
def test_publish_policies(tmp_path, mooncake, started, publish):
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master, publish=publish)
    # a host tier of 8 blocks: a 12-block chain evicts (drops: no disk) its first blocks
    da = start_daemon(tmp_path, "--config", cfg, name="pub", host_bytes="2MiB", log_path=str(tmp_path / "a.log"))
    started.append(da)
    ns, hs, payloads = put_chain(da, 9, 4)
    time.sleep(0.5)
    assert da.stats()["counters"].get("remote_published_blocks", 0) == 0  # commits alone publish nothing here
    if publish == "hit":
        with da.client() as c:
            c.get(ns, hs[:2])
        assert wait_counter(da, "remote_published_blocks", 2)["counters"]["remote_published_blocks"] == 2
    elif publish == "evicted":
        put_chain(da, 10, 8)  # 12 blocks of 256 KiB in 2 MiB: 4 leave the arena
        stats = wait_counter(da, "remote_published_blocks", 4)
        assert stats["counters"]["remote_published_blocks"] >= 4
    else:
        with da.client() as c:
            c.get(ns, hs)
        put_chain(da, 10, 8)
        time.sleep(0.5)
        assert da.stats()["counters"].get("remote_published_blocks", 0) == 0
    assert da.check() == []


def test_a_blackholed_network_costs_bounded_misses_and_sharing_resumes(tmp_path, two_hosts, started):
    """Host A's link goes silent (packets vanish, nothing refuses): B's remote calls time out within
    their bound, later ones fail at once while one is stuck, B's local hits go on; the link back, sharing resumes."""
    a, b = two_hosts
    master = Master(a.prefix, a.addr, log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)  # timeout 1 s, transfer timeout 5 s
    da = start_daemon(tmp_path, "--config", cfg, name="hostA", prefix=a.prefix, log_path=str(tmp_path / "a.log"))
    db = start_daemon(tmp_path, "--config", cfg, name="hostB", prefix=b.prefix, log_path=str(tmp_path / "b.log"))
    started += [da, db]
    ns, mine, my_payloads = put_chain(db, 20, 3)  # B's own blocks
    ns, hs1, p1 = put_chain(da, 21, 4)
    wait_counter(da, "remote_published_blocks", 4)
    veth_a = subprocess.run(["ip", "-n", a.netns, "-o", "link", "show", "type", "veth"], capture_output=True,
                            text=True, check=True).stdout.split(":")[1].strip().split("@")[0]
    subprocess.run(["ip", "-n", a.netns, "link", "set", veth_a, "down"], check=True)
    try:
        with db.client(timeout_s=30) as c:
            c.register(NS)
            for _ in range(3):
                t0 = time.monotonic()
                assert c.lookup(ns, hs1).hits == 0
                assert time.monotonic() - t0 < 3.0  # the 1 s query timeout, then fail-fast while it is stuck
            assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, mine), my_payloads))
        stats = db.stats()
        assert stats["remote"]["errors"]["query"] >= 3
    finally:
        subprocess.run(["ip", "-n", a.netns, "link", "set", veth_a, "up"], check=True)
    deadline = time.monotonic() + 90
    with db.client() as c:
        while c.lookup(ns, hs1).hits < 4:
            assert time.monotonic() < deadline, "sharing did not resume after the link came back"
            time.sleep(0.5)
        assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, hs1), p1))
    assert db.check() == []


def test_compressed_blocks_are_published_encoded_and_decoded_by_the_other_host(tmp_path, two_hosts, started):
    a, b = two_hosts
    master = Master(a.prefix, a.addr, log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = compressing_config(tmp_path, master)
    da = start_daemon(tmp_path, "--config", cfg, name="zA", prefix=a.prefix, page_bytes="16KiB",
                      log_path=str(tmp_path / "a.log"))
    started.append(da)
    db = start_daemon(tmp_path, "--config", cfg, name="zB", prefix=b.prefix, page_bytes="16KiB",
                      log_path=str(tmp_path / "b.log"))
    started.append(db)
    hs, parents = chain(31, 4)
    payloads = kv_payloads(31, 4)
    with da.client() as c:  # the same prompt under the engine that opted in and one that did not
        for spec in (LOSSY, EXACT):
            assert c.put(c.register(spec), list(zip(hs, parents, payloads))) == 4
    counters = wait_counter(da, "remote_published_blocks", 8)["counters"]
    assert counters["remote_published_blocks"] == 8
    assert counters["remote_published_compressed_blocks"] == 3  # the sink block goes exact
    assert counters["remote_published_compressed_saved_bytes"] > 3 * LAYOUT.block_bytes // 2

    with db.client() as c:
        lossy_ns, exact_ns = c.register(LOSSY), c.register(EXACT)
        assert lossy_ns != exact_ns
        assert c.lookup(lossy_ns, hs).tiers == ("remote",) * 4
        (row,) = db.stats()["tiers"]["remote"]["compressed"].values()
        assert row["blocks"] == 3 and row["logical_bytes"] == 3 * LAYOUT.block_bytes and row["ratio"] > 2
        assert 'kvstore_compressed_stored_bytes{codec="mixed@' in db.http("/metrics")[1].decode()
        got = c.get(lossy_ns, hs)
        assert np.array_equal(got[0], payloads[0])  # the sink block: exact
        for g, p in zip(got[1:], payloads[1:]):
            assert np.array_equal(g, lossy(p)) and not np.array_equal(g, p)
        assert c.lookup(lossy_ns, hs).tiers == ("host",) * 4
        got = c.get(exact_ns, hs)  # the engine that did not opt in: every block exact
        assert all(np.array_equal(g, p) for g, p in zip(got, payloads))
    stats = db.stats()
    assert stats["counters"]["remote_promotions"] == 8
    assert stats["counters"].get("remote_checksum_failures", 0) == 0 and stats["tiers"]["remote"]["compressed"] == {}
    assert da.check() == [] and db.check() == []


def test_an_encoded_remote_value_that_does_not_verify_or_decode_is_a_miss(tmp_path, mooncake, started):
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = compressing_config(tmp_path, master)
    db = start_daemon(tmp_path, "--config", cfg, name="zreader", page_bytes="16KiB", log_path=str(tmp_path / "b.log"))
    started.append(db)
    hs, parents = chain(32, 5)
    payloads = kv_payloads(32, 5)
    # Another host publishes the chain with its own Mooncake client: blocks 0-1 as they should be (the
    # sink exact, then encoded), block 2 encoded values of garbage under a header that checks, block
    # 3 an encoded block whose header claims it is exact, block 4 fine (unreachable past the bad ones).
    code = f"""
import numpy as np, pickle, sys
sys.path.insert(0, {str(ROOT)!r})
from kvstore.compression import Compression
from kvstore.config import CompressionConfig
from kvstore.keys import Namespace
from kvstore.tiers import remote as r
hs, parents, payloads, spec = pickle.loads(sys.stdin.buffer.read())
ns = Namespace.from_dict(spec)
codec = Compression(CompressionConfig(remote=True, profile_dir={str(tmp_path / "profiles")!r})).codec(ns)

class Arena: buf = np.zeros(1 << 20, dtype=np.uint8)
t = r.MooncakeTier({master.url!r}, Arena(), segment_bytes=64 << 20, buffer_bytes=16 << 20)
items = []
for i, (h, p, data) in enumerate(zip(hs, parents, payloads)):
    if i == 0:
        items.append((r.RemoteRef(r.object_key(ns.id, h), ns.id, h, p), [data], None))
        continue
    ref = r.RemoteRef(r.object_key(ns.id, h, codec.profile.digest), ns.id, h, p, codec.tag, codec.stored_bytes,
                      codec.logical_bytes)
    if i == 2:
        junk = np.random.default_rng(2).integers(0, 256, codec.stored_bytes, dtype=np.uint8)
        assert t.put_raw(ref.key, r.pack_header(ref, junk.nbytes, r.payload_checksum([junk])) + junk.tobytes()) == 0
    elif i == 3:
        blob = codec.encode(data)
        exact = r.RemoteRef(ref.key, ns.id, h, p)
        assert t.put_raw(ref.key, r.pack_header(exact, blob.nbytes, r.payload_checksum([blob])) + blob.tobytes()) == 0
    else:
        items.append((ref, [data], codec))
assert all(c == 0 for c in t.put_from(items)), "put failed"
print("published", flush=True)
import time; time.sleep(30)
"""
    import pickle

    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    started.append(writer)
    writer.stdin.write(pickle.dumps((hs, parents, payloads, LOSSY.to_dict())))
    writer.stdin.close()
    assert writer.stdout.readline() == b"published\n"
    with db.client() as c:
        ns = c.register(LOSSY)
        assert c.lookup(ns, hs).hits == 5  # all five values exist in the cluster
        got = c.get(ns, hs)
        assert [g is not None for g in got] == [True, True, False, False, False]
        assert np.array_equal(got[0], payloads[0]) and np.array_equal(got[1], lossy(payloads[1]))
        assert c.lookup(ns, hs).hits == 2  # the bad values are remembered: not offered (nor fetched) again
        assert c.lookup(c.register(EXACT), hs).hits == 0  # the engine that did not opt in: none of them
    assert db.stats()["counters"]["remote_checksum_failures"] >= 1
    assert db.check() == []


def test_blocks_published_as_they_leave_the_arena_go_encoded_and_come_back_decoded(tmp_path, mooncake, started):
    """publish = "evicted": a block's bytes are copied out as it leaves the arena and published later,
    encoded where its namespace compresses; the same daemon finds them in the cluster afterwards."""
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = compressing_config(tmp_path, master, publish="evicted")
    d = start_daemon(tmp_path, "--config", cfg, name="zevict", host_bytes="128KiB", page_bytes="16KiB",
                     log_path=str(tmp_path / "d.log"))  # an arena of 8 blocks, no disk
    started.append(d)
    hs, parents = chain(33, 4)
    payloads = kv_payloads(33, 4)
    others, other_parents = chain(34, 8)
    with d.client() as c:
        ns = c.register(LOSSY)
        assert c.put(ns, list(zip(hs, parents, payloads))) == 4
        assert c.put(ns, list(zip(others, other_parents, kv_payloads(34, 8)))) == 8  # the first chain leaves
        counters = wait_counter(d, "remote_published_blocks", 4)["counters"]
        assert counters["remote_published_compressed_blocks"] == 3  # its sink block went exact
        assert c.lookup(ns, hs).tiers == ("remote",) * 4
        got = c.get(ns, hs)
        assert np.array_equal(got[0], payloads[0])
        assert all(np.array_equal(g, lossy(p)) for g, p in zip(got[1:], payloads[1:]))
    assert d.check() == []


def test_a_published_block_is_hashed_once(tmp_path, mooncake, started):
    """The publisher takes each block's xxh3 for its header; the host index records it as the block's
    checksum instead of hashing the block again. A restart without the remote tier then verifies the
    kept blocks against those checksums and serves them: they were right."""
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = remote_config(tmp_path / "remote.toml", master)
    d = start_daemon(tmp_path, "--config", cfg, name="zhashonce", log_path=str(tmp_path / "a.log"))
    started.append(d)
    ns, hs, payloads = put_chain(d, 40, 6)
    wait_counter(d, "remote_published_blocks", 6)
    deadline = time.monotonic() + 15
    while (host := d.stats()["tiers"]["host"])["unchecked_records"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host["checksums_written"] == host["checksums_offered"] == 6
    assert d.stop(keep_arena=True) == 0
    again = start_daemon(tmp_path, name="zhashonce", log_path=str(tmp_path / "b.log"))  # no remote tier
    started.append(again)
    with again.client() as c:
        assert c.lookup(c.register(NS), hs).tiers == ("host",) * 6
        assert all(np.array_equal(g, p) for g, p in zip(c.get(ns, hs), payloads))
    host = again.stats()["tiers"]["host"]
    assert host["verified_blocks"] == 6 and host["corrupt_blocks"] == 0


def test_a_gpu_readers_encoded_remote_hits_are_expanded_on_the_gpu(tmp_path, mooncake, started):
    """A daemon with a GPU tier (emulated; the Triton kernel interpreted in its process): a GPU reader's
    remote hits stored encoded come from the cluster as stored and are expanded into the gpu tier
    (kvstore/gpu_decode.py), the sink block (exact) lifted first; the bytes are the CPU decoder's."""
    pytest.importorskip("triton", reason="the GPU decoder is a Triton kernel (the test extra installs it)")
    from kvstore.tiers.gpu import SLOT, open_pool

    gpu_layout = BlockLayout(2, 2, 16, 64, "bfloat16", "HNC")  # what a CUDA engine's "LBHNC" is to the codec
    ns_spec = Namespace(**{**LOSSY.to_dict(), "model": "remote-lossy-gpu", "layout": "cuda/LBHNC"})
    master = Master(log_path=tmp_path / "master.log").start()
    started.append(master)
    cfg = compressing_config(tmp_path, master, publish="evicted")
    block = gpu_layout.block_bytes
    d = start_daemon(tmp_path, "--config", cfg, "--gpu-device", "cpu", "--gpu-devices", "0",
                     "--gpu-bytes", str(8 * block), "--gpu-page-bytes", str(block), name="zgpu",
                     host_bytes="128KiB", page_bytes="16KiB", log_path=str(tmp_path / "d.log"),
                     env={**os.environ, "TRITON_INTERPRET": "1"})
    started.append(d)
    hs, parents = chain(36, 4)
    payloads = kv_payloads(36, 4)
    others, other_parents = chain(37, 8)
    with d.client() as c:
        ns = c.register(ns_spec)
        assert c.put(ns, list(zip(hs, parents, payloads))) == 4
        assert c.put(ns, list(zip(others, other_parents, kv_payloads(37, 8)))) == 8  # the first chain leaves
        assert wait_counter(d, "remote_published_blocks", 4)["counters"]["remote_published_compressed_blocks"] == 3
        assert c.lookup(ns, hs).tiers == ("remote",) * 4
        extents, at = c.acquire_at(ns, hs, "gpu")
        assert at == ["gpu"] * 4
        pool = open_pool(c.gpu_pools[0], os.getuid())
        got = [np.concatenate([pool[o % SLOT : o % SLOT + n] for o, n in ext]) for ext in extents]
        c.release(ns, hs)
    budget = Budget(np.array(MIXED_BITS))
    assert np.array_equal(got[0], payloads[0])  # the sink block: exact
    for g, p in zip(got[1:], payloads[1:]):
        assert np.array_equal(g, decode(encode(p, gpu_layout, budget), gpu_layout))
    counters = d.stats()["counters"]
    assert counters["gpu_expanded_blocks"] == 3 and counters["remote_promotions"] == 4 and counters["lifts"] == 1
    assert d.check() == []
