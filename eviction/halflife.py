"""The attention policy's half-life, chosen online among experts by counterfactual hit counts.

No single half-life fits every workload (docs/benchmarks.md, "Every trace"):
agent loops want reuse forgotten within ~30 s (LRU-like), documents queried
at random want it kept for tens of minutes (LFU-like), chat sits in between.
`HalfLifeExperts` runs one *expert* per half-life in `HALF_LIVES_S` beside
the policy and lets the expert that would have hit most often set the
half-life the policy decays its reuse counts with.

- Experts see a sample of the keys: a key is sampled iff a fixed hash of it
  falls in 1 / 2^`SAMPLE_BITS` (the same in every process, no PYTHONHASHSEED).
  For every sampled key, resident or remembered (its ghost), each expert keeps
  its own decayed reuse count F_i, credited exactly as the policy credits F
  (insert, hit, return from the ghost table) but decayed with its own
  half-life. Keys sampled by hash keep their reuse pattern, so the sample is a
  small copy of the workload (SHARDS, Waldspurger et al., FAST'15).
- Counterfactual hits: expert i, holding as many blocks as the policy, would
  hold the blocks with the highest F_i among the blocks it could hold, i.e.
  the sampled resident and remembered ones (N keys, of which C resident). So
  its threshold q_i is the F_i at rank C of N, estimated from `QUANTILE_KEYS`
  random sampled keys, and a reference to a sampled key (a hit, or a block
  re-admitted from the ghost table) scores one for every expert whose F_i of
  that key, just before the reference, was >= q_i. Blocks never seen before
  score for nobody. This judges every expert on every reference at the cost
  of a few float operations, without simulating any cache.
- Decision: every max(16, C / 8) sampled references the thresholds are
  re-estimated and the expert with the highest score leads (ties keep the
  current one). Scores decay by half per C sampled references (one turnover
  of the sampled cache), so a workload that changes is followed within a few
  turnovers.
- Switching costs nothing: the policy's time-free keys are log2 V + tau with a
  clock tau that advances at rate 1 / (half-life of the leader); a switch only
  changes the rate from then on (values are continuous, no re-keying).

Constants, and why none needs re-tuning per workload:

- `HALF_LIVES_S` = 30 s, 240 s, 2000 s: one short, one the value tuned on the
  conversation trace before this module existed, one long, 8x apart. A fixed
  half-life in seconds or in cache turnovers lost somewhere (docs); choosing
  among three was at or above the best classical baseline in 11 of 21 cells
  (any fixed one: at most 8). Experts in cache turnovers (0.5, 4, 32) did
  worse (10 cells, worst -.033), a finer grid of five (15 ... 4000 s) no
  better (10 cells). A workload whose reuse lives far outside 30-2000 s gets
  the nearest expert, which is what the fixed policy gave it at best. A half-life of infinity (pure LFU) is not an expert: the
  ghost table forgets blocks it would hold forever, so its counterfactual
  counts were optimistic (it led on the conversation trace at 16k blocks,
  where it loses .07).
- `SAMPLE_BITS` = 3 (1 key in 8): cost against noise. Judging every key gave
  the same cells (11) and mean (+.0034 vs +.0032, both with 8x ghosts) at
  about twice the policy's cost; 1 in 8 costs 12-13% of replay speed.
- `QUANTILE_KEYS` = 128: the rank C of N is read to within ~1/sqrt(128) of
  its quantile; finer did not change decisions.
- `SCORE_HALF_TURNOVERS` = 1: scores halve per turnover of the sampled cache
  (counted in references, so it does not depend on the request rate). Halving
  per 6.6 turnovers (longer memory) gave 10 cells and mean +.0023, per 0.43
  turnovers 11 cells and +.0024; 1 gave 11 and +.0030.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Hashable, Sequence

Key = Hashable

HALF_LIVES_S = (30.0, 240.0, 2000.0)
START_S = 240.0
SAMPLE_BITS = 3
QUANTILE_KEYS = 128
SCORE_HALF_TURNOVERS = 1.0
_MIX = 0x9E3779B97F4A7C15
_MASK = 0xFFFFFFFFFFFFFFFF


def sampled(key: Key, bits: int = SAMPLE_BITS) -> bool:
    """Whether the experts follow `key`: a fixed 64-bit mix of it has `bits` leading zero bits."""
    if isinstance(key, tuple) and key:
        key = key[-1]  # the store's keys are (namespace, block hash)
    if isinstance(key, (bytes, bytearray)):
        x = int.from_bytes(key[:8], "little")
    elif isinstance(key, int):
        x = key
    else:
        x = int.from_bytes(str(key).encode()[:8].ljust(8, b"\0"), "little")
    return ((x * _MIX) & _MASK) >> (64 - bits) == 0 if bits else True


class HalfLifeExperts:
    """One decayed reuse count per expert for every sampled key, and the choice of the leader."""

    def __init__(self, half_lives: Sequence[float] = HALF_LIVES_S, start: float = START_S, *,
                 insert_credit: float, hit_credit: float, ghost_credit: float, ghost_factor: float,
                 sample_bits: int = SAMPLE_BITS) -> None:
        if not half_lives or min(half_lives) <= 0 or not all(math.isfinite(h) for h in half_lives):
            raise ValueError("half_lives must be positive and finite")
        if start not in half_lives:
            raise ValueError(f"the starting half-life {start} must be one of {tuple(half_lives)}")
        self.half_lives = tuple(float(h) for h in half_lives)
        self.lead = self.half_lives.index(start)
        self.credits = (math.log2(insert_credit), math.log2(hit_credit), math.log2(ghost_credit))
        self._raw = (insert_credit, hit_credit, ghost_credit)
        self.ghost_factor = ghost_factor
        self.sample_bits = sample_bits
        m = len(self.half_lives)
        self.taus = [0.0] * m  # expert i's clock: seconds / half_lives[i]
        self.tau = 0.0  # the policy's clock, at the leader's rate
        self._t: float | None = None
        self._fx: dict[Key, list[float]] = {}  # resident sampled key -> time-free log2 F_i per expert
        self._gx: OrderedDict[Key, list[float]] = OrderedDict()  # remembered (evicted) sampled keys, oldest first
        self._keys: list[Key] = []  # resident + remembered sampled keys, for uniform sampling
        self._pos: dict[Key, int] = {}
        self.threshold: list[float] | None = None  # q_i, log2 F_i now
        self.score = [0.0] * m  # decayed counterfactual hits, in units of the current weight
        self._weight = 1.0  # the weight of a hit now: scores decay by letting later hits weigh more
        self.switches = 0
        self._refs = 0
        self._rng = random.Random(0x5EED)

    @property
    def half_life_s(self) -> float:
        return self.half_lives[self.lead]

    def advance(self, t: float) -> float:
        """Move every clock to time `t` (seconds); the policy's clock tau, in half-lives of the leader."""
        last = self._t
        if last is not None and t > last:
            dt = t - last
            self.taus = [tau + dt / h for tau, h in zip(self.taus, self.half_lives)]
            self.tau += dt / self.half_lives[self.lead]
        self._t = t if last is None or t > last else last
        return self.tau

    # -- events (the policy calls advance() first) ---------------------------------
    def inserted(self, key: Key, returning: bool) -> None:
        """`key` entered the tier; `returning`: it came back from the policy's ghost table."""
        if key in self._fx or not sampled(key, self.sample_bits):
            return
        fx = self._gx.pop(key, None)
        if fx is not None:
            self._judge(fx)  # a reference the policy missed: which experts would have hit?
        elif key not in self._pos:
            self._pos[key] = len(self._keys)
            self._keys.append(key)
        self._fx[key] = self._credit(fx, 2 if returning else 0)
        self._count(1)

    def accessed(self, keys: Sequence[Key]) -> None:
        fxs = self._fx
        n = 0
        for key in keys:
            fx = fxs.get(key)
            if fx is not None:
                n += 1
                self._judge(fx)
                fxs[key] = self._credit(fx, 1)
        if n:
            self._count(n)

    def removed(self, key: Key) -> None:
        fx = self._fx.pop(key, None)
        if fx is None:
            return
        gx = self._gx
        gx[key] = fx
        limit = self.ghost_factor * max(len(self._fx), 1)
        while len(gx) > limit:
            self._forget(gx.popitem(last=False)[0])

    # -- internals -----------------------------------------------------------------
    def _credit(self, fx: list[float] | None, which: int) -> list[float]:
        """F_i <- F_i decayed to now + credit, in the time-free log domain of each expert."""
        log_c, c = self.credits[which], self._raw[which]
        if fx is None:
            return [log_c + tau for tau in self.taus]
        out = []
        for f, tau in zip(fx, self.taus):
            d = f - tau
            out.append((log_c if d < -60 else math.log2(2.0**d + c)) + tau)
        return out

    def _judge(self, fx: list[float]) -> None:
        q = self.threshold
        if q is None:
            return
        score, w = self.score, self._weight
        for i, (f, tau) in enumerate(zip(fx, self.taus)):
            if f - tau >= q[i]:
                score[i] += w

    def _count(self, n: int) -> None:
        """`n` sampled references: decay the scores (by raising the weight of the next ones), maybe decide."""
        c = max(len(self._fx), 1)
        self._weight *= 2.0 ** (n / (SCORE_HALF_TURNOVERS * c))
        self._refs += n
        if self._refs >= max(16, c // 8):
            self._refs = 0
            if self._weight > 1e100:  # renormalise; only the scores' order matters
                self.score = [s / self._weight for s in self.score]
                self._weight = 1.0
            self._estimate_thresholds()
            best = max(range(len(self.score)), key=lambda i: (self.score[i], i == self.lead))
            if best != self.lead:
                self.lead = best  # the policy's clock runs at the new half-life from now on
                self.switches += 1

    def _estimate_thresholds(self) -> None:
        n, c = len(self._keys), len(self._fx)
        if n <= c or n < 32:
            self.threshold = None  # nothing evicted yet: every expert holds everything
            return
        keys, fx, gx, rng = self._keys, self._fx, self._gx, self._rng
        picks = [keys[rng.randrange(n)] for _ in range(QUANTILE_KEYS)]
        rows = [fx.get(k) or gx[k] for k in picks]
        rank = min(QUANTILE_KEYS - 1, int(c / n * QUANTILE_KEYS))
        self.threshold = [sorted((r[i] for r in rows), reverse=True)[rank] - tau for i, tau in enumerate(self.taus)]

    def _forget(self, key: Key) -> None:
        i = self._pos.pop(key)
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._pos[last] = i
