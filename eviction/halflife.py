"""The attention policy's half-life, chosen online among experts.

The default policy (eviction/attention.py) decays every block's reuse count
with a half-life h, and no single h fits every workload. `HalfLifeExperts`
runs one *expert* per half-life in `HALF_LIVES_S` beside the policy and names
the leader; the policy orders its tier by the leader's values. Why each piece
is there, and what it was measured against: docs/eviction.md.

What it computes:

- Sampling: the experts follow a key iff `sampled(key)`, i.e. a fixed 64-bit
  mix of it (of the block hash, for the store's `(namespace, hash)` keys) falls
  in 1 / 2^`SAMPLE_BITS`. The same keys in every process (no PYTHONHASHSEED),
  and a sample by key keeps the workload's reuse pattern (SHARDS, FAST'15).
  At most `MAX_SAMPLED` keys are followed at once: past that (a tier past
  ~5 x 10^5 blocks) the rate falls, the held key of the largest mix let go
  each time (fixed-size SHARDS), so the experts' memory and work stop growing
  with the tier.
- Each expert is a `MiniCache`: an LRFU cache with its own half-life over the
  sampled references, credited exactly as the policy credits a block (insert,
  hit, return from its own ghost table), holding as many keys as the policy
  holds sampled blocks now, evicting the lowest decayed count into a ghost
  table of `ghost_factor` x that many keys (and at most the sampled share of the
  policy's cap, ghosts.py MAX_GHOSTS). A reference is a hit in it or not;
  its score is its decayed hits, halving every `SCORE_HALF_TURNOVERS` x C
  sampled references (C = sampled blocks held).
- Decision, every max(16, C / 8) sampled references: the best-scoring expert
  takes the lead if it is ahead of the leader by more than `SWITCH_SIGMAS`
  standard deviations of their difference, sqrt(sum of w^2 over the
  references where one of the two hit and the other missed), kept per pair.
- Early miniatures: with `early_fraction` > 0 every expert also runs a
  miniature of `early_fraction` x C over the same references, scored and
  tested the same way. Their test may move the lead only while the full-size
  miniatures have less than `EARLY_EVIDENCE` (decayed, weighted
  disagreements) between the leader and every other expert: before the tier
  evicts, the full-size miniatures hold every sampled key and carry no
  evidence.
- The lead starts at `start` (default: the longest half-life).

Inputs: the policy calls `advance(t)` (seconds) before each event, then
`inserted(key)` when a key enters the tier (a miss), `accessed(keys)` on a hit
of held keys, `removed(key)` when it leaves. `inserted` and `accessed` return
whether the experts followed a key; only then can `lead` have changed, and the
policy re-keys its tier to the new leader's values.

Invariants:

- `advance` returns one clock per expert, time in that expert's half-lives
  since the first call; clocks never step back. The policy keeps each block's
  value under expert i against clock i.
- Only sampled keys cost expert state; the miniatures' capacity is the number
  of sampled keys the policy holds now, and after every reference a miniature
  holds at most its capacity.
- The miniatures and the policy credit identically: a count decayed below
  2^`FORGET_LOG2` of a credit starts over, here and in attention.py.
- The lead changes only past the significance test; `switches`,
  `early_switches` and `led` count what happened, for inspection.

Constants: `HALF_LIVES_S` = 30 s, 240 s, 2000 s (one short, the value a
fixed policy was tuned to, one long); `SAMPLE_BITS` = 3 (1 key in 8);
`SCORE_HALF_TURNOVERS` = 0.5; `SWITCH_SIGMAS` = 2; `EARLY_FRACTION` = 0.5;
`EARLY_EVIDENCE` = 4. All but the half-lives are in the experts' own units (a
share of the tier, turnovers of the sampled cache, their disagreements), not
in seconds or requests, so they need no tuning per workload or tier size.
Their measurements: docs/eviction.md, "Why it is built this way".
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Hashable, Sequence

from kvstore.eviction.ghosts import Ghosts, ghost_cap

Key = Hashable

HALF_LIVES_S = (30.0, 240.0, 2000.0)
SAMPLE_BITS = 3
MAX_SAMPLED = 1 << 16  # the most keys the experts follow: past 2^16 x 2^SAMPLE_BITS blocks the rate falls
SCORE_HALF_TURNOVERS = 0.5
SWITCH_SIGMAS = 2.0
EARLY_FRACTION = 0.5
EARLY_EVIDENCE = 4.0
FORGET_LOG2 = -60  # a count decayed below 2^-60 of a credit starts over (here and in attention.py)
_MIX = 0x9E3779B97F4A7C15
TAG_BYTES, STORE_KEY_BYTES = 8, 24  # a store key (kvstore/keys.py): a namespace's tag, then the hash mixed
_MASK = 0xFFFFFFFFFFFFFFFF
_log2 = math.log2
_heappush, _heappop = heapq.heappush, heapq.heappop


def mixed(key: Key) -> int:
    """The fixed 64-bit mix of `key` (of its block hash, for the store's keys: a namespace tag, then the
    hash) that sampling compares: the same in every process (no PYTHONHASHSEED)."""
    if type(key) is tuple and key:
        key = key[-1]  # (namespace, block hash)
    if type(key) is bytes or isinstance(key, (bytes, bytearray)):
        at = TAG_BYTES if len(key) == STORE_KEY_BYTES else 0
        x = int.from_bytes(key[at : at + 8], "little")
    elif isinstance(key, int):
        x = key
    else:
        x = int.from_bytes(str(key).encode()[:8].ljust(8, b"\0"), "little")
    return (x * _MIX) & _MASK


def sampled(key: Key, bits: int = SAMPLE_BITS) -> bool:
    """Whether the experts follow `key` at the rate of `bits`: its mix has `bits` leading zero bits (past
    `MAX_SAMPLED` held keys they follow fewer: `HalfLifeExperts.inserted`)."""
    return mixed(key) < 1 << (64 - bits)


class MiniCache:
    """One expert: an LRFU cache with its own half-life over the sampled references."""

    __slots__ = ("half_life_s", "tau", "values", "ghost", "hits", "_heap", "_seq", "_credits", "_ghost_factor",
                 "_ghost_most", "_fresh")

    def __init__(self, half_life_s: float, credits: tuple[float, float, float], ghost_factor: float,
                 seq=None, ghost_most: float = math.inf) -> None:
        """`seq`: the counter that orders equal counts in the heap, oldest first (the experts share one:
        see `_refer`); `ghost_most`: the most ghosts it keeps, whatever `ghost_factor` x its capacity."""
        self.half_life_s = half_life_s
        self.tau = 0.0  # this expert's clock: seconds / half_life_s, set before each reference
        self.values: dict[Key, float] = {}  # held key -> time-free log2 F
        self.ghost = Ghosts(1)  # evicted key -> its log2 F, oldest first (fingerprints: eviction/ghosts.py)
        self.hits = 0.0  # decayed hits, in units of the weight of a hit now (HalfLifeExperts._weight)
        self._heap: list[tuple[float, int, Key]] = []  # (log2 F, seq, key): equal F, oldest first; stale skipped
        self._seq = itertools.count().__next__ if seq is None else seq
        self._fresh: tuple = (None, None, None)  # (tau, log credit, their sum): the count of a key new at tau
        self._credits = tuple((c, math.log2(c)) for c in credits)  # insert, hit, ghost return
        self._ghost_factor = ghost_factor
        self._ghost_most = ghost_most

    def reference(self, key: Key, capacity: int, weight: float) -> bool:
        """Replay one reference to `key` holding at most `capacity` keys; True if it was a hit."""
        return _refer((self,), key, capacity, weight, (self.tau,), self._seq)[0]

    def _trim(self, limit: int) -> None:
        """Evict the lowest counts down to `limit` keys, into a ghost table of ghost_factor x (limit + 1)."""
        values, ghost = self.values, self.ghost
        while len(values) > limit and self._heap:
            f, _, k = heapq.heappop(self._heap)
            if values.get(k) == f:
                del values[k]
                ghost.put(k, f)
        ghost.trim(min(self._ghost_factor * (limit + 1), self._ghost_most))


def _refer(minis: Sequence[MiniCache], key: Key, capacity: int, weight: float, taus: Sequence[float],
           seq) -> list[bool]:
    """`MiniCache.reference` of `key` in each of `minis` at its clock in `taus` (set as its `tau`), in
    one loop: the experts replay every sampled reference in six miniatures, and a call each would
    cost more than the replay. Whether each was a hit.

    Memory, per sampled key held in six miniatures: the heap entries of one reference share one
    number of `seq` (the minis' counter: within a miniature it still grows with every entry, so ties
    break as with a counter of its own), and keys new at one clock reading share one count (`_fresh`)."""
    hits = []
    order = seq()
    for m, tau in zip(minis, taus):
        m.tau = tau
        values = m.values
        old = values.get(key)
        if old is not None:
            hit = True
            m.hits += weight
            credit, log_credit = m._credits[1]
        else:
            hit = False
            ghost = m.ghost
            old = ghost.pop(key, None)
            credit, log_credit = m._credits[0 if old is None else 2]
            if len(values) >= capacity:  # m._trim(capacity - 1), inline: a miss in a full miniature
                heap, bound = m._heap, m._ghost_factor * capacity
                if bound > m._ghost_most:
                    bound = m._ghost_most
                while len(values) >= capacity and heap:  # (at least one goes: a full miniature has a live entry)
                    f, _, k = _heappop(heap)
                    if values.get(k) == f:
                        del values[k]
                        ghost.put(k, f, bound)  # trimmed to `bound`, oldest first
        if old is None or old - tau < FORGET_LOG2:
            fresh = m._fresh
            if fresh[0] is tau and fresh[1] == log_credit:
                new = fresh[2]
            else:
                new = log_credit + tau
                m._fresh = (tau, log_credit, new)
        else:
            new = _log2(2.0 ** (old - tau) + credit) + tau
        values[key] = new
        heap = m._heap
        _heappush(heap, (new, order, key))
        if len(heap) > 4 * len(values) + 64:  # drop stale entries
            m._heap = [(f, m._seq(), k) for k, f in values.items()]
            heapq.heapify(m._heap)
        if hit and len(values) > capacity:  # the tier shrank since the last miss
            m._trim(capacity)
        hits.append(hit)
    return hits


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
                 sample_bits: int = SAMPLE_BITS, early_fraction: float = EARLY_FRACTION,
                 max_ghosts: float | None = None, max_sampled: int = MAX_SAMPLED) -> None:
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
        seq = itertools.count().__next__  # one for all the miniatures (see `_refer`)
        if not max_sampled >= 1:
            raise ValueError("max_sampled must be at least 1")
        self.max_sampled = max_sampled
        self._below = 1 << (64 - sample_bits)  # keys mixing below it are followed (it only falls: `_shrink`)
        self._by_mix: list[tuple[int, Key]] | None = None  # past max_sampled: (-mix, key) of the held keys
        # A miniature follows the keys mixing below `_below` (1 in 2^sample_bits until `_shrink`), so its
        # history's cap is the policy's (ghosts.py MAX_GHOSTS unless `max_ghosts`) as far as those go.
        self._ghost_cap = ghost_cap(ghost_factor, max_ghosts)
        most = self._ghost_cap * self._below / 2**64
        self.minis = [MiniCache(h, credits, ghost_factor, seq, most) for h in self.half_lives]
        # The same experts at early_fraction of the size: heard while the full-size ones have no evidence.
        self.early_fraction = early_fraction
        self.early = [MiniCache(h, credits, ghost_factor, seq, most) for h in self.half_lives] if early_fraction else []
        self._seq = seq
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
        x = mixed(key)
        held = self._held
        if x >= self._below or key in held:
            return False
        held.add(key)
        if (heap := self._by_mix) is not None:
            _heappush(heap, (-x, key))
            if len(heap) > 2 * len(held) + 64:  # the keys removed since: dropped
                heap[:] = [entry for entry in heap if entry[1] in held]
                heapq.heapify(heap)
        if len(held) > self.max_sampled:
            self._shrink()
            if key not in held:
                return False
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

    def _shrink(self) -> None:
        """Past `max_sampled` held keys, follow fewer (fixed-size SHARDS, FAST'15): the held key of the
        largest mix is let go, with its state in every miniature, and from now on only keys mixing below
        it are followed. A tier of 10^7 blocks then costs the experts what one of ~5 x 10^5 does; the
        rate only falls (the miniatures' capacity, the sampled keys held, falls with it)."""
        held, heap = self._held, self._by_mix
        if heap is None:  # (built once the tier first grows past the sample: a smaller one never pays for it)
            heap = self._by_mix = [(-mixed(k), k) for k in held]
            heapq.heapify(heap)
        while len(held) > self.max_sampled:
            negated, key = _heappop(heap)
            if key in held:
                held.discard(key)
                self._below = min(self._below, -negated)
                most = self._ghost_cap * self._below / 2**64  # (trimmed to it at their next ghost)
                for m in self.minis + self.early:
                    m.values.pop(key, None)  # (its heap entries go stale; no ghost: it is not followed again)
                    m._ghost_most = most

    # -- internals -----------------------------------------------------------------
    def _reference(self, key: Key) -> None:
        capacity = len(self._held) or 1
        weight = self._weight
        taus = self._taus  # every miniature's clock is set here, not on every event (advance())
        if self.early:
            small = max(1, int(capacity * self.early_fraction))
            hits = _refer(self.early, key, small, weight, taus, self._seq)
            if True in hits and False in hits:
                _count_apart(self._apart_early, hits, weight)
        hits = _refer(self.minis, key, capacity, weight, taus, self._seq)
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
