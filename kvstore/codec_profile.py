"""Codec profiles: which bits each (layer, KV head, K/V) of a model gets, chosen from measured distortion.

A profile is a `Budget` (kvstore/codec.py) with a name, for one model shape,
kept as a JSON file (`PROFILE_FORMAT`):

    {"format": "kvstore-codec-profile/1", "name": "smollm2-135m-3b", "model": "...",
     "rotate": true, "key_mode": "token", "bits": [[[K, V], ...heads], ...layers],
     "sink_blocks": 0, "calibration": {...}}

`sink_blocks`: the leading blocks of every prefix (block depth < sink_blocks,
where the attention sink sits) are stored exact. `calibration` says how the
bits were chosen; it is informative only.

Names. `uniform_profile` reads the built-in names `k<K>v<V>` (rotated,
per-token: K and V bits for every head) and `kivi-k<K>v<V>` (keys per
channel, unrotated); any other name is a file `<name>.json` in the profile
folder the daemon's config names.

Allocation (`allocate_bits`). Given each group's distortion at each width
(measured on calibration prompts, weighted by the attention it receives: see
tools/bench/kv_quality.py), the bits minimize the summed distortion under a
total bit budget, keys never below values of the same head: a Lagrangian
choice per head over (K, V) pairs, then greedy upgrades by distortion saved per
bit while the budget allows. Every group's stored size is linear in its bits
(kvstore/codec.py), so a mean-bits budget is a bytes budget.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from kvstore.codec import WIDTHS, BlockLayout, Budget

PROFILE_FORMAT = "kvstore-codec-profile/1"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
UNIFORM_RE = re.compile(r"^(kivi-)?k(\d+)v(\d+)$")


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    budget: Budget
    model: str = ""
    sink_blocks: int = 0
    calibration: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"profile name {self.name!r}: letters, digits, '.', '_', '-' (64 at most)")
        if not isinstance(self.sink_blocks, int) or self.sink_blocks < 0:
            raise ValueError("sink_blocks must be an int >= 0")

    @property
    def digest(self) -> str:
        """What the stored bits depend on (bits, rotation, key mode, sinks): same digest, same blocks."""
        b = self.budget
        return xxhash.xxh3_64_hexdigest(b.bits.tobytes() + bytes([b.flags, self.sink_blocks]) + str(b.bits.shape).encode())

    def fits(self, layout: BlockLayout) -> bool:
        return self.budget.bits.shape == (layout.num_layers, layout.num_kv_heads, 2)

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "name": self.name, "model": self.model, "rotate": self.budget.rotate,
                "key_mode": self.budget.key_mode, "bits": self.budget.bits.tolist(), "sink_blocks": self.sink_blocks,
                "calibration": self.calibration}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a codec profile (format must be {PROFILE_FORMAT!r})")
        unknown = set(data) - {"format", "name", "model", "rotate", "key_mode", "bits", "sink_blocks", "calibration"}
        if unknown:
            raise ValueError(f"unknown codec profile fields: {sorted(unknown)}")
        try:
            budget = Budget(np.asarray(data["bits"], dtype=np.int64), bool(data.get("rotate", True)),
                            data.get("key_mode", "token"))
            return cls(data["name"], budget, str(data.get("model", "")), data.get("sink_blocks", 0),
                       dict(data.get("calibration", {})))
        except KeyError as exc:
            raise ValueError(f"codec profile lacks {exc}") from None

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_dict(json.load(f))
            except json.JSONDecodeError as exc:
                raise ValueError(f"codec profile {path} is not JSON: {exc}") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=None, separators=(",", ":"))
            f.write("\n")


def uniform_profile(name: str, layout: BlockLayout) -> Profile | None:
    """The built-in uniform profile `name` for `layout`, or None when `name` is not a built-in one."""
    m = UNIFORM_RE.match(name)
    if m is None:
        return None
    kivi, kb, vb = bool(m.group(1)), int(m.group(2)), int(m.group(3))
    budget = Budget.uniform(layout, kb, vb, rotate=not kivi, key_mode="channel" if kivi else "token")
    return Profile(name, budget)


def allocate_bits(distortion: np.ndarray, widths: Sequence[int], mean_bits: float) -> np.ndarray:
    """Bits [L, H, 2] minimizing the summed `distortion` ([L, H, 2, len(widths)]: each group's at each
    width) with mean bits <= `mean_bits`, keys >= values per head."""
    widths = [int(w) for w in widths]
    if sorted(widths) != widths or not set(widths) <= set(WIDTHS):
        raise ValueError(f"widths must be ascending, from {WIDTHS}")
    d = np.asarray(distortion, dtype=np.float64)
    if d.ndim != 4 or d.shape[2:] != (2, len(widths)):
        raise ValueError(f"distortion must be [layers, heads, 2, {len(widths)}], got {d.shape}")
    if mean_bits < widths[0]:
        raise ValueError(f"mean_bits {mean_bits} is below the narrowest width {widths[0]}")
    L, H = d.shape[:2]
    pairs = [(i, j) for i in range(len(widths)) for j in range(len(widths)) if widths[i] >= widths[j]]
    pair_bits = np.array([widths[i] + widths[j] for i, j in pairs], dtype=np.float64)
    heads = d.reshape(L * H, 2, len(widths))
    cost = np.stack([heads[:, 0, i] + heads[:, 1, j] for i, j in pairs], axis=1)  # [heads, pairs]
    total = 2 * L * H * mean_bits

    def choose(lam: float) -> np.ndarray:
        return np.argmin(cost + lam * pair_bits[None, :], axis=1)

    lo, hi = 0.0, 1.0
    while pair_bits[choose(hi)].sum() > total:
        hi *= 4
        if hi > 1e30:
            break
    for _ in range(100):
        mid = (lo + hi) / 2
        if pair_bits[choose(mid)].sum() > total:
            lo = mid
        else:
            hi = mid
    pick = choose(hi)
    used = pair_bits[pick].sum()
    while True:  # spend what the Lagrangian choice left, best saving per bit first
        gain = (cost[np.arange(len(pick)), pick][:, None] - cost) / np.maximum(pair_bits[None, :] - pair_bits[pick][:, None], 1e-9)
        allowed = (pair_bits[None, :] > pair_bits[pick][:, None]) & (used - pair_bits[pick][:, None] + pair_bits[None, :] <= total + 1e-9)
        gain = np.where(allowed & (gain > 0), gain, -np.inf)
        h, p = np.unravel_index(np.argmax(gain), gain.shape)
        if not np.isfinite(gain[h, p]):
            break
        used += pair_bits[p] - pair_bits[pick[h]]
        pick[h] = p
    bits = np.array([[widths[pairs[p][0]], widths[pairs[p][1]]] for p in pick], dtype=np.uint8)
    return bits.reshape(L, H, 2)
