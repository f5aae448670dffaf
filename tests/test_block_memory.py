"""tools/bench/block_memory.py: a store filled in this process, its memory a block part by part."""

from __future__ import annotations

import json

import pytest

from kvstore.tools.bench.block_memory import _owned, main


def test_a_store_of_host_and_disk_blocks_is_measured_part_by_part(capsys):
    assert main(["--blocks", "3072", "--host-blocks", "1024", "--json"]) == 0
    parts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Of 3,072 blocks in chains of 512, the host holds 1,024 and the disk 2,048, of which all but the 4
    # chains' last blocks rest (kvstore/resting.py): 1,028 are objects, each a key of 64 B (a namespace's
    # tag and the hash, 57 B) and an entry of ten slots (112 B; no block was read: no rare fields).
    awake = 1028 / 3072
    assert parts["keys"] == pytest.approx(64 * awake, rel=0.02)
    assert parts["index entries"] == pytest.approx(112 * awake, rel=0.02)
    assert parts["disk locations"] == pytest.approx(48 * 4 / 3072, abs=0.05)  # (one int of 48 B each)
    assert 105 * 2044 / 3072 < parts["blocks at rest"] < 400 * 2044 / 3072  # (a row of 105 B and the tables)
    for part in ("index table", "disk policy table", "disk policy records", "host policy records"):
        assert parts[part] > 0, part
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), abs=0.6)  # (rounded)


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo"])
def test_every_policy_s_parts_are_measured(capsys, policy):
    assert main(["--blocks", "2048", "--host-blocks", "512", "--policy", policy, "--json"]) == 0
    parts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert parts["disk policy table"] > 0 and parts["keys"] == 64.0 and parts["total"] > 300


def test_an_object_many_refer_to_is_split_between_them():
    holders = [[float("1.5")]]  # a list its holder's alone, with a float of its own
    alone = _owned(holders[0], {})  # (measured outside the asserts: pytest's rewriting holds references)
    refs = [[float("2.5")]] * 4  # one list, four references
    shared = _owned(refs[0], {})
    assert alone == 64 + 32  # the list (56 B with the collector's header, in 64) and its float (24, in 32)
    assert shared == 64 / 4
