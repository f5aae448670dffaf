"""Anchored namespaces: a hybrid model's attachments hang under the full-attention block of the same
hash in another namespace (`Namespace.anchor`), so the prefix tree holds a hybrid prefix as one thing.

A real host arena and disk tier (tests/test_disk.py's sizes): the attachment is a leaf evicted before its
anchor block, is refused without it, moves down and back with it, and comes back after a restart."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvstore.errors import NamespaceError
from kvstore.keys import block_key, key_hash
from tests.helpers import chain_hashes, namespace, payload_bytes

BLOCK = PAGE = 64 * 1024
SPINE = namespace("hybrid", BLOCK)
ATTACH = dataclasses.replace(namespace("hybrid", 2 * BLOCK), layout="boundary", anchor=SPINE.id)


class Store:
    """A store over a host arena of 6 pages and a disk tier of 64 (`store_factory`'s: reopenable)."""

    def __init__(self, store_factory) -> None:
        self.store_factory = store_factory
        self.open()

    def open(self) -> None:
        self.store = self.store_factory(6 * BLOCK, PAGE, disk_bytes=64 * BLOCK)
        self.store.register_namespace(SPINE)
        self.store.register_namespace(ATTACH)

    def close(self) -> None:
        self.store.close()

    def put(self, ns, blocks) -> list[bool]:
        """Reserve, write and commit (hash, parent) blocks one at a time; which were stored."""
        out = []
        for h, parent in blocks:
            (e,) = self.store.reserve(ns.id, [(h, parent)], "w")
            if e is not None:
                self.store.host.write(e.location, payload_bytes(h + ns.layout.encode(), ns.block_bytes))
                self.store.commit(ns.id, [h], "w")
            out.append(e is not None)
        return out

    def read(self, ns, hashes) -> list[bytes | None]:
        entries = self.store.pin(ns.id, hashes, "r", prefix=False)
        entries = asyncio.run(self.store.prepare_read(entries, "r"))
        out = [self.store.host.read(e.location) if e is not None else None for e in entries]
        self.store.release(ns.id, [key_hash(e.key) for e in entries if e is not None], "r")
        return out


@pytest.fixture
def s(store_factory):
    return Store(store_factory)


def spine_and_attachment(s: Store, seed: int, n: int = 2) -> list[bytes]:
    hs = chain_hashes(seed, n)
    assert s.put(SPINE, zip(hs, [None, *hs[:-1]])) == [True] * n
    assert s.put(ATTACH, [(hs[-1], hs[-1])]) == [True]  # hangs under the spine block of the same hash
    return hs


def test_an_attachment_hangs_under_its_anchor_block(s):
    hs = spine_and_attachment(s, 1)
    e = s.store.index.get(block_key(ATTACH.id, hs[-1]))
    assert e.parent == block_key(SPINE.id, hs[-1]) and e.depth == 2
    assert s.store.check() == []
    assert s.read(ATTACH, [hs[-1]])[0] == payload_bytes(hs[-1] + b"boundary", 2 * BLOCK)


def test_an_attachment_without_its_anchor_block_is_refused(s):
    hs = chain_hashes(2, 2)
    assert s.put(SPINE, [(hs[0], None)]) == [True]
    assert s.put(ATTACH, [(hs[1], hs[1])]) == [False]  # the spine block it would hang under is absent
    assert s.store.shared.counters["put_orphan_blocks"] == 1
    assert s.store.index.get(block_key(ATTACH.id, hs[1])) is None and s.store.check() == []


def test_attachments_leave_the_host_tier_before_their_anchor_and_come_back_with_it(s):
    """The arena holds 6 pages: the second prefix pushes the first one's blocks down, the attachment
    (a leaf) never sitting in a faster tier than its spine block; a read brings both back."""
    first = spine_and_attachment(s, 3)
    second = spine_and_attachment(s, 4)
    assert s.store.check() == []
    keys = [block_key(SPINE.id, h) for h in first] + [block_key(ATTACH.id, first[-1])]
    tier = {k: s.store.index.get(k).tier for k in keys}
    assert "disk" in tier.values()
    assert not (tier[block_key(ATTACH.id, first[-1])] == "host" and tier[block_key(SPINE.id, first[-1])] == "disk")
    assert s.read(SPINE, first) == [payload_bytes(h + SPINE.layout.encode(), BLOCK) for h in first]
    assert s.read(ATTACH, [first[-1]])[0] == payload_bytes(first[-1] + b"boundary", 2 * BLOCK)
    assert s.store.check() == [] and second


def test_attachments_are_recovered_under_their_anchor(s):
    hs = spine_and_attachment(s, 5)
    for seed in range(6, 12):  # push everything down to the disk tier, which persists
        spine_and_attachment(s, seed)
    s.store.flush()
    s.close()
    s.open()
    e = s.store.index.get(block_key(ATTACH.id, hs[-1]))
    assert e is not None and e.parent == block_key(SPINE.id, hs[-1]) and e.tier == "disk"
    assert s.read(ATTACH, [hs[-1]]) == [None]  # not promoted above its spine block, which is on disk
    assert s.read(SPINE, hs)[-1] is not None  # a reader takes the spine first (it is promoted) ...
    assert s.read(ATTACH, [hs[-1]])[0] == payload_bytes(hs[-1] + b"boundary", 2 * BLOCK)  # ... then this
    assert s.store.check() == []


@pytest.mark.parametrize("anchor", [
    "ns-0000000000000000",  # not registered
    namespace("another-model", BLOCK).id,  # registered below, but another model's
    ATTACH.id,  # itself anchored
])
def test_a_bad_anchor_is_refused_at_registration(s, anchor):
    s.store.register_namespace(namespace("another-model", BLOCK))
    bad = dataclasses.replace(ATTACH, anchor=anchor, layout="other")
    with pytest.raises(NamespaceError, match="anchor"):
        s.store.register_namespace(bad)
    assert bad.id not in s.store.shared.namespaces


def test_the_anchor_is_part_of_the_id_only_when_set():
    assert "anchor" not in SPINE.to_dict() and ATTACH.to_dict()["anchor"] == SPINE.id
    assert dataclasses.replace(ATTACH, anchor="").id != ATTACH.id
