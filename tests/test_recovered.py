"""tiers/recovered.py: a tier's records as columns give back every record as it was appended, find every
key's row (and no row for a key they do not hold), keep what `take` selects in its order, and refuse a
malformed record without changing anything."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvstore.keys import HASH_BYTES, ROOT_HASH, TAG_BYTES
from kvstore.tiers.base import RecoveredBlock
from kvstore.tiers.recovered import Recovered

hashes = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)
records = st.lists(
    st.tuples(st.one_of(hashes, st.binary(max_size=30)),  # (a key of another length: kept apart)
              st.one_of(st.none(), st.just(b""), st.just(ROOT_HASH), hashes, st.binary(min_size=1, max_size=8)),
              st.integers(0, 1 << 40),
              st.one_of(st.integers(0, 1 << 160), st.integers(-9, 1 << 200), st.lists(st.integers(0, 9), max_size=3)),
              st.one_of(st.none(), st.floats(0, 1)), st.floats(0, 2e9)),
    max_size=60, unique_by=lambda r: r[0])


def as_blocks(rows: list[tuple]) -> list[RecoveredBlock]:
    return [RecoveredBlock(b"T" * TAG_BYTES + h, p, n, loc, a, t) for h, p, n, loc, a, t in rows]


def expected(b: RecoveredBlock) -> RecoveredBlock:
    """What a row gives back: a root's parent as None, whichever of the three ways it was written."""
    return b._replace(parent=None if b.parent in (None, b"", ROOT_HASH) else b.parent)


@settings(max_examples=60, deadline=None)
@given(records, st.data())
def test_rows_give_back_each_record_and_find_each_key(rows, data):
    blocks = as_blocks(rows)
    got = Recovered(key_objects=data.draw(st.booleans()))  # (the keys as a column, or as the objects appended)
    for b in blocks:
        got.append(b)
    assert len(got) == len(blocks)
    assert list(got) == [expected(b) for b in blocks]
    finder = got.finder()
    for i, b in enumerate(blocks):
        assert finder.find(b.key) == i
        assert got.locations[i] == b.location and type(got.locations[i]) is type(b.location)
    held = {b.key for b in blocks}
    other = data.draw(hashes.map(lambda h: b"T" * TAG_BYTES + h).filter(lambda k: k not in held))
    assert finder.find(other) == -1
    keys = [b.key for b in blocks] + [other]
    found = finder.find_many(np.array([hash(k) for k in keys], np.int64))
    assert found.tolist() == list(range(len(blocks))) + [-1]
    assert got.keys.match(found, keys).tolist() == [True] * len(blocks) + [False]
    if blocks:  # (a row that holds another key: no match)
        assert got.keys.match(np.array([0, -1]), [other, blocks[0].key]).tolist() == [False, False]
    picked = data.draw(st.lists(st.integers(0, max(len(blocks) - 1, 0)), max_size=len(blocks), unique=True)
                       if blocks else st.just([]))
    taken = got.take(picked)
    assert list(taken) == [expected(blocks[i]) for i in picked]
    assert [taken.finder().find(blocks[i].key) for i in picked] == list(range(len(picked)))


@pytest.mark.parametrize("bad", [
    (b"k" * 24, b"p" * 16, "4096", 0, None, 0.0),  # a size that is no number
    ("k" * 24, None, 4096, 0, None, 0.0),  # a key that is no bytes
    (b"k" * 24, 7, 4096, 0, None, 0.0),  # a parent that is no bytes
    (b"k" * 24, None, 4096, 0, "high", 0.0),  # an estimate that is no number
    (b"k" * 24, None, 4096, 0, None, [1]),  # a time that is no number
    (b"k" * 24, None, -1, 0, None, 0.0),  # a size out of range
])
def test_a_malformed_record_is_refused_and_nothing_is_added(bad):
    got = Recovered.of(as_blocks([(b"h" * HASH_BYTES, None, 4096, 1, 0.5, 3.0)]))
    with pytest.raises((TypeError, ValueError)):
        got.append(bad)
    assert list(got) == [RecoveredBlock(b"T" * TAG_BYTES + b"h" * HASH_BYTES, None, 4096, 1, 0.5, 3.0)]
    assert len(got.parents) == HASH_BYTES and len(got.fps) == len(got.stamps) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=40), st.binary(min_size=1, max_size=40)), min_size=1, max_size=30))
def test_a_record_key_gives_back_its_store_key_whichever_namespace_came_first(items):
    """`store_key` unpacks the first record key of each namespace and slices the others; both ways give
    the key `record_key` was made of, whatever the namespaces and hash lengths."""
    from kvstore.keys import block_key
    from kvstore.tiers.record_scan import record_key, store_key

    for ns_id, h in items:
        key = block_key(ns_id, h)
        assert store_key(record_key(key)) == key
        assert store_key(record_key(key)) == key  # (the second time: sliced where the hash is 16 bytes)
