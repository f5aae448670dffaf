"""kvstore.tiers.host copy routines: byte-exact on every path (word loop, unaligned, odd sizes, small)."""

import numpy as np
import pytest

from kvstore.tiers.host import copy_bytes, copy_in, copy_out


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
