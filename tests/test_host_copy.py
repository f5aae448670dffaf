"""kvstore.tiers.host copy routines: byte-exact on every path (word loop, unaligned, odd sizes, small)."""

import numpy as np
import pytest

from kvstore.tiers.arena import copy_held
from kvstore.tiers.host import copy_bytes, copy_in, copy_out, copy_segments


@pytest.mark.parametrize("offset, size", [(0, 1 << 20), (8, 65536 + 8), (3, 65536), (0, 65536 + 5), (0, 100), (5, 4095)])
def test_copy_bytes_is_byte_exact(offset, size):
    rng = np.random.default_rng(size)
    src_buf = rng.integers(0, 256, size + 16, dtype=np.uint8)
    dst_buf = np.zeros(size + 16, np.uint8)
    src, dst = src_buf[offset : offset + size], dst_buf[offset : offset + size]
    copy_bytes(dst, src)
    assert np.array_equal(dst, src)
    assert not dst_buf[:offset].any() and not dst_buf[offset + size :].any(), "wrote outside the destination"


def test_copy_in_and_out_round_trip_through_an_arena(arena_factory):
    arena = arena_factory(1 << 20, 64 * 1024, prefault=False)
    data = np.random.default_rng(0).integers(0, 256, 3 * 64 * 1024 - 40, dtype=np.uint8)
    ext = arena.allocate(data.size)
    assert ext is not None
    copy_in(arena.buf, ext, data)
    assert np.array_equal(copy_out(arena.buf, ext), data)
    out = np.zeros_like(data)
    copy_out(arena.buf, ext, out=out)
    assert np.array_equal(out, data)
    with pytest.raises(ValueError, match="contiguous"):
        copy_out(arena.buf, ext, out=np.zeros(2 * data.size, np.uint8)[::2])  # would copy into a temporary
    with pytest.raises(ValueError, match="payload"):
        copy_in(arena.buf, ext, data[:-1])


@pytest.mark.parametrize("dst_sizes, src_sizes", [([4096], [4096]), ([100, 3996], [4096]), ([4096], [1000, 1000, 2096]),
                                                  ([70000, 30000], [50000, 50000]), ([1 << 17], [1 << 16, 1 << 16])])
def test_copy_segments_is_byte_exact_across_splits(dst_sizes, src_sizes):
    """The daemon's copy: small pieces keep the GIL (copy_held), large ones take the word loop."""
    rng = np.random.default_rng(sum(dst_sizes) + len(src_sizes))
    data = rng.integers(0, 256, sum(src_sizes), dtype=np.uint8)
    src = np.split(data, np.cumsum(src_sizes)[:-1])
    out = np.zeros(sum(dst_sizes) + 16, np.uint8)
    dst = np.split(out[: sum(dst_sizes)], np.cumsum(dst_sizes)[:-1])
    copy_segments(dst, src)
    assert np.array_equal(out[: data.size], data) and not out[data.size :].any()


def test_copy_held_keeps_numpy_s_answer_for_what_is_not_a_plain_pair():
    dst = np.zeros(8, np.uint8)
    copy_held(dst, np.arange(8, dtype=np.uint8))
    assert dst.tolist() == list(range(8))
    with pytest.raises(ValueError):
        copy_held(np.zeros(8, np.uint8), np.zeros(9, np.uint8))  # (sizes differ: NumPy's error)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_held(ro, np.ones(8, np.uint8))
    assert not ro.any()
