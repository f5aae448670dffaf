"""Block hashes are deterministic, chained, and separated by extra keys and namespaces; a store key names
its namespace and its hash, and nothing else."""

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from kvstore import keys
from kvstore.errors import KVStoreError, NamespaceError
from kvstore.keys import (ROOT_HASH, TAG_BYTES, ExtraKeys, MultimodalItem, Namespace, block_key, hash_blocks, key_hash,
                          key_ns, key_text, ns_tag)
from kvstore.tiers.record_scan import record_key, store_key

TOKENS = list(range(1000, 1000 + 100))


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(TOKENS, 16)) == 6
    assert hash_blocks(TOKENS[:15], 16) == []


def test_chain_prefix_property():
    full = hash_blocks(TOKENS, 16)
    assert hash_blocks(TOKENS[:48], 16) == full[:3]
    changed = TOKENS.copy()
    changed[40] += 1  # block 2
    other = hash_blocks(changed, 16)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:])), "a change must alter every later block"


def test_continuation_equals_full_hash():
    full = hash_blocks(TOKENS, 16, ExtraKeys(lora="a", cache_salt="s"))
    tail = hash_blocks(TOKENS[32:], 16, ExtraKeys(lora="a", cache_salt="s"), parent=full[1], start_block=2)
    assert tail == full[2:]


def test_hashes_do_not_depend_on_pythonhashseed():
    code = "from kvstore.keys import hash_blocks, ExtraKeys; print(hash_blocks(list(range(64)), 16, ExtraKeys(lora='x', cache_salt='y'))[-1].hex())"
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    outs = set()
    for seed in ("0", "123", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == hash_blocks(list(range(64)), 16, ExtraKeys(lora="x", cache_salt="y"))[-1].hex()


def test_documented_root_seed():
    import xxhash

    assert ROOT_HASH == xxhash.xxh3_128_digest(b"kvstore/v1/root")
    assert hash_blocks(list(range(16)), 16)[0] == xxhash.xxh3_128_digest(ROOT_HASH + np.arange(16, dtype="<u4").tobytes())


@pytest.mark.parametrize(
    "a,b",
    [
        (ExtraKeys(cache_salt="tenant-x"), ExtraKeys(cache_salt="tenant-y")),
        (ExtraKeys(), ExtraKeys(cache_salt="tenant-x")),
        (ExtraKeys(lora="adapter-1"), ExtraKeys(lora="adapter-2")),
        (ExtraKeys(mm=(MultimodalItem("img-a", 20, 8),)), ExtraKeys(mm=(MultimodalItem("img-b", 20, 8),))),
    ],
)
def test_extra_keys_separate_chains(a, b):
    ha, hb = hash_blocks(TOKENS, 16, a), hash_blocks(TOKENS, 16, b)
    assert ha[-1] != hb[-1]
    if not (a.mm or b.mm):  # salt and LoRA apply from block 0: the chains share nothing
        assert not set(ha) & set(hb)


def test_multimodal_item_only_affects_blocks_it_overlaps():
    plain = hash_blocks(TOKENS, 16)
    with_mm = hash_blocks(TOKENS, 16, ExtraKeys(mm=(MultimodalItem("img", 40, 8),)))
    assert with_mm[:2] == plain[:2] and with_mm[2] != plain[2]


def test_bad_token_ids_rejected():
    with pytest.raises(ValueError):
        hash_blocks([-1] * 16, 16)
    with pytest.raises(ValueError):
        hash_blocks(TOKENS, 0)


def test_namespace_id_is_stable_and_sensitive():
    ns = Namespace("smollm2", "bfloat16", 30, 3, 64, 32, 368640)
    assert ns.id == Namespace.from_dict(ns.to_dict()).id
    assert ns.id != Namespace("smollm2", "bfloat16", 30, 3, 64, 32, 368640, tp_rank=0, tp_size=2).id
    assert ns.id != Namespace("smollm2", "float16", 30, 3, 64, 32, 368640).id
    with pytest.raises(ValueError):
        Namespace("m", "bf16", 0, 3, 64, 32, 10)
    with pytest.raises(ValueError):
        Namespace.from_dict({"model": "m", "bogus": 1})


def test_a_store_key_gives_back_its_namespace_and_hash():
    a, b = Namespace("m", "bf16", 2, 2, 64, 16, 4096), Namespace("m", "bf16", 2, 2, 64, 16, 4096, tp_rank=1, tp_size=2)
    h = hash_blocks(TOKENS, 16)[0]
    ka, kb = block_key(a.id, h), block_key(b.id, h)
    assert ka != kb and len(ka) == TAG_BYTES + len(h)  # the same hash in two namespaces: two blocks
    assert (key_ns(ka), key_hash(ka), key_ns(kb), key_hash(kb)) == (a.id, h, b.id, h)
    assert ka == ns_tag(a.id) + h and ns_tag(a.id) is ns_tag(a.id)  # one tag object a namespace
    assert key_text(ka) == f"{a.id}/{h.hex()[:16]}"
    assert key_text(b"\x01" * TAG_BYTES + h).startswith("01" * TAG_BYTES)  # a tag no namespace has: shown as is
    with pytest.raises(TypeError):
        ns_tag(b"ns-bytes")


def test_two_namespace_ids_with_one_tag_are_refused(monkeypatch):
    monkeypatch.setattr(keys, "_TAGS", {})
    monkeypatch.setattr(keys, "_NAMES", {keys.xxhash.xxh3_64_digest(b"ns-b"): "ns-a"})  # as if ns-a had ns-b's tag
    with pytest.raises(ValueError, match="same tag"):
        ns_tag("ns-b")
    assert keys._TAGS == {}


def test_names_no_namespace_has_make_no_tags(store_factory):
    """A client naming a namespace that does not exist gets an error, and the daemon keeps nothing of it."""
    store = store_factory(16 * 4096, 4096)
    before = len(keys._TAGS)
    for call in (lambda ns: store.release(ns, [b"h" * 16], "c"), lambda ns: store.count_in_flight(ns, [b"h" * 16]),
                 lambda ns: store.lookup(ns, [b"h" * 16]), lambda ns: store.reserve(ns, [(b"h" * 16, None)], "c")):
        with pytest.raises(NamespaceError):
            call("ns-nobody-registered")
    assert len(keys._TAGS) == before


def test_record_keys_keep_their_format():
    """A tier's records name a block by msgpack `[namespace id, hash]`, as before keys were one object: the
    disk and the kept arena of an earlier version are read as they are."""
    for ns_id in ("ns-0123456789abcdef", "n" * 40):
        for h in (hash_blocks(TOKENS, 16)[0], b"x", b"y" * 40):
            rkey = record_key(block_key(ns_id, h))
            assert rkey == msgpack.packb([ns_id, h]) and store_key(rkey) == block_key(ns_id, h)
    with pytest.raises(TypeError):
        store_key(msgpack.packb([1, b"h"]))


def test_the_tally_by_namespace_tag_reads_as_namespace_ids(store_factory):
    """The index counts committed blocks per (namespace tag, tier); stats name the namespace, and a check
    finds a count that drifted."""
    store = store_factory(16 * 4096, 4096)
    ns_id = store.register_namespace(Namespace("m", "bf16", 1, 1, 64, 16, 4096))
    hs = hash_blocks(TOKENS[:64], 16)
    store.reserve(ns_id, list(zip(hs, [None] + hs[:-1])), "w")
    store.commit(ns_id, hs, "w")
    assert store.stats()["by_namespace"][ns_id]["blocks"] == {"host": 4} and store.check() == []
    store.index.held[(ns_tag(ns_id), "host")][0] += 1
    assert store.check() == [f"tally of {ns_id} in host says [5, 16384], the index holds [4, 16384]"]


def test_an_entry_holds_neither_its_size_nor_its_owner(store_factory):
    """A block's size is its namespace's, read through its key's tag; whose reservation it is, the index
    knows: another client can neither commit it nor hang a block under it, its owner can. The entry is
    ten slots (112 B): each slot more is 8 B of every indexed block."""
    store = store_factory(64 * 4096, 4096)
    small = store.register_namespace(Namespace("m", "bf16", 1, 1, 64, 16, 4096))
    large = store.register_namespace(Namespace("m", "bf16", 1, 1, 64, 16, 8192))
    hs = hash_blocks(TOKENS[:48], 16)
    for ns_id in (small, large):
        store.reserve(ns_id, [(hs[0], None)], "a")
    e_small, e_large = (store.index.get(block_key(ns_id, hs[0])) for ns_id in (small, large))
    assert (e_small.nbytes, e_large.nbytes) == (4096, 8192) and not e_small.committed
    assert sys.getsizeof(e_small) <= 112
    assert store.reserve(small, [(hs[1], hs[0])], "b") == [None]  # under another client's write in flight
    assert store.shared.counters["put_orphan_blocks"] == 1
    with pytest.raises(KVStoreError, match="not reserved by this client"):
        store.commit(small, [hs[0]], "b")
    (child,) = store.reserve(small, [(hs[1], hs[0])], "a")  # its owner's own chain
    assert child is not None and child.depth == 1
    assert store.commit(small, hs[:2], "a") == 2 and e_small.committed and child.committed
    assert store.stats()["by_namespace"][small]["bytes"] == {"host": 8192} and store.check() == []
    store.abort(large, [hs[0]], "a")  # a reservation dropped: the index forgets whose it was
    assert store.index.get(block_key(large, hs[0])) is None and not store.index.reserved_by_owner["a"]
    assert store.check() == []
