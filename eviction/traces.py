"""Trace helpers that need no store: trace parsing, block expansion, next-use index, tallies (what
`kvstore replay`, tools/replay.py, and tools/bench/policy_sim.py share).

A Mooncake-format trace (FAST'25 release) is JSONL, one request per line:
`timestamp` (ms), `input_length` (tokens), `hash_ids` (prefix-chained ids of
512-token blocks; the parent of `hash_ids[i]` is `hash_ids[i-1]`, the first
has none). `expand` turns a request into the chain of store block hashes at
`block_tokens` tokens per block: trace id i becomes 512/T sub-blocks (i, j),
the request's last trace block only ceil(rest/T) of them, where rest is the
tokens it actually holds. The block hash is 16 bytes, `<QQ` of (id, j): equal
prefixes give equal hashes, and a sub-block's parent is the previous one in
the request, so the tree of the trace is preserved.

`full_blocks` cuts every request to its full blocks of `block_tokens`: what
the store receives from an engine, whose block hashes cover full blocks only
(kvstore/keys.py). In the traces a request's last 512-token block is nearly
always partial and nearly never used again (its tokens change once the
context grows: 0.7% of them come back on the conversation trace, none on the
generated agentic, scan and shift shapes, against 26-96% of the other
blocks), so replaying them as blocks tests how a policy sheds one-off tails,
which the store never holds (docs/eviction.md).

`Tally.compute_hit_ratio` weights each hit by the prefill FLOPs it saves,
tokens * (1 + context / ATTN_CONTEXT_TOKENS) with context the tokens before
the block's middle: deep hits save more than shallow ones.

The store-driving loop lives in tools/replay.py (tools may import kvstore;
eviction/ may not).
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

TRACE_BLOCK_TOKENS = 512
ATTN_CONTEXT_TOKENS = 32768  # same cost model as eviction/attention.py: attention FLOPs = linear FLOPs here
_PACK = struct.Struct("<QQ").pack


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_s: float
    input_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str, limit: int | None = None) -> list[Request]:
    """The first `limit` requests (all when None) of a Mooncake JSONL trace."""
    out: list[Request] = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            ids = tuple(int(i) for i in rec["hash_ids"])
            if not ids:
                continue
            out.append(Request(float(rec.get("timestamp", 0)) / 1000.0, int(rec["input_length"]), ids))
    return out


def _check_block_tokens(block_tokens: int) -> None:
    if block_tokens <= 0 or TRACE_BLOCK_TOKENS % block_tokens:
        raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}, got {block_tokens}")


def _last_tokens(req: Request) -> int:
    """Tokens in the request's last trace block (all 512 for a trace that breaks ceil(len/512): keep every block)."""
    last = req.input_length - TRACE_BLOCK_TOKENS * (len(req.hash_ids) - 1)
    return last if 0 < last <= TRACE_BLOCK_TOKENS else TRACE_BLOCK_TOKENS


def full_blocks(requests: Iterable[Request], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[Request]:
    """The requests cut to their full blocks of `block_tokens` (a trailing partial block dropped);
    a request with no full block is left out. At 512 tokens the last trace id goes when it is partial;
    at fewer, `expand` then yields only the last trace block's full sub-blocks."""
    _check_block_tokens(block_tokens)
    out = []
    for req in requests:
        length = (TRACE_BLOCK_TOKENS * (len(req.hash_ids) - 1) + _last_tokens(req)) // block_tokens * block_tokens
        if length:
            out.append(Request(req.timestamp_s, length, req.hash_ids[: -(-length // TRACE_BLOCK_TOKENS)]))
    return out


def expand(req: Request, block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple[list[bytes], list[int]]:
    """Block hashes and token counts of one request at `block_tokens` per block."""
    _check_block_tokens(block_tokens)
    per = TRACE_BLOCK_TOKENS // block_tokens
    n = len(req.hash_ids)
    last_tokens = _last_tokens(req)
    hashes: list[bytes] = []
    tokens: list[int] = []
    for i, hid in enumerate(req.hash_ids):
        if i < n - 1:
            subs, rest = per, TRACE_BLOCK_TOKENS
        else:
            subs, rest = -(-last_tokens // block_tokens), last_tokens
        for j in range(subs):
            hashes.append(_PACK(hid, j))
            tokens.append(min(block_tokens, rest - j * block_tokens))
    return hashes, tokens


def next_use_index(chains: Iterable[Sequence[bytes]], tag: bytes) -> dict[bytes, list[int]]:
    """For Belady: store key (`tag`, the namespace's, then the hash) -> sorted request positions at which
    it is referenced."""
    future: dict[bytes, list[int]] = defaultdict(list)
    for pos, hashes in enumerate(chains):
        for h in hashes:
            future[tag + h].append(pos)
    return dict(future)


@dataclass(slots=True)
class Tally:
    """Counts of one replay; `summary` turns them into the reported numbers."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    rejected_blocks: int = 0
    compute: float = 0.0
    hit_compute: float = 0.0
    hits_by_tier: dict = field(default_factory=dict)

    def add(self, tokens: Sequence[int], hits: int, tiers: Iterable[str]) -> None:
        self.requests += 1
        self.blocks += len(tokens)
        self.hit_blocks += hits
        self.tokens += sum(tokens)
        self.hit_tokens += sum(tokens[:hits])
        before = 0
        for i, n in enumerate(tokens):
            # prefill FLOPs of the block's tokens, in units of one token's linear FLOPs
            flops = n * (1.0 + (before + n / 2) / ATTN_CONTEXT_TOKENS)
            self.compute += flops
            if i < hits:
                self.hit_compute += flops
            before += n
        for t in tiers:
            self.hits_by_tier[t] = self.hits_by_tier.get(t, 0) + 1

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_blocks / self.blocks if self.blocks else 0.0,
            "tokens": self.tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_ratio": self.hit_tokens / self.tokens if self.tokens else 0.0,
            "prefill_tokens_saved": self.hit_tokens,
            "compute_hit_ratio": self.hit_compute / self.compute if self.compute else 0.0,
            "rejected_blocks": self.rejected_blocks,
            "hits_by_tier": dict(self.hits_by_tier),
        }
