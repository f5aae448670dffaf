"""The codec's compiled loops (kvstore/codec_fast.py) against its NumPy code: the same bytes, both ways, for
every layout, dtype, quantization mode and width, and the float16 conversions they do on the bits."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore import codec_fast
from kvstore.codec import ORDERS, BlockLayout, Budget, decode, encode, from_float32

pytestmark = pytest.mark.skipif(not codec_fast.AVAILABLE, reason="numba is not installed (the NumPy code serves)")


def both(monkeypatch, fn):
    monkeypatch.setattr(codec_fast, "AVAILABLE", True)
    fast = fn()
    monkeypatch.setattr(codec_fast, "AVAILABLE", False)
    return fast, fn()


@pytest.mark.parametrize("order,splits,dtype", [(o, s, d) for o, s in [(o, 1) for o in ORDERS] + [("HNC", 2)]
                                                 for d in ("bfloat16", "float16", "float32")
                                                 if o != "AMX" or d == "bfloat16"])  # AMX: bfloat16's only
def test_compiled_and_numpy_code_give_the_same_bytes(monkeypatch, order, splits, dtype):
    rng = np.random.default_rng(ORDERS.index(order) * 7 + splits)
    layout = BlockLayout(3, 2, 16, 64, dtype, order, splits)
    for rotate in (True, False):
        for key_mode in ("token", "channel"):
            bits = rng.choice([2, 3, 4, 5, 8, 16], size=(3, 2, 2))
            bits[..., 0] = np.maximum(bits[..., 0], bits[..., 1])
            budget = Budget(bits, rotate, key_mode)
            values = rng.standard_normal(layout.block_bytes // layout.elt_bytes).astype(np.float32)
            values *= rng.choice([1e-6, 1.0, 300.0])
            values[:64] = 1.5  # a constant row: scale 0
            payload = from_float32(values, dtype)
            fast, slow = both(monkeypatch, lambda: encode(payload, layout, budget))
            np.testing.assert_array_equal(fast, slow)
            fast, slow = both(monkeypatch, lambda: decode(fast, layout))
            np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("order", ["HNC", "HKTVND", "KVNHD"])
@pytest.mark.parametrize("tokens,head_size", [(16, 32), (8, 128), (12, 32), (6, 16), (32, 8), (16, 256)])
def test_compiled_loops_take_every_shape_the_same_way(monkeypatch, order, tokens, head_size):
    """Shapes that take each path of the loops: tokens a multiple of 8 (bit planes by words) or not, of
    4 (the transpose by words) or not, rotations of an even and an odd number of stages."""
    rng = np.random.default_rng(tokens * 1000 + head_size)
    layout = BlockLayout(2, 2, tokens, head_size, "bfloat16", order)
    bits = rng.choice([2, 3, 4, 5, 7, 8], size=(2, 2, 2))
    bits[..., 0] = np.maximum(bits[..., 0], bits[..., 1])
    for rotate in (True, False):
        payload = from_float32(rng.standard_normal(layout.block_bytes // 2).astype(np.float32), "bfloat16")
        fast, slow = both(monkeypatch, lambda: encode(payload, layout, Budget(bits, rotate)))
        np.testing.assert_array_equal(fast, slow)
        fast, slow = both(monkeypatch, lambda: decode(fast, layout))
        np.testing.assert_array_equal(fast, slow)


def test_float16_conversions_on_the_bits_match_numpy():
    def to_bits(x):
        out = np.empty(x.size, np.int64)
        codec_fast._f16_bits(np.ascontiguousarray(x).view(np.uint32), out, x.size)
        return out

    def to_value(h):
        out = np.empty(h.size, np.float32)
        codec_fast._f16_values(h.astype(np.int64), out, out.view(np.uint32), h.size)
        return out

    every = np.arange(1 << 16, dtype=np.uint16)  # every float16, and the float32 halfway between neighbours
    want = every.view(np.float16).astype(np.float32)
    got = to_value(every)
    assert ((got == want) | (np.isnan(got) & np.isnan(want))).all()
    finite = want[np.isfinite(want)]
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)  # ties: round to even
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([finite, mids, np.nextafter(mids, np.float32(np.inf)), noise[np.isfinite(noise)],
                        np.float32([65504, 65519.99, 65520, 1e9, -1e9, 2.0 ** -25, 2.0 ** -24, 0.0, -0.0])])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(to_bits(x).astype(np.uint16), x.astype(np.float16).view(np.uint16))


def test_without_numba_the_numpy_code_serves():
    code = "from kvstore import codec_fast; print(codec_fast.AVAILABLE)"
    env = {**os.environ, "KVSTORE_CODEC_NUMPY": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
