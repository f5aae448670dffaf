"""The default policy: attention-weighted, prefix-tree-aware value eviction.

Value of block b at time t (higher = keep):

    U_b(t) = F_b(t) * C_b / S_b * W_b

- F_b, reuse: an LRFU-style decayed hit count. Each hit of a chain credits
  every matched block `HIT_CREDIT` = 1; a commit credits a new block
  `INSERT_CREDIT` = 0.5 (most blocks are referenced once, so a first touch is
  worth less than a hit); between events F decays as 2^(-dt / h).
- h, the half-life, is chosen online (eviction/halflife.py): experts with
  h = 30 s, 240 s and 2000 s (`HALF_LIVES_S`) each replay 1 key in 8 in a
  miniature cache, and the one that would have hit most, by a significant
  margin, leads (while the full-size miniatures have no evidence, miniatures
  of half the size decide). It starts at the longest. Every block keeps its
  F, C and V under *every* expert's h (a short list per block), and the tier
  is ordered by the leader's: a new leader re-keys the tier's leaves at once
  (`LeafQueues.rekey`), so a switch is exact and a switch back restores the
  order the tier would have had. `AttentionParams(adapt=False)` is a fixed-h
  policy (`HALF_LIFE_S` = 240 s unless given), for experiments.
- History: a block dropped from the tier leaves its F in a ghost table of at
  most `GHOST_FACTOR` = 16 x (resident blocks) entries, and at most
  `max_ghosts` (2^22, eviction/ghosts.py MAX_GHOSTS: a tier past 262,144
  blocks remembers its last 4 million evictions, ~250 MB), oldest dropped first.
  A block re-admitted from it resumes that decayed F plus `GHOST_CREDIT` = 1
  (coming back after eviction is a hit the cache missed: ARC/LRFU history).
- C_b, the recompute cost the block saves, tokens * (1 + depth_tokens /
  ATTN_CONTEXT_TOKENS)^DEPTH_WEIGHT. tokens*(1 + depth/L) is
  tokens*(c_lin + c_attn*depth) with c_lin = 1, c_attn = 1/L, where
  L = ATTN_CONTEXT_TOKENS = 32768 is the context at which a token's attention
  FLOPs (~4*layers*d_model per context token) equal its linear FLOPs
  (~2*params): ~30k for a Llama-8B shape. DEPTH_WEIGHT = 0.25 damps the depth
  factor. While a half-life above `DEPTH_OFF_ABOVE_S` = 1000 s leads (the
  2000 s expert), the depth term is off (weight 0): in the log domain a depth
  factor d is worth d x h seconds of recency, 8x more at 2000 s than at 240 s
  where the weight was set. Each expert's C uses its own weight, so a switch
  changes it exactly.
- S_b, its size in bytes.
- W_b, the attention term: 1 + w_eff * (2*A_b - 1), A_b the engine's estimate
  clamped to [0, 1] (the vLLM connector sends a key-norm estimate:
  connectors/attention_score.py); no estimate
  means W_b = 1. w_eff = ATTENTION_WEIGHT * g with ATTENTION_WEIGHT = 0.5 and
  g in [0, 1] a gate learned online: among blocks that came with an estimate,
  the share referenced again (hit while resident, or re-admitted from the
  ghost table, so the gate does not only see what the policy chose to keep)
  is r_hi for A >= 0.5 and r_lo for A < 0.5; g = (r_hi - r_lo) / (r_hi +
  r_lo) clipped to [0, 1], and 0 until each side has GATE_MIN_BLOCKS = 1000
  blocks (counts are halved every GATE_HALVING = 65536 estimates). A signal
  that does not predict reuse (noise) keeps g near 0, so the policy is its
  no-attention self; a predictive one opens the gate. W_b stays within
  [0.5, 1.5].

Tree rule: V_b = max(U_b, V_c for every child c the policy has seen), kept
when children leave, so a prefix is worth at least its best continuation.
Only leaves are victims (the store enforces it; the candidate heap holds
leaves only), so an internal block's V matters only once it becomes a leaf:
a hit carries the max up the matched chain, and a removed child hands its V
to its parent before the parent becomes a leaf. That is O(1) per insert and
removal (raising all ancestors on every insert would be O(depth^2) per
chain); `value()` returns the full max for inspection. Among leaves the
lowest V goes, and an answer stops after a victim that exposes its parent as
a new leaf (`LeafQueues.pick`).

All blocks decay at the same rate, so the order of two blocks changes only
when one of them is touched: values are time-free log keys, log2 V + tau_i,
tau_i = the time in half-lives of expert i, and the heap never needs
re-sorting except when the leader changes. Events are O(log n) plus the
length of the chain they touch, times the number of experts (3) for the
arithmetic; a switch is O(resident blocks).

Why each constant has its value, and what the policy was measured against:
docs/eviction.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import add as _add
from typing import Callable, Sequence


from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key, register_policy
from kvstore.eviction.halflife import (EARLY_FRACTION, FORGET_LOG2, HALF_LIVES_S, MAX_SAMPLED, SAMPLE_BITS,
                                       HalfLifeExperts, check_early_fraction, sampled)
from kvstore.eviction.ghosts import MAX_GHOSTS
from kvstore.eviction.leaves import DerivedLeaf, GhostTable, LeafQueues

HALF_LIFE_S = 240.0
INSERT_CREDIT = 0.5
HIT_CREDIT = 1.0
GHOST_CREDIT = 1.0
GHOST_FACTOR = 16.0
ATTN_CONTEXT_TOKENS = 32768
DEPTH_WEIGHT = 0.25
DEPTH_OFF_ABOVE_S = 1000.0
ATTENTION_WEIGHT = 0.5
GATE_MIN_BLOCKS = 1000
GATE_HALVING = 65536
# A ghost (eviction/ghosts.py) is a removed block's log F per expert and, last, its estimate A in [0, 1]:
# negated (-0.0 for 0) while the gate still waits for the block's first re-reference, NaN when it had none.
_NO_ESTIMATE = math.nan


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """The constants above as one value, so replays can compare variants."""

    half_life_s: float | None = None  # fixed: the half-life (None: HALF_LIFE_S); adapting: the start (None: longest)
    insert_credit: float = INSERT_CREDIT
    hit_credit: float = HIT_CREDIT
    ghost_credit: float = GHOST_CREDIT
    ghost_factor: float = GHOST_FACTOR
    attn_context_tokens: float = ATTN_CONTEXT_TOKENS
    depth_weight: float = DEPTH_WEIGHT
    attention_weight: float = ATTENTION_WEIGHT
    gate: bool = True  # False: always the full ATTENTION_WEIGHT (for experiments)
    adapt: bool = True  # False: a fixed half_life_s (the policy before eviction/halflife.py)
    half_lives: tuple[float, ...] = HALF_LIVES_S  # the experts, when adapt
    depth_off_above_s: float = DEPTH_OFF_ABOVE_S  # adapting: no depth term while a longer half-life leads
    sample_bits: int = SAMPLE_BITS  # adapting: the experts follow 1 key in 2^sample_bits (0: every key)
    early_fraction: float = EARLY_FRACTION  # adapting: the early miniatures' size, a share of the tier's (0: none)
    max_ghosts: float = MAX_GHOSTS  # the history's cap, whatever ghost_factor x the tier (eviction/ghosts.py)
    max_sampled: int = MAX_SAMPLED  # adapting: the most keys the experts follow (past it, they sample fewer)

    def __post_init__(self) -> None:
        if (self.half_life_s is not None and self.half_life_s <= 0) or self.attn_context_tokens <= 0:
            raise ValueError("half_life_s and attn_context_tokens must be positive")
        if self.adapt and self.half_life_s is not None and self.half_life_s not in self.half_lives:
            raise ValueError(f"half_life_s {self.half_life_s} is not one of the experts {self.half_lives}: "
                             "pick one, or set adapt=False for a fixed half-life")
        if not 0 <= self.attention_weight < 1:
            raise ValueError("attention_weight must be in [0, 1): the attention term must stay positive")
        if min(self.insert_credit, self.hit_credit, self.ghost_credit) <= 0 or self.ghost_factor < 0:
            raise ValueError("credits must be positive and ghost_factor non-negative")
        if not self.max_ghosts >= 0:
            raise ValueError("max_ghosts must be non-negative")
        if type(self.max_sampled) is not int or self.max_sampled < 1:
            raise ValueError("max_sampled must be a positive integer")
        if self.depth_weight < 0:
            raise ValueError("depth_weight must be non-negative")
        if type(self.sample_bits) is not int or not 0 <= self.sample_bits <= 16:
            raise ValueError("sample_bits must be an integer from 0 (every key) to 16")
        check_early_fraction(self.early_fraction)


class AttentionGate:
    """Does the attention estimate predict reuse? g in [0, 1], learned from hits."""

    def __init__(self) -> None:
        self.blocks = [0.0, 0.0]  # blocks with an estimate: [A < 0.5, A >= 0.5]
        self.hit = [0.0, 0.0]  # of those, blocks hit at least once while resident
        self._seen = 0

    def admit(self) -> None:
        self._seen += 1
        if self._seen % GATE_HALVING == 0:
            self.blocks = [x / 2 for x in self.blocks]
            self.hit = [x / 2 for x in self.hit]

    def value(self) -> float:
        if min(self.blocks) < GATE_MIN_BLOCKS:
            return 0.0
        r_lo, r_hi = self.hit[0] / self.blocks[0], self.hit[1] / self.blocks[1]
        if r_hi + r_lo <= 0:
            return 0.0
        return min(1.0, max(0.0, (r_hi - r_lo) / (r_hi + r_lo)))


class _Block(DerivedLeaf):
    """A tracked block: its `DerivedLeaf` and, per expert (one in all for a fixed half-life), its
    time-free log values. Its priority is its value under the leading expert (`prio`), not a float of
    its own. `freq` and `cost` lists are shared between blocks (one per commit's clock reading and per
    block shape) and never mutated: they are replaced."""

    __slots__ = ("freq", "cost", "val")
    queue = "v"
    lead = 0  # the leading expert: set on each policy's own subclass (`AttentionPolicy._record`)
    freq: list[float]  # log2 F_b + tau_i
    cost: _Cost  # log2 (C_b / S_b), with expert i's depth weight; the block's size (`nbytes`) with it
    # log2 V_b + tau_i (own value, tree rule applied; a tuple: 32 B less than a list), or None while it is
    # the block's own F + C (`_val`): a block inserted and not hit or lifted since, as most blocks of a
    # disk tier are, holds no tuple of its own (136 B) and its priority is that sum for the leader.
    val: tuple[float, ...] | None

    def __init__(self, parent: Key | None, children: int, freq: list[float], cost: _Cost,
                 val: tuple[float, ...] | None) -> None:
        self.parent, self.children, self.token = parent, children, None
        self.freq, self.cost, self.val = freq, cost, val

    def assign(self, freq: list[float], cost: _Cost, val: tuple[float, ...] | None) -> None:
        self.freq, self.cost, self.val = freq, cost, val

    @property
    def nbytes(self) -> int:
        """Its size, its shape's (`cost`): without a slot of its own the record is 80 B, not 88 (96 as
        Python's allocator rounds it)."""
        return self.cost.nbytes

    @property
    def prio(self) -> float:
        """V under the leading expert: `val[lead]`, or its own F + C where it holds no `val`."""
        val, lead = self.val, self.lead
        return self.freq[lead] + self.cost[lead] if val is None else val[lead]


class _Cost(list):
    """C per expert (`_Block.cost`), shared by the blocks of one shape (depth, tokens, size), and that
    size: a block's record reads its size here."""

    __slots__ = ("nbytes",)

    def __init__(self, values: list[float], nbytes: int) -> None:
        super().__init__(values)
        self.nbytes = nbytes


def _val(block: _Block) -> tuple[float, ...]:
    """`block`'s V per expert (`val`, or its own F + C where it holds none)."""
    val = block.val
    return tuple(map(_add, block.freq, block.cost)) if val is None else val


def _credited(freq: list[float], taus: list[float], credit: float) -> list[float]:
    """F_b <- F_b * 2^(-dt/h_i) + credit under every expert i, in the time-free log domain
    (log2 F_b + tau_i); a count decayed below 2^FORGET_LOG2 of the credit starts over, as in the
    experts' miniatures (halflife.MiniCache), which must credit exactly as the policy does."""
    lc, log2, forget = math.log2(credit), math.log2, FORGET_LOG2
    return [lc + tau if f - tau < forget else log2(2.0 ** (f - tau) + credit) + tau for f, tau in zip(freq, taus)]


class AttentionPolicy(EvictionPolicy):
    name = "attention"

    def __init__(self, clock=None, params: AttentionParams = AttentionParams(), **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self.params = params
        self.gate = AttentionGate()
        # A record class of its own, whose `lead` is this policy's leading expert (`_follow`).
        self._record = type("_Block", (_Block,), {"__slots__": ()})
        self._leaves = LeafQueues(self._record)  # per block its F, C and V per expert; its priority: V of the leader
        self._att: dict[Key, float] = {}  # A_b, for blocks with an estimate
        self._unhit: set = set()  # blocks with an estimate not yet hit (for the gate)
        self._fixed_h = HALF_LIFE_S if params.half_life_s is None else params.half_life_s
        self.experts = (HalfLifeExperts(params.half_lives, params.half_life_s, insert_credit=params.insert_credit,
                                        hit_credit=params.hit_credit, ghost_credit=params.ghost_credit,
                                        ghost_factor=params.ghost_factor, sample_bits=params.sample_bits,
                                        early_fraction=params.early_fraction, max_ghosts=params.max_ghosts,
                                        max_sampled=params.max_sampled)
                        if params.adapt else None)
        halves = self.experts.half_lives if self.experts is not None else (self._fixed_h,)
        # key -> log F per expert, then the block's estimate (see _NO_ESTIMATE)
        self._ghost = GhostTable(params.ghost_factor, width=len(halves) + 1, most=params.max_ghosts)
        self._depth_w = [params.depth_weight if not params.adapt or h <= params.depth_off_above_s else 0.0
                         for h in halves]
        self._lead = self._record.lead = self.experts.lead if self.experts is not None else 0
        self.rekeys = 0  # switches of the leading expert followed (each re-keys the tier)
        # Shared, never mutated: the F of a first insert for the current clocks, and C per block shape.
        self._fresh: tuple[list[float] | None, list[float]] = (None, [])
        self._costs: dict[tuple[int, int, int], _Cost] = {}
        self._fixed_taus: tuple[float | None, list[float]] = (None, [])

    @property
    def half_life_s(self) -> float:
        """The half-life reuse counts decay with now (the leading expert's, when adapting)."""
        return self.experts.half_life_s if self.experts is not None else self._fixed_h

    @property
    def depth_weight(self) -> float:
        """The depth weight of the order in force now (0 while a long half-life leads)."""
        return self._depth_w[self._lead]

    def _taus(self) -> list[float]:
        """Each expert's clock: time in its half-lives (one clock for a fixed half-life)."""
        if self.experts is not None:
            return self.experts.advance(self.clock())
        t = self.clock()
        if t != self._fixed_taus[0]:
            self._fixed_taus = (t, [t / self._fixed_h])
        return self._fixed_taus[1]

    def _first_freq(self, taus: list[float]) -> list[float]:
        """F of a block's first insert, log2 INSERT_CREDIT + tau_i (one list per clock reading)."""
        if self._fresh[0] is not taus:
            lc = math.log2(self.params.insert_credit)
            self._fresh = (taus, [lc + tau for tau in taus])
        return self._fresh[1]

    def _block_cost(self, info: BlockInfo) -> _Cost:
        """log2 (C_b / S_b) under each expert's depth weight, shared between blocks of one shape."""
        shape = (info.depth, info.block_tokens, info.nbytes)
        cost = self._costs.get(shape)
        if cost is None:
            if len(self._costs) >= 65536:
                self._costs.clear()
            p = self.params
            depth = math.log2(1.0 + info.depth * info.block_tokens / p.attn_context_tokens)
            size = math.log2(info.block_tokens / max(info.nbytes, 1))
            cost = self._costs[shape] = _Cost([size + dw * depth if dw else size for dw in self._depth_w],
                                              info.nbytes)
        return cost

    def _follow(self) -> None:
        """After the experts saw an event: if another one leads, order the tier by its values."""
        lead = self.experts.lead  # type: ignore[union-attr]
        if lead != self._lead:
            self._lead = self._record.lead = lead  # (every block's priority is now its value under `lead`)
            self.rekeys += 1
            self._leaves.rekey()

    # -- the value --------------------------------------------------------
    def value(self, key: Key, kids: dict[Key, list] | None = None) -> float:
        """V_b as a time-free log value, log2 V_b + tau of the leader (compare only against each other).

        Internal blocks store only what reached them so far (their own value, the
        chains carried up by hits, children already removed); their full V, the
        max over the resident subtree, is computed here on demand (`kids`: the
        tracked children of every key, `_children()`; built here when not given).
        """
        kids = self._children() if kids is None else kids
        find = self._leaves.find
        best = find(key).prio  # type: ignore[union-attr]
        stack = list(kids.get(key, ()))
        while stack:
            child = stack.pop()
            best = max(best, find(child).prio)  # type: ignore[type-var, union-attr]
            stack.extend(kids.get(child, ()))
        return best  # type: ignore[return-value]

    def _children_below(self, keys: Sequence[Key]) -> dict[Key, list]:
        """`_children()` for the subtrees of the tracked `keys` only, read from the store's tree
        (`tree_children`): what `value` walks of them, in O(their size). `_children()` walks every tracked
        key: 0.36 s a `kvstore inspect` of a tier of 10^6 blocks, with the daemon's loop stopped."""
        find, children = self._leaves.find, self.tree_children
        assert children is not None
        kids: dict[Key, list] = {}
        stack = [k for k in keys if find(k) is not None]
        while stack:
            key = stack.pop()
            if key not in kids:
                below = kids[key] = [c for c in children(key) if find(c) is not None]
                stack.extend(below)
        return kids

    def _children(self) -> dict[Key, list]:
        kids: dict[Key, list] = {}
        for key, block in self._leaves.tracked.items():
            if (parent := block.parent) is not None:
                kids.setdefault(parent, []).append(key)
        return kids

    def attention_weight(self) -> float:
        """w_eff: ATTENTION_WEIGHT scaled by the gate (unscaled with params.gate False)."""
        return self.params.attention_weight * (self.gate.value() if self.params.gate else 1.0)

    def _own(self, key: Key, freq: list[float], cost: list[float]) -> tuple[float, ...]:
        a = self._att.get(key)
        if a is None:
            return tuple(map(_add, freq, cost))
        w = math.log2(1.0 + self.attention_weight() * (2.0 * a - 1.0))
        return tuple(f + c + w for f, c in zip(freq, cost))

    def _lift(self, key: Key, block: _Block, top: Sequence[float]) -> bool:
        """Raise the values of `key` (its record `block`) to at least `top` (per expert), the heap if
        the leader's rose; False if none rose."""
        cur = _val(block)
        new = tuple(map(max, cur, top))
        if new == cur:
            return False
        block.val = new
        lead = self._lead
        if new[lead] != cur[lead]:
            self._leaves.refresh(key, block)
        return True

    # -- events -------------------------------------------------------------
    def on_insert(self, info: BlockInfo) -> None:
        self._insert(info, self._taus())

    def on_insert_many(self, infos: Sequence[BlockInfo]) -> None:
        """Blocks committed together: one clock reading for all (the store's commit). A block that
        is the parent of another of them gets no heap entry: it stops being a leaf within the call.
        The usual block (first seen, no estimate) takes `_insert`'s steps inline."""
        taus = self._taus()
        inner = {info.parent for info in infos} if len(infos) > 1 else ()
        experts, ghost_pop, costs = self.experts, self._ghost.pop, self._costs
        bits = experts.sample_bits if experts is not None else 0
        add = self._leaves.add
        fresh = self._first_freq(taus)
        for info in infos:
            key = info.key
            ghost = ghost_pop(key, None)
            if ghost is not None or info.attention is not None:
                self._insert(info, taus, key not in inner, ghost)
                continue
            if experts is not None and sampled(key, bits) and experts.inserted(key):
                self._follow()
            cost = costs.get((info.depth, info.block_tokens, info.nbytes)) or self._block_cost(info)
            add(key, info.parent, info.nbytes, "v", None, key not in inner, (fresh, cost, None))  # V: its F + C

    def _insert(self, info: BlockInfo, taus: list[float], leaf: bool = True, ghost: object = None) -> None:
        """Enter one block; `ghost`: what the ghost table held of it (taken out already), else it is
        looked up here."""
        key = info.key
        if ghost is None:
            ghost = self._ghost.pop(key, None)
        if ghost is None:
            freq = self._first_freq(taus)
        else:
            est = ghost[-1]
            if math.copysign(1.0, est) < 0:  # (NaN, no estimate, is positive)
                # re-referenced after eviction while the gate waited for it: reuse the gate must see,
                # or it only sees what we kept
                self.gate.hit[-est >= 0.5] += 1
            freq = _credited(ghost[:-1], taus, self.params.ghost_credit)
        experts = self.experts
        if experts is not None and sampled(key, experts.sample_bits) and experts.inserted(key):
            self._follow()
        cost = self._costs.get((info.depth, info.block_tokens, info.nbytes)) or self._block_cost(info)
        own: tuple[float, ...] | None = None  # V is its own F + C (`_val`)
        if info.attention is not None:
            self._set_attention(key, info.attention)
            own = self._own(key, freq, cost)
        self._leaves.add(key, info.parent, info.nbytes, "v", None, leaf, (freq, cost, own))  # one heap push

    def on_access(self, keys: Sequence[Key]) -> None:
        credit = self.params.hit_credit
        taus = self._taus()
        if self.experts is not None and self.experts.accessed(keys):
            self._follow()
        lead = self._lead
        leaves, att = self._leaves, self._att
        tracked, refresh = leaves.tracked, leaves.refresh
        # _credited, inline: log2(2^(f - tau) + credit) + tau, or a fresh credit once f has decayed away.
        # Blocks committed together share one F list (`_first_freq`), and so do the blocks a hit credited
        # together: a list credited once here is reused for the next block holding that same list.
        lc, log2, forget = math.log2(credit), math.log2, FORGET_LOG2
        top: list[float] | None = None
        was = now = None  # the last F list credited, and what it became
        get = tracked.get
        for key in reversed(keys):  # tail first, carrying the max up the chain
            block = get(key)
            if block is None:
                continue
            freq, val = block.freq, block.val
            if freq is not was:
                was, now = freq, [lc + tau if f - tau < forget else log2(2.0 ** (f - tau) + credit) + tau
                                  for f, tau in zip(freq, taus)]
            block.freq = now
            if att and key in att:
                if key in self._unhit:
                    self._unhit.discard(key)
                    self.gate.hit[att[key] >= 0.5] += 1
                own = self._own(key, now, block.cost)
            else:
                own = map(_add, now, block.cost)  # (consumed once, below: no list of its own)
            if val is None:  # its own F + C (`_val`), F as it was before this hit
                val = map(_add, freq, block.cost)
            top = block.val = tuple(map(max, own, val)) if top is None else tuple(map(max, own, val, top))
            if not block.children:  # (a block with children has no heap entry)
                refresh(key, block)
        if top is not None:  # keep parent >= child above the chain: `_lift` each ancestor while one rises
            block = get(keys[0])
            parent = block.parent if block is not None else None
            if leaves.resting:  # (an ancestor at rest is woken: kvstore/resting.py)
                get = leaves.find
            while parent is not None and (block := get(parent)) is not None:
                cur = _val(block)
                new = tuple(map(max, cur, top))
                if new == cur:
                    break
                block.val = new
                if new[lead] != cur[lead] and not block.children:  # (a block with children: no heap entry)
                    refresh(parent, block)
                parent = block.parent

    def on_feedback(self, key: Key, attention: float) -> None:
        block = self._leaves.find(key)
        if block is None:
            return
        self._set_attention(key, attention)
        self._lift(key, block, self._own(key, block.freq, block.cost))

    def _set_attention(self, key: Key, attention: float) -> None:
        try:
            a = float(attention)
        except (TypeError, ValueError):
            return
        if not math.isfinite(a):
            return
        a = min(1.0, max(0.0, a))
        if key not in self._att:  # first estimate for this residency: count it for the gate
            self.gate.blocks[a >= 0.5] += 1
            self.gate.admit()
            self._unhit.add(key)
        self._att[key] = a

    def on_remove(self, key: Key) -> None:
        leaves = self._leaves
        block = leaves.tracked.get(key)
        if block is None:
            return
        parent = block.parent
        up = (leaves.tracked.get(parent) or (leaves.find(parent) if leaves.resting else None)) \
            if parent is not None else None
        if up is not None:  # the tree rule, applied before it becomes a leaf
            cur = _val(up)  # (`_lift`, inline: eviction removes one block at a time)
            new = tuple(map(max, cur, _val(block)))
            if new != cur:
                up.val = new
                lead = self._lead
                if new[lead] != cur[lead]:
                    leaves.refresh(parent, up)
        leaves.remove(key)
        freq = block.freq
        a = self._att.pop(key, None) if self._att else None
        if a is not None:
            self._ghost.remember(key, (*freq, -a if key in self._unhit else a), len(leaves))
            self._unhit.discard(key)
        else:  # no estimate (the common case without an attention signal): the counts alone
            self._ghost.remember(key, (*freq, _NO_ESTIMATE), len(leaves))
        if self.experts is not None:
            self.experts.removed(key)

    # -- blocks at rest (kvstore/resting.py) ------------------------------------
    def rest(self, key: Key, parent: Key | None) -> tuple[object, object] | None:
        """A record of an inner block of a chain that holds no value of its own (its F and C shared
        with other blocks) and no estimate goes: its F and C."""
        leaves = self._leaves
        rec = leaves.tracked.get(key)
        if (rec is None or rec.val is not None or rec.children != 1 or rec.token is not None or rec.parent != parent
                or key in self._att):
            return None
        leaves.rest(key)
        return rec.freq, rec.cost

    def restore(self, key: Key, parent: Key | None, refs: tuple[object, object]) -> None:
        freq, cost = refs
        self._leaves.restore(key, self._record(parent, 1, freq, cost, None))

    def wake_hook(self, wake: Callable[[Key], object], holds: Callable[[Key], bool]) -> None:
        self._leaves.wake, self._leaves.holds = wake, holds

    def compact(self) -> None:
        self._leaves.compact()

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        return self._leaves.pick("v", n_bytes, evictable) or None

    def evict(self, missing: Callable[[], int], evictable: Callable[[Key], bool],
              take: Callable[[Key], None]) -> bool:
        return self._leaves.evict("v", missing, evictable, take)

    def history(self) -> tuple[int, int]:
        """Its ghost table and, where it adapts, the half-life experts' miniatures' ghosts."""
        tables = [self._ghost.ghosts] + ([m.ghost for m in self.experts.minis + self.experts.early]
                                         if self.experts is not None else [])
        return sum(len(t) for t in tables), sum(t.nbytes for t in tables)

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        """log2 of the value now (the subtree's best, decayed to the present): higher stays longer."""
        now = self._taus()[self._lead]
        kids = self._children() if self.tree_children is None else self._children_below(keys)
        return [f"log2 V {self.value(k, kids) - now:+.2f}" if k in self._leaves else None for k in keys]

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)


register_policy("attention", AttentionPolicy)
