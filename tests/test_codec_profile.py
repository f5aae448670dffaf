"""Codec profiles (kvstore/codec_profile.py): the file format, built-in names, and bit allocation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.codec import BlockLayout, Budget, encoded_bytes
from kvstore.codec_profile import Profile, allocate_bits, uniform_profile

WIDTHS = (2, 3, 4, 5, 6, 8)


def distortion(L=4, H=3, seed=0) -> np.ndarray:
    """Each group's distortion falls 4x per bit from a random level (some groups matter 1000x more)."""
    rng = np.random.default_rng(seed)
    level = 10 ** rng.uniform(-3, 0, size=(L, H, 2))
    return level[..., None] * 4.0 ** -(np.array(WIDTHS) - 2)


@pytest.mark.parametrize("mean", [2.0, 2.5, 3.0, 3.5, 4.25, 8.0])
def test_allocation_spends_at_most_the_budget_and_keys_keep_at_least_the_values_bits(mean):
    d = distortion()
    bits = allocate_bits(d, WIDTHS, mean)
    assert bits.shape == (4, 3, 2) and bits.mean() <= mean + 1e-9
    assert (bits[..., 0] >= bits[..., 1]).all() and np.isin(bits, WIDTHS).all()
    assert bits.mean() >= mean - 1.0 / bits.size * 6  # at most one upgrade's worth left unspent


def test_allocation_beats_uniform_bits_on_its_own_distortion_and_favours_costly_groups():
    d = distortion(L=6, H=4, seed=3)
    bits = allocate_bits(d, WIDTHS, 3.0)
    cost = lambda b: sum(d[l, h, kv, WIDTHS.index(int(b[l, h, kv]))] for l in range(6) for h in range(4) for kv in (0, 1))  # noqa: E731
    assert cost(bits) < cost(np.full((6, 4, 2), 3)) / 2
    flat_d, flat_b = d[..., 0].reshape(-1), bits.reshape(-1)
    top, bottom = np.argsort(flat_d)[-5:], np.argsort(flat_d)[:5]
    assert flat_b[top].mean() > flat_b[bottom].mean()


def test_allocation_refuses_bad_tables():
    with pytest.raises(ValueError, match="distortion must be"):
        allocate_bits(np.zeros((2, 2, 2)), WIDTHS, 3)
    with pytest.raises(ValueError, match="below the narrowest"):
        allocate_bits(distortion(), WIDTHS, 1.5)
    with pytest.raises(ValueError, match="widths"):
        allocate_bits(distortion()[..., :2], (3, 2), 3)


def test_profile_file_round_trips_and_its_digest_follows_the_bits(tmp_path):
    bits = allocate_bits(distortion(), WIDTHS, 3.0)
    p = Profile("smollm2-3b", Budget(bits), model="m", sink_blocks=1, calibration={"document": "x"})
    path = tmp_path / "smollm2-3b.json"
    p.save(str(path))
    back = Profile.load(str(path))
    assert back.name == p.name and np.array_equal(back.budget.bits, bits) and back.sink_blocks == 1
    assert back.digest == p.digest
    bits2 = bits.copy()
    bits2[0, 0] = (8, 8)
    assert Profile("smollm2-3b", Budget(bits2)).digest != p.digest


@pytest.mark.parametrize("bad,match", [
    ({"format": "other"}, "not a codec profile"),
    ({"extra": 1}, "unknown codec profile fields"),
    ({"bits": [[[2, 4]]]}, "at least the bits"),
    ({"name": "../etc"}, "profile name"),
    ({"sink_blocks": -1}, "sink_blocks"),
])
def test_bad_profiles_are_refused_with_a_reason(tmp_path, bad, match):
    good = Profile("p", Budget(np.full((1, 1, 2), 4))).to_dict()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**good, **bad}))
    with pytest.raises(ValueError, match=match):
        Profile.load(str(path))


def test_built_in_uniform_names():
    layout = BlockLayout(30, 3, 16, 64)
    p = uniform_profile("k4v2", layout)
    assert p is not None and p.budget.rotate and p.budget.key_mode == "token"
    assert (p.budget.bits[..., 0] == 4).all() and (p.budget.bits[..., 1] == 2).all()
    kivi = uniform_profile("kivi-k3v3", layout)
    assert kivi is not None and not kivi.budget.rotate and kivi.budget.key_mode == "channel"
    assert encoded_bytes(layout, kivi.budget) > encoded_bytes(layout, Budget.uniform(layout, 3))  # per-channel scales
    assert uniform_profile("smollm2-3b", layout) is None
    with pytest.raises(ValueError):
        uniform_profile("k2v4", layout)
