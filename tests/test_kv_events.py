"""KV events: what the daemon publishes is what its tiers hold, in vLLM's own format.

A real daemon (host + disk tiers, tiny, so demotions and evictions start
early) publishes on a real ZMQ PUB socket; a real subscriber decodes every
message with vLLM's `KVEventBatch` decoder. Replaying the events (stored adds
(hash, medium), removed takes it away, cleared empties) must give exactly
what the daemon holds, block by block and tier by tier, and every commit,
demotion, eviction, promotion and clear must show up as such. Sequence
numbers are gapless and the replay socket returns the batches a late
subscriber missed, byte for byte. The publisher's drop-and-resync path is
checked with a queue too small to keep up; tests/test_store_events.py checks
the store's side (kvstore/block_events.py) after every step of the stateful test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.config import EventsConfig
from kvstore.server.event_wire import MEDIUM, RawEvent, decode_batch, encode_batch, group_by_topic
from kvstore.server.events import EventPublisher
from tests.conftest import ROOT
from tests.helpers import chain_hashes, namespace

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (the tools extra)")
msgspec = pytest.importorskip("msgspec", reason="vLLM's decoder is msgspec's")
vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM's KVEventBatch decodes the events")
DECODER = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)

BT = 16
NS = namespace(block_bytes=256 * 1024, block_tokens=BT)
TOPIC = f"kv@{socket.gethostname()}@test-model".encode()


def chain_tokens(seed: int, n: int) -> tuple[list[bytes], list[bytes]]:
    """The hashes of a chain (tests/helpers.py) and each block's token ids as <u4 bytes."""
    tokens = (np.arange(n * BT) + seed * 100_000).astype("<u4")
    return chain_hashes(seed, n, block_tokens=BT), [tokens[i * BT:(i + 1) * BT].tobytes() for i in range(n)]


class Subscriber:
    """A SUB socket on the daemon's endpoint; every message decoded with vLLM's decoder, kept in order."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.messages: list[tuple[bytes, int, bytes]] = []

    def drain(self, quiet_s: float = 0.4) -> None:
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.messages.append((topic, int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.sock.close(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: [b"", start_seq] -> [b"", topic, seq, payload]..., then seq -1."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint)
    try:
        req.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert req.poll(5000), "no answer from the replay socket"
            _, topic, seq, payload = req.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return out
            out.append((topic, seq, payload))
    finally:
        req.close(linger=0)


def apply(held: set, events) -> None:
    """Events onto a router's view: (hash, medium) pairs; removals must name held pairs."""
    for ev in events:
        if isinstance(ev, vllm_events.AllBlocksCleared):
            held.clear()
        elif isinstance(ev, vllm_events.BlockStored):
            for h in ev.block_hashes:
                assert (h, ev.medium) not in held, "stored twice without a removal between"
                held.add((h, ev.medium))
        else:
            for h in ev.block_hashes:
                assert (h, ev.medium) in held, "removed without being stored"
                held.remove((h, ev.medium))


def daemon_holds(client: KVClient, ns: str, hashes: list[bytes]) -> set:
    out = set()
    for h, d in zip(hashes, client.describe(ns, hashes)):
        if d is not None and d["committed"]:
            out |= {(h, MEDIUM[t]) for t in [d["tier"], *d["copies"]]}
    return out


@pytest.fixture
def events_daemon(daemon_factory, tmp_path):
    return daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "4MiB",
                          "--events-endpoint", "tcp://127.0.0.1:0", "--events-replay-endpoint", "tcp://127.0.0.1:0",
                          disk=True, host_bytes="2MiB", page_bytes="64KiB")


def test_events_mirror_every_tier_change_decoded_by_vllm(events_daemon):
    d = events_daemon
    sub = Subscriber(d.events_endpoint)
    time.sleep(0.3)  # a SUB socket misses what is sent before its subscription arrives; the replay covers that
    committed: dict[bytes, tuple[bytes | None, bytes]] = {}  # hash -> (parent, tokens)
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        assert c.server_info["events"]["token_ids"] is True
        for seed in range(7):  # 7 chains of 5 blocks: 35 blocks through a host tier of 8 and a disk tier of 16
            hs, toks = chain_tokens(seed, 5)
            parents = [None] + hs[:-1]
            for h, p, t in zip(hs, parents, toks):  # one block per commit: the tiny host tier makes room each time
                ext = c.reserve(ns, [(h, p)])
                if ext[0] is not None:
                    assert c.commit(ns, [h], tokens=[t]) == 1
                    committed[h] = (p, t)
        sub.drain()
        on_disk = [h for h, r in zip(committed, c.describe(ns, list(committed))) if r and r["tier"] == "disk"]
        assert on_disk, "the scenario must demote blocks to disk"
        root = next(h for h in on_disk if committed[h][0] is None or committed[h][0] not in on_disk)
        assert c.get(ns, [root])[0] is not None  # promotes it into host; its disk copy stays
        sub.drain()
        before_clear = daemon_holds(c, ns, list(committed))
        status, _ = d.http("/clear", method="POST")
        assert status == 200
        hs, toks = chain_tokens(99, 2)
        c.reserve(ns, [(hs[0], None), (hs[1], hs[0])])
        c.commit(ns, hs, tokens=toks)
        committed.update({hs[0]: (None, toks[0]), hs[1]: (hs[0], toks[1])})
        sub.drain()
        final = daemon_holds(c, ns, list(committed))
    sub.close()

    msgs = sub.messages
    assert msgs and all(t == TOPIC for t, _, _ in msgs)
    # gapless: the replay fills in what the late subscription missed, byte for byte where both have it
    replayed = replay(d.events_replay, 0)
    seqs = [s for _, s, _ in replayed]
    assert seqs == list(range(len(seqs))) and seqs[-1] == msgs[-1][1]
    by_seq = {s: p for _, s, p in replayed}
    assert [s for _, s, _ in msgs] == list(range(msgs[0][1], msgs[-1][1] + 1))
    assert all(by_seq[s] == p for _, s, p in msgs)
    batches = [DECODER.decode(p) for _, _, p in replayed]  # vLLM's own decoder, the map encoding

    held: set = set()
    stored_cpu: set = set()
    saw = {"demotion": 0, "last_tier_eviction": 0, "promotion": 0, "clear": 0}
    for batch in batches:
        removed_from_cpu: set = set()
        for ev in batch.events:
            if isinstance(ev, vllm_events.BlockStored):
                assert ev.block_size == BT and ev.lora_name is None
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert committed[h][0] == parent  # each block's parent, chained within the event
                    assert ev.token_ids[i * BT:(i + 1) * BT] == np.frombuffer(committed[h][1], "<u4").tolist()
                    parent = h
                    if ev.medium == "CPU":
                        stored_cpu.add(h)
                        saw["promotion"] += (h, "STORAGE") in held
                    elif ev.medium == "STORAGE":
                        saw["demotion"] += h in removed_from_cpu
            elif isinstance(ev, vllm_events.BlockRemoved):
                if ev.medium == "CPU":
                    removed_from_cpu.update(ev.block_hashes)
                else:
                    saw["last_tier_eviction"] += sum((h, "CPU") not in held for h in ev.block_hashes)
            else:
                saw["clear"] += 1
                assert held == before_clear  # the view just before the clear was the daemon's
            apply(held, [ev])
    assert held == final, "replaying the events does not give what the daemon holds"
    assert stored_cpu == set(committed), "every commit appears as BlockStored on CPU"
    assert all(v > 0 for v in saw.values()), saw
    assert final and before_clear and d.check() == []


def test_replay_serves_missed_batches_and_survives_bad_requests(events_daemon):
    d = events_daemon
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        for seed in range(3):
            hs, toks = chain_tokens(seed, 2)
            c.reserve(ns, [(hs[0], None), (hs[1], hs[0])])
            c.commit(ns, hs, tokens=toks)
    time.sleep(0.2)
    full = replay(d.events_replay, 0)
    assert [s for _, s, _ in full] == [0, 1, 2]
    bad = zmq.Context.instance().socket(zmq.DEALER)
    bad.connect(d.events_replay)
    bad.send_multipart((b"", b"not a seq"))
    bad.close(linger=1000)
    assert replay(d.events_replay, 1) == full[1:]  # from seq 1, identical bytes; the bad request changed nothing
    assert replay(d.events_replay, 7) == []
    # a router whose gap the buffer cannot fill asks for the whole state
    status, _ = d.http("/events/resync", method="POST")
    assert status == 200
    time.sleep(0.3)
    [(_, seq, payload)] = replay(d.events_replay, 3)
    events = DECODER.decode(payload).events
    assert seq == 3 and isinstance(events[0], vllm_events.AllBlocksCleared)
    assert [len(e.block_hashes) for e in events[1:]] == [2, 2, 2] and all(e.medium == "CPU" for e in events[1:])


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """vLLM's events before the map form: arrays tagged with the class name."""


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


def test_encodings_decode_with_vllm_and_with_the_older_array_form():
    hs, toks = chain_tokens(1, 3)
    raw = [RawEvent("S", b"t", BT, hs[0], None, toks[0], "host"), RawEvent("S", b"t", BT, hs[1], hs[0], toks[1], "host"),
           RawEvent("S", b"t", BT, hs[2], hs[1], toks[2], "remote"), RawEvent("R", b"t", block_hash=hs[2], tier="remote"),
           RawEvent("R", b"t", block_hash=hs[1], tier="disk"), RawEvent("C", b"t")]
    runs = group_by_topic(raw)[b"t"]
    new = DECODER.decode(encode_batch(runs, 1.0, "map"))
    old = msgspec.msgpack.decode(encode_batch(runs, 1.0, "array"), type=OldBatch)
    for batch in (new, old):
        first, remote, removed_remote, removed_disk, cleared = batch.events
        assert first.block_hashes == hs[:2] and first.parent_block_hash is None and first.medium == "CPU"
        assert first.token_ids == np.frombuffer(toks[0] + toks[1], "<u4").tolist()
        assert remote.block_hashes == [hs[2]] and remote.parent_block_hash == hs[1] and remote.medium == "STORAGE"
        assert removed_remote.medium == "STORAGE" and removed_disk.medium == "STORAGE"
        assert type(cleared).__name__.endswith("AllBlocksCleared")
    assert new.events[1].locality == "REMOTE" and new.data_parallel_rank == 0
    for enc in ("map", "array"):  # our own reader takes both and names the tier
        tiers = [e.get("tier") for e in decode_batch(encode_batch(runs, 1.0, enc))["events"]]
        assert tiers == ["host", "remote" if enc == "map" else "disk", "remote" if enc == "map" else "disk", "disk",
                         None]


def test_a_publisher_that_falls_behind_drops_then_resyncs_the_whole_state(store_factory):
    store = store_factory(64 * NS.block_bytes, 64 * 1024, prefault=False, policy="lru")
    ns = store.register_namespace(NS)
    cfg = EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_queue_events=4)
    pub = EventPublisher(cfg, store.shared.namespaces)
    store.add_listener(pub)
    hs, toks = chain_tokens(3, 6)
    for i, (h, t) in enumerate(zip(hs, toks)):  # the thread is not running yet: nothing drains the queue
        store.reserve(ns, [(h, hs[i - 1] if i else None)], "w")
        store.commit(ns, [h], "w", tokens=[t])
        pub.flush()
    assert pub.lost and pub.counts["events_dropped"] == 2  # 4 queued, 2 dropped
    replay_endpoint = pub.start()["replay_endpoint"]
    while not pub.has_room():
        time.sleep(0.01)
    pub.resync(store)
    while pub.stats()["queued_events"]:
        time.sleep(0.01)
    batches = [DECODER.decode(p) for _, _, p in replay(replay_endpoint, 0)]
    pub.close()
    held: set = set()
    for b in batches[:4]:  # one batch per flush that got through
        apply(held, b.events)
    assert held == {(h, "CPU") for h in hs[:4]}  # before the resync: a router's view is short of 2 blocks
    assert isinstance(batches[4].events[0], vllm_events.AllBlocksCleared)
    for b in batches[4:]:
        apply(held, b.events)
    assert held == {(h, "CPU") for h in hs}  # the resync made it whole
    assert not pub.lost and pub.counts["resyncs"] == 1


def test_a_resync_a_step_at_a_time_ends_with_what_the_store_holds_whatever_changed_meanwhile(store_factory):
    """A resync of a large store goes a step of blocks at a time (the daemon serves between steps and
    waits for room in the queue). Blocks committed and removed between two steps are reported as they
    change; once the walk is done a router's view is exactly what the store holds. (Meanwhile a router
    may see a block it was never told of removed, or one stored twice: set semantics, below.)"""
    store = store_factory(64 * NS.block_bytes, 64 * 1024, prefault=False, policy="lru")
    ns = store.register_namespace(NS)
    cfg = EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_queue_events=10_000)
    pub = EventPublisher(cfg, store.shared.namespaces)
    store.add_listener(pub)
    chains = [chain_tokens(20 + c, 4) for c in range(7)]

    def commit(hs: list[bytes], toks: list[bytes]) -> None:
        store.reserve(ns, [(h, hs[i - 1] if i else None) for i, h in enumerate(hs)], "w")
        store.commit(ns, hs, "w", tokens=toks)
        pub.flush()  # (the daemon flushes after every request)

    for hs, toks in chains[:5]:
        commit(hs, toks)
    replay_endpoint = pub.start()["replay_endpoint"]
    steps = pub.resync_steps(store, step=3)
    next(steps)  # AllBlocksCleared and the first blocks
    assert store.remove(ns, [chains[4][0][0]]) == 4  # a chain the walk has not reached yet
    commit(*chains[5])  # a chain it will reach, committed meanwhile
    pub.flush()
    taken = 1 + sum(1 for _ in steps)
    assert taken >= 5, "the walk went a step at a time"
    commit(*chains[6])  # after the resync: as usual
    while pub.stats()["queued_events"]:
        time.sleep(0.01)
    batches = [DECODER.decode(p) for _, _, p in replay(replay_endpoint, 0)]
    pub.close()
    held: set = set()
    for b in batches:
        for ev in b.events:
            if isinstance(ev, vllm_events.AllBlocksCleared):
                held.clear()
            elif isinstance(ev, vllm_events.BlockStored):
                held.update((h, ev.medium) for h in ev.block_hashes)
            else:
                held.difference_update((h, ev.medium) for h in ev.block_hashes)
    expected = {(h, "CPU") for c in (0, 1, 2, 3, 5, 6) for h in chains[c][0]}
    assert held == expected and pub.counts["resyncs"] == 1
    assert sum(isinstance(ev, vllm_events.AllBlocksCleared) for b in batches for ev in b.events) == 1


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_events_command_prints_replayed_and_live_batches(events_daemon):
    d = events_daemon
    hs, toks = chain_tokens(5, 3)
    with KVClient(d.socket_path) as c:
        ns = c.register(NS)
        c.reserve(ns, [(hs[0], None), (hs[1], hs[0]), (hs[2], hs[1])])
        c.commit(ns, hs, tokens=toks)
    time.sleep(0.2)
    r = run_cli("events", "--socket", d.socket_path, "--from-seq", "0", "--count", "1", "--json", "--timeout", "20")
    assert r.returncode == 0, r.stderr
    import json

    [line] = r.stdout.splitlines()
    batch = json.loads(line)
    assert batch["seq"] == 0 and batch["topic"] == TOPIC.decode()
    [ev] = batch["events"]
    assert ev["type"] == "BlockStored" and ev["medium"] == "CPU" and ev["block_hashes"] == [h.hex() for h in hs]
    assert ev["token_ids"] == np.frombuffer(b"".join(toks), "<u4").tolist()
    r = run_cli("events", "--socket", d.socket_path, "--from-seq", "0", "--count", "1", "--timeout", "20")
    assert r.returncode == 0 and "BlockStored" in r.stdout and "3 blocks" in r.stdout and "CPU" in r.stdout


def test_events_command_bad_input(daemon, tmp_path):
    r = run_cli("events", "--socket", str(tmp_path / "nobody.sock"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "cannot reach" in r.stderr
    r = run_cli("events", "--socket", daemon.socket_path)  # a daemon without [events]
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "publishes no KV events" in r.stderr
    r = run_cli("serve", "--events-endpoint", "http://nope", "--no-disk")
    assert r.returncode == 2 and "events.endpoint" in r.stderr
