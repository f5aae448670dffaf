"""The default policy: attention-weighted, prefix-tree-aware value eviction.

Value of block b at time t (higher = keep):

    U_b(t) = F_b(t) * C_b / S_b * W_b

- F_b, reuse: an LRFU-style decayed hit count. Each hit of a chain credits
  every matched block 1 (`HIT_CREDIT`); a commit credits the new block
  `INSERT_CREDIT` (most blocks are referenced once, so a first touch is worth
  less than a hit); between events F decays as 2^(-dt / HALF_LIFE_S).
- C_b, recompute cost the block saves: tokens * (1 + depth_tokens /
  ATTN_CONTEXT_TOKENS), i.e. tokens*(c_lin + c_attn*depth_tokens) with
  c_lin = 1 and c_attn = 1/ATTN_CONTEXT_TOKENS: the context length at which a
  token's attention FLOPs equal its linear FLOPs (~4*L*d vs ~2*N per token
  for a Llama-8B shape gives ~30k; we use 32768).
- S_b, its size in bytes.
- W_b, the attention term: 1 + ATTENTION_WEIGHT * (2*A_b - 1), with A_b the
  engine's estimate clamped to [0, 1] (see `block_key_norm_score`); an absent
  estimate counts as A_b = 0.5, so W_b = 1 and the term is neutral. It is
  bounded to [1 - w, 1 + w]: a noisy signal can reorder blocks whose values
  are within that factor, never more.
- History: a block dropped from the tier leaves its F behind in a ghost table
  (at most as many entries as resident blocks, oldest dropped first); a block
  re-admitted from the ghost table resumes that decayed F (ARC/LRFU history),
  so a chain that keeps coming back earns its place.

Tree rule: V_b = max(U_b, V_c for every child c the policy has seen) and is
kept when the children leave, so a prefix is worth at least its best
continuation. Hits and inserts raise ancestors until nothing changes. Only
leaves are victims (the store enforces it; the candidate heap holds leaves
only); among them the lowest V goes.

All blocks decay at the same rate, so the order of two blocks changes only
when one of them is touched. The heap therefore stores time-free keys in the
log domain, log2 V + t / HALF_LIFE_S, and never needs re-sorting.

Constants (fixed; how they were chosen is in docs/benchmarks.md):
HALF_LIFE_S, INSERT_CREDIT, HIT_CREDIT, ATTN_CONTEXT_TOKENS, ATTENTION_WEIGHT,
GHOST_FACTOR (ghost table size relative to resident blocks).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from eviction.base import BlockInfo, EvictionPolicy, Key, register_policy
from eviction.lfu import LeafQueues

HALF_LIFE_S = 600.0
INSERT_CREDIT = 0.5
HIT_CREDIT = 1.0
ATTN_CONTEXT_TOKENS = 32768
ATTENTION_WEIGHT = 0.2
GHOST_FACTOR = 1.0
INHERIT = 0.0
DEPTH_PRIOR = True
PRIOR_DECAY_EVENTS = 20000


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """The constants above as one value, so replays can compare variants."""

    half_life_s: float = HALF_LIFE_S
    insert_credit: float = INSERT_CREDIT
    hit_credit: float = HIT_CREDIT
    attn_context_tokens: float = ATTN_CONTEXT_TOKENS
    attention_weight: float = ATTENTION_WEIGHT
    ghost_factor: float = GHOST_FACTOR
    inherit: float = INHERIT
    ghost_credit: float = INSERT_CREDIT
    depth_prior: bool = DEPTH_PRIOR

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or self.attn_context_tokens <= 0:
            raise ValueError("half_life_s and attn_context_tokens must be positive")
        if not 0 <= self.attention_weight < 1:
            raise ValueError("attention_weight must be in [0, 1): the attention term must stay positive")
        if self.insert_credit <= 0 or self.hit_credit <= 0 or self.ghost_factor < 0:
            raise ValueError("credits must be positive and ghost_factor non-negative")


class AttentionPolicy(EvictionPolicy):
    name = "attention"

    def __init__(self, clock=None, params: AttentionParams = AttentionParams(), **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self.params = params
        self._leaves = LeafQueues()
        self._freq: dict[Key, float] = {}  # log2 F_b + t_b / h (time-free)
        self._static: dict[Key, float] = {}  # log2 (C_b / S_b * W_b)
        self._cost: dict[Key, float] = {}  # log2 (C_b / S_b)
        self._ghost: OrderedDict[Key, float] = OrderedDict()
        self._bucket: dict[Key, int] = {}
        self._prior_ins = [1.0] * 32
        self._prior_hit = [1.0] * 32
        self._prior_events = 0

    # -- the value --------------------------------------------------------
    def _credit(self, key: Key, credit: float, now_h: float) -> None:
        """F_b <- F_b * 2^(-dt/h) + credit, in the time-free log domain."""
        old = self._freq.get(key)
        if old is None:
            self._freq[key] = math.log2(credit) + now_h
            return
        decayed = old - now_h  # log2 of F_b now
        if decayed < -60:
            self._freq[key] = math.log2(credit) + now_h
        else:
            self._freq[key] = math.log2(2.0**decayed + credit) + now_h

    def value(self, key: Key) -> float:
        """Time-free log value log2 V_b + t/h (compare only against each other)."""
        return self._leaves.prio[key]  # type: ignore[return-value]

    def _raise(self, key: Key, val: float) -> None:
        """Set key's value to at least `val` (its own U) and lift ancestors to keep parent >= child."""
        leaves = self._leaves
        prio = leaves.prio
        cur = prio.get(key, -math.inf)
        if val > cur:
            leaves.update(key, "v", val)
        top = max(val, cur)
        parent = leaves.parent.get(key)
        while parent is not None and parent in prio and prio[parent] < top:  # type: ignore[operator]
            leaves.update(parent, "v", top)
            parent = leaves.parent.get(parent)

    def _own(self, key: Key) -> float:
        val = self._freq[key] + self._static[key]
        if self.params.depth_prior:
            b = self._bucket[key]
            val += math.log2(self._prior_hit[b] / self._prior_ins[b])
        return val

    def _tick_prior(self) -> None:
        self._prior_events += 1
        if self._prior_events % PRIOR_DECAY_EVENTS == 0:
            self._prior_ins = [max(x * 0.5, 1.0) for x in self._prior_ins]
            self._prior_hit = [max(x * 0.5, 1.0) for x in self._prior_hit]

    # -- events -------------------------------------------------------------
    def on_insert(self, info: BlockInfo) -> None:
        p = self.params
        key = info.key
        now_h = self.clock() / p.half_life_s
        ghost = self._ghost.pop(key, None)
        if ghost is not None:
            self._freq[key] = ghost
        self._credit(key, p.ghost_credit if ghost is not None else p.insert_credit, now_h)
        parent = info.parent
        if p.inherit > 0 and parent is not None and parent in self._freq:
            siblings = self._leaves.children.get(parent, 0) + 1
            inherited = p.inherit * 2.0 ** (self._freq[parent] - now_h) / siblings
            if math.log2(max(inherited, 1e-300)) + now_h > self._freq[key]:
                self._freq[key] = math.log2(inherited) + now_h
        depth_tokens = info.depth * info.block_tokens
        cost = info.block_tokens * (1.0 + depth_tokens / p.attn_context_tokens)
        self._cost[key] = math.log2(cost / max(info.nbytes, 1))
        bucket = min(int(math.log2(1 + depth_tokens / 512)), 31)
        self._bucket[key] = bucket
        self._prior_ins[bucket] += 1
        self._tick_prior()
        self._static[key] = self._cost[key] + self._attention_log(info.attention)
        own = self._own(key)
        self._leaves.add(key, info.parent, info.nbytes, "v", own)
        self._raise(key, own)

    def on_access(self, keys: Sequence[Key]) -> None:
        p = self.params
        now_h = self.clock() / p.half_life_s
        top = -math.inf
        leaves = self._leaves
        for key in reversed(keys):  # tail first, carrying the max up the chain
            if key not in leaves:
                continue
            self._credit(key, p.hit_credit, now_h)
            self._prior_hit[self._bucket[key]] += 1
            top = max(top, self._own(key), leaves.prio[key])  # type: ignore[type-var]
            leaves.update(key, "v", top)
        if keys and keys[0] in leaves:
            self._raise(keys[0], top)

    def on_feedback(self, key: Key, attention: float) -> None:
        if key not in self._leaves:
            return
        self._static[key] = self._cost[key] + self._attention_log(attention)
        self._raise(key, self._own(key))

    def _attention_log(self, attention: float | None) -> float:
        if attention is None or not math.isfinite(attention):
            return 0.0
        a = min(1.0, max(0.0, float(attention)))
        return math.log2(1.0 + self.params.attention_weight * (2.0 * a - 1.0))

    def on_remove(self, key: Key) -> None:
        if key not in self._leaves:
            return
        self._leaves.remove(key)
        del self._static[key], self._cost[key], self._bucket[key]
        self._ghost[key] = self._freq.pop(key)
        limit = int(self.params.ghost_factor * len(self._leaves))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        return self._leaves.pick("v", n_bytes, evictable) or None

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)


def block_key_norm_score(keys, block_tokens: int) -> np.ndarray:
    """Per-block attention estimate from post-RoPE keys (KnormPress: low key norm, more attention).

    `keys`: array-like `[num_tokens, num_kv_heads, head_dim]` (numpy or torch,
    any float dtype) for one or more layers stacked on axis 0 of a 4-D input
    `[num_layers, num_tokens, heads, head_dim]`. Per (layer, head), token key
    norms are rank-normalised to [0, 1] (so scales of different heads do not
    mix), negated (low norm = high score), averaged over layers and heads, and
    averaged over each block's tokens. A trailing partial block is scored on
    its tokens. Returns float64 `[num_blocks]` in [0, 1], ranked within the
    call, ready for `commit(attention=...)`.
    """
    if hasattr(keys, "detach"):
        keys = keys.detach().float().cpu().numpy()
    k = np.asarray(keys, dtype=np.float32)
    if k.ndim == 3:
        k = k[None]
    if k.ndim != 4:
        raise ValueError("keys must be [tokens, heads, head_dim] or [layers, tokens, heads, head_dim]")
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    num_tokens = k.shape[1]
    if num_tokens == 0:
        return np.zeros(0)
    norms = np.linalg.norm(k, axis=-1)  # [layers, tokens, heads]
    ranks = norms.argsort(axis=1).argsort(axis=1).astype(np.float64)
    token_score = 1.0 - ranks / max(num_tokens - 1, 1)  # low norm -> near 1
    per_token = token_score.mean(axis=(0, 2))
    num_blocks = -(-num_tokens // block_tokens)
    padded = np.full(num_blocks * block_tokens, np.nan)
    padded[:num_tokens] = per_token
    block = np.nanmean(padded.reshape(num_blocks, block_tokens), axis=1)
    if num_blocks == 1:
        return np.array([0.5])
    order = block.argsort().argsort().astype(np.float64)
    return order / (num_blocks - 1)


register_policy("attention", AttentionPolicy)
