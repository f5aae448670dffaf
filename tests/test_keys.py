"""Block hashes are deterministic, chained, and separated by extra keys and namespaces."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import ROOT_HASH, ExtraKeys, MultimodalItem, Namespace, hash_blocks

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
