"""The attention policy's half-life, chosen online among experts by miniature simulations.

No single half-life fits every workload (docs/benchmarks.md, "Every trace"):
agent loops want reuse forgotten within ~30 s (LRU-like), documents queried
at random want it kept for tens of minutes (LFU-like), chat sits in between.
`HalfLifeExperts` runs one *expert* per half-life in `HALF_LIVES_S` beside
the policy and lets the expert that would have hit most often, by a clear
margin, choose the half-life whose values the policy evicts by.

- Experts see a sample of the keys: a key is sampled iff a fixed hash of it
  falls in 1 / 2^`SAMPLE_BITS` (the same in every process, no PYTHONHASHSEED).
  Keys sampled by hash keep their reuse pattern, so the sampled references are
  a small copy of the workload (SHARDS, Waldspurger et al., FAST'15).
- Each expert is a miniature cache (`MiniCache`) replaying the sampled
  references: the policy's reuse count F (credited exactly as the policy
  credits it: insert, hit, return from its own ghost table) decayed with the
  expert's half-life, the lowest F evicted, as many blocks held as the policy
  holds sampled blocks now (so it follows the tier's size), and a ghost table
  of `ghost_factor` x that many evicted keys. A reference is a hit in the
  miniature or not; that is the expert's score. Unlike a threshold on the
  expert's counts (what this module did first), a miniature pays for keeping
  stale blocks, so a long memory is judged fairly (it lost conversation 16k by
  .013 as a threshold expert; docs).
- Decision: every max(16, C / 8) sampled references (C = sampled blocks held)
  the expert with the highest score takes the lead if it is ahead of the
  leader by more than `SWITCH_SIGMAS` = 2 standard deviations of their
  difference. Scores decay by half per C / 2 sampled references (half a
  turnover of the sampled cache), so a workload that changes is followed
  within a few turnovers. Two experts score differently only on references
  where one hits and the other misses; if they were equally good each such reference would
  be +w or -w at random, so the difference of their scores has a standard
  deviation of sqrt(sum of w^2 over their disagreements), which is kept per
  pair. Without the test the lead followed noise wherever the experts are
  nearly as good as each other (121 switches on tenants at 1k blocks, where
  the miniatures hold 125 keys, and LFU stayed ahead); with it a clear change
  (the shift trace's new hot set) still moves the lead within a turnover or two.
- Early evidence. While the tier holds every block it is sent, the
  miniatures hold every sampled key, hit alike and carry no evidence; a hot
  set that moves then is seen only once the tier evicts, and the lead followed
  it 1.3-1.5 fiftieths of the trace late (shift at 16k blocks lost .003-.006
  to LRU in five draws). So every expert also runs a second miniature of
  `EARLY_FRACTION` = 0.5 of the size, over the same sampled references,
  scored and tested the same way. It evicts before the tier does and shows
  which memory wins at the nearest smaller size. Its test can move the lead
  only while the full-size miniatures have fewer than `EARLY_EVIDENCE` = 4
  (decayed, weighted) disagreements between the leader and any other expert:
  before the tier's first evictions, in the stretch after them before the
  full-size miniatures split (where the shift trace's move is made: a rule
  on evictions instead loses it, session 14), or while the experts agree
  (tenants at 1k blocks, where their moves cost .0008). Where the tier
  evicts from the start and the experts differ (scan), the full-size ones
  have that evidence within a turnover and decide as before.
- The policy keeps every block's value under every expert's half-life
  (eviction/attention.py) and orders its tier by the leader's: a switch
  re-keys the tier's leaves at once (O(resident blocks), a few times per
  thousand references at most), so it is exact and reversible. A stretch
  under the wrong expert costs only the evictions made in it, never the
  counts: with one value per block, switching changed only the decay rate
  from then on, so counts decayed at 30 s were lost for good and a 2000 s
  warm-up outlived a hot set that moved (held-out shift draws at 16k: -.02
  against LRU before, -.002 to -.003 with the re-key; docs, "Every trace").
- The policy starts with the longest half-life. While the tier still holds
  everything, the miniatures tie and the start keeps leading.

Constants, and why none needs re-tuning per workload:

- `HALF_LIVES_S` = 30 s, 240 s, 2000 s: one short, the value the policy was
  tuned to on the conversation trace with a fixed half-life, one long, 8x
  apart. Every fixed half-life lost to a textbook policy somewhere; a finer
  grid (8 s or 15 ... 4000 s) or an infinite one gave fewer cells at or above
  the best baseline (docs). A workload whose reuse lives outside 30-2000 s
  gets the nearest expert, which is what a fixed policy gave it at best.
- `SAMPLE_BITS` = 3 (1 key in 8): cost against noise. Simulating every key
  gave the same cells at twice the cost; 1 in 4 was no better.
- Ghost tables of 16 x (blocks held), in the miniatures and in the policy
  (`GHOST_FACTOR` in attention.py): a block that returns after 4 turnovers of
  a small cache is still recognised; with 4x the choice at 1k blocks was
  worse (synthetic 1k against ARC: -.0120 with 4x, -.0009 with 16x).
- `SCORE_HALF_TURNOVERS` = 0.5 and `SWITCH_SIGMAS` = 2, chosen together (all
  with the re-key, 21 cells / held-out seeds 7 and 8, cells at or above the
  best baseline): no test, halving per turnover: 13 / 14 of 30; a window of
  at least 512 or 2048 references instead of a test: 13 / 15 and 13 / 19,
  but synthetic 1k fell to -.0108 (that short trace wants a quick choice);
  1, 1.5, 2 sigmas per turnover: 14 / 15, 14 / 18, 16 / 19; 2 sigmas per half
  turnover: 16 / 20 (kept); per quarter: 16 / 17; 3 sigmas per half: 15 / 20
  (docs, "Every trace"). The test is a significance level, not a workload
  setting: its units are the experts' own disagreements, whatever the tier's
  size, the request rate or the sampling rate, and the window is counted in
  turnovers of the sampled cache, not in seconds.
- `EARLY_FRACTION` = 0.5 and `EARLY_EVIDENCE` = 4 (session 13; 21 main cells /
  30 held-out of seeds 7-8 / 30 of seeds 9-10, cells at or above the best
  baseline and worst margin): without early miniatures 16, -.0031 / 20, -.0061
  / 20, -.0060; with them 17, -.0009 / 20, -.0059 / 20, -.0030 (shift 16k in
  the five draws: +.0004, -.0011, -.0011, -.0007, -.0006; synthetic 1k, lost
  to ARC before, +.0013). A quarter of the size: 17, -.0044 / 19 (synthetic
  1k falls); three quarters: 16, -.0034 / 20 (the move is seen too late:
  shift 16k -.0012); heard up to 16 disagreements: 17, -.0017 / 20, -.0075
  (they overrule a full-size order that has begun to show: scan 4k, agentic
  1k); up to 1: 14, -.0034 / 20. Both are in the experts' own units: a share
  of the tier's size and a count of their disagreements. The early
  miniatures double the experts' work, on the sampled keys only
  (docs/eviction_study.md, "Early evidence").
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from typing import Hashable, Sequence

Key = Hashable

HALF_LIVES_S = (30.0, 240.0, 2000.0)
SAMPLE_BITS = 3
SCORE_HALF_TURNOVERS = 0.5
SWITCH_SIGMAS = 2.0
EARLY_FRACTION = 0.5
EARLY_EVIDENCE = 4.0
FORGET_LOG2 = -60  # a count decayed below 2^-60 of a credit starts over (here and in attention.py)
_MIX = 0x9E3779B97F4A7C15
_MASK = 0xFFFFFFFFFFFFFFFF
_log2 = math.log2
_heappush = heapq.heappush


def sampled(key: Key, bits: int = SAMPLE_BITS) -> bool:
    """Whether the experts follow `key`: a fixed 64-bit mix of it has `bits` leading zero bits."""
    if type(key) is tuple and key:
        key = key[-1]  # the store's keys are (namespace, block hash)
    if type(key) is bytes or isinstance(key, (bytes, bytearray)):
        x = int.from_bytes(key[:8], "little")
    elif isinstance(key, int):
        x = key
    else:
        x = int.from_bytes(str(key).encode()[:8].ljust(8, b"\0"), "little")
    return (x * _MIX) & _MASK < 1 << (64 - bits)


class MiniCache:
    """One expert: an LRFU cache with its own half-life over the sampled references."""

    __slots__ = ("half_life_s", "tau", "values", "ghost", "hits", "_heap", "_seq", "_credits", "_ghost_factor")

    def __init__(self, half_life_s: float, credits: tuple[float, float, float], ghost_factor: float) -> None:
        self.half_life_s = half_life_s
        self.tau = 0.0  # this expert's clock: seconds / half_life_s, set before each reference
        self.values: dict[Key, float] = {}  # held key -> time-free log2 F
        self.ghost: OrderedDict[Key, float] = OrderedDict()  # evicted key -> its log2 F, oldest first
        self.hits = 0.0  # decayed hits, in units of the weight of a hit now (HalfLifeExperts._weight)
        self._heap: list[tuple[float, int, Key]] = []  # (log2 F, seq, key): equal F, oldest first; stale skipped
        self._seq = itertools.count().__next__
        self._credits = tuple((c, math.log2(c)) for c in credits)  # insert, hit, ghost return
        self._ghost_factor = ghost_factor

    def reference(self, key: Key, capacity: int, weight: float) -> bool:
        """Replay one reference to `key` holding at most `capacity` keys; True if it was a hit."""
        values, tau = self.values, self.tau
        old = values.get(key)
        hit = old is not None
        if hit:
            self.hits += weight
            credit, log_credit = self._credits[1]
        else:
            old = self.ghost.pop(key, None)
            credit, log_credit = self._credits[0 if old is None else 2]
            if len(values) >= capacity:
                self._trim(capacity - 1)
        if old is None or old - tau < FORGET_LOG2:
            new = log_credit + tau
        else:
            new = _log2(2.0 ** (old - tau) + credit) + tau
        values[key] = new
        heap = self._heap
        _heappush(heap, (new, self._seq(), key))
        if len(heap) > 4 * len(values) + 64:  # drop stale entries
            self._heap = [(f, self._seq(), k) for k, f in values.items()]
            heapq.heapify(self._heap)
        if hit and len(values) > capacity:  # the tier shrank since the last miss
            self._trim(capacity)
        return hit

    def _trim(self, limit: int) -> None:
        """Evict the lowest counts down to `limit` keys, into a ghost table of ghost_factor x (limit + 1)."""
        values, ghost = self.values, self.ghost
        while len(values) > limit and self._heap:
            f, _, k = heapq.heappop(self._heap)
            if values.get(k) == f:
                del values[k]
                ghost[k] = f
        bound = self._ghost_factor * (limit + 1)
        while len(ghost) > bound:
            ghost.popitem(last=False)


def check_early_fraction(early_fraction: float) -> None:
    """ValueError unless `early_fraction` is in [0, 1) (AttentionParams checks it at construction too)."""
    if not 0 <= early_fraction < 1:
        raise ValueError("early_fraction must be in [0, 1) (0: no early miniatures)")


def _count_apart(apart: list[list[float]], hits: list[bool], weight: float) -> None:
    """A disagreement (one expert hit, another missed; the caller checks that they split): every
    pair that split counts weight^2."""
    w2 = weight * weight
    for i, hit in enumerate(hits):
        for j in range(i + 1, len(hits)):
            if hits[j] != hit:
                apart[i][j] += w2
                apart[j][i] += w2


class HalfLifeExperts:
    """The miniature caches, the sampled keys the policy holds, and the choice of the leader."""

    def __init__(self, half_lives: Sequence[float] = HALF_LIVES_S, start: float | None = None, *,
                 insert_credit: float, hit_credit: float, ghost_credit: float, ghost_factor: float,
                 sample_bits: int = SAMPLE_BITS, early_fraction: float = EARLY_FRACTION) -> None:
        if not half_lives or min(half_lives) <= 0 or not all(math.isfinite(h) for h in half_lives):
            raise ValueError("half_lives must be positive and finite")
        check_early_fraction(early_fraction)
        self.half_lives = tuple(float(h) for h in half_lives)
        start = max(self.half_lives) if start is None else start
        if start not in self.half_lives:
            raise ValueError(f"the starting half-life {start} must be one of {self.half_lives}")
        self.lead = self.half_lives.index(start)
        self.sample_bits = sample_bits
        credits = (insert_credit, hit_credit, ghost_credit)
        self.minis = [MiniCache(h, credits, ghost_factor) for h in self.half_lives]
        # The same experts at early_fraction of the size: heard while the full-size ones have no evidence.
        self.early_fraction = early_fraction
        self.early = [MiniCache(h, credits, ghost_factor) for h in self.half_lives] if early_fraction else []
        self._t: float | None = None
        self._taus = [0.0] * len(self.half_lives)
        self._held: set[Key] = set()  # sampled keys the policy holds now: the miniatures' capacity
        self._weight = 1.0  # the weight of a hit now: scores decay by letting later hits weigh more
        self._decay_for, self._decay = 0, 1.0  # the weight's growth per reference, for this capacity
        self._refs = 0
        n = len(self.half_lives)
        # [i][j]: sum of w^2 over references where experts i and j disagreed (one hit, one missed)
        self._apart = [[0.0] * n for _ in range(n)]
        self._apart_early = [[0.0] * n for _ in range(n)]  # the same, between the early miniatures
        self.switches = 0
        self.early_switches = 0  # of the switches, those the early miniatures made
        self.led = [0] * len(self.half_lives)  # sampled references seen while each expert led

    @property
    def half_life_s(self) -> float:
        return self.half_lives[self.lead]

    @property
    def scores(self) -> list[float]:
        """Each expert's decayed hit count, in hits as of now."""
        return [m.hits / self._weight for m in self.minis]

    def advance(self, t: float) -> list[float]:
        """Move every expert's clock to time `t` (seconds); their clocks, in half-lives of each.

        The clocks start at 0 at the first call and never step back; the policy
        keeps each block's value under expert i against clock i."""
        last = self._t
        if last is not None and t <= last:
            return self._taus
        if last is not None:  # a new list per reading: callers may keep it
            dt = t - last
            self._taus = [tau + dt / h for tau, h in zip(self._taus, self.half_lives)]
        self._t = t
        return self._taus

    # -- events (the policy calls advance() first) ---------------------------------
    def inserted(self, key: Key) -> bool:
        """`key` entered the tier: a reference the tier missed. Whether the experts follow it (only
        then can the lead change)."""
        if not sampled(key, self.sample_bits) or key in self._held:
            return False
        self._held.add(key)
        self._reference(key)
        return True

    def accessed(self, keys: Sequence[Key]) -> bool:
        """A hit on the held `keys` (others are ignored: they reach `inserted` when committed).
        Whether the experts followed any of them."""
        held, seen = self._held, False
        for key in keys:
            if key in held:
                self._reference(key)
                seen = True
        return seen

    def removed(self, key: Key) -> None:
        self._held.discard(key)

    # -- internals -----------------------------------------------------------------
    def _reference(self, key: Key) -> None:
        capacity = len(self._held) or 1
        weight = self._weight
        taus = self._taus  # every miniature's clock is set here, not on every event (advance())
        for m, tau in zip(self.minis, taus):
            m.tau = tau
        if self.early:
            for m, tau in zip(self.early, taus):
                m.tau = tau
            small = max(1, int(capacity * self.early_fraction))
            hits = [m.reference(key, small, weight) for m in self.early]
            if True in hits and False in hits:
                _count_apart(self._apart_early, hits, weight)
        hits = [m.reference(key, capacity, weight) for m in self.minis]
        if True in hits and False in hits:
            _count_apart(self._apart, hits, weight)
        if capacity != self._decay_for:  # scores halve per SCORE_HALF_TURNOVERS x capacity references
            self._decay_for, self._decay = capacity, 2.0 ** (1.0 / (SCORE_HALF_TURNOVERS * capacity))
        self._weight = weight * self._decay
        self.led[self.lead] += 1
        self._refs += 1
        if self._refs >= max(16, capacity // 8):
            self._refs = 0
            self._decide()

    def _decide(self) -> None:
        if self._weight > 1e100:  # renormalise; only the scores' order and ratios matter
            w = self._weight
            for m in self.minis + self.early:
                m.hits /= w
            self._apart = [[x / (w * w) for x in row] for row in self._apart]
            self._apart_early = [[x / (w * w) for x in row] for row in self._apart_early]
            self._weight = 1.0
        if self._switch(self.minis, self._apart) or not self.early:
            return
        lead = self.lead
        evidence = max((x for j, x in enumerate(self._apart[lead]) if j != lead), default=0.0)
        if evidence < EARLY_EVIDENCE * self._weight * self._weight:  # none at full size (yet, or any more)
            if self._switch(self.early, self._apart_early):
                self.early_switches += 1

    def _switch(self, minis: list[MiniCache], apart: list[list[float]]) -> bool:
        """Give the lead to the expert scoring highest in `minis`, if it is ahead of the leader by
        more than SWITCH_SIGMAS standard deviations of their difference; whether it did."""
        lead = self.lead
        best = max(range(len(minis)), key=lambda i: (minis[i].hits, i == lead))
        if best != lead and minis[best].hits - minis[lead].hits > SWITCH_SIGMAS * apart[best][lead] ** 0.5:
            self.lead = best  # the policy re-keys its tier to this expert's values (attention.py)
            self.switches += 1
            return True
        return False
