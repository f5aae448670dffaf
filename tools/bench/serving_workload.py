"""The fleet benchmark's workload (tools/bench/bench_serving.py), no vLLM: the Mooncake conversation trace
mapped to token ids (sessions, tenants, system prompts; seeded), its statistics, and an engine-free hit
simulation of the benchmark's arms. The mapping is described in bench_serving's docstring."""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK = 512
TOKEN_LO, TOKEN_HI = 1000, 48000  # SmolLM2's vocabulary is 49152; stay clear of its special tokens


# -- workload -----------------------------------------------------------------------------------
@dataclass
class Request:
    idx: int
    arrival_s: float
    session: str
    tenant: int
    hash_ids: list[int]  # after the --max-blocks cap
    prompt: list[int] = field(repr=False)


def load_trace(path: Path | str = TRACE, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit and len(rows) >= limit:
                    break
    return rows


def session_of(row: dict) -> str:
    ids = row["hash_ids"]
    return f"s{ids[1]}" if len(ids) > 1 else f"s{ids[0]}-single"


def block_tokens_for(key: str, block_tokens: int, seed: int) -> list[int]:
    rng = random.Random(hashlib.sha256(f"{seed}|{key}".encode()).digest())
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(block_tokens)]


def tenant_of(session: str, tenants: int, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|tenant|{session}".encode()).digest()[:4], "big") % tenants


def build_workload(rows: list[dict], requests: int = 200, block_tokens: int = 64, max_blocks: int = 24,
                   seed: int = 0, tenants: int = 4, system_blocks: int = 4, min_turns: int = 2,
                   duration_s: float = 240.0) -> list[Request]:
    turns: dict[str, int] = defaultdict(int)
    for r in rows:
        turns[session_of(r)] += 1
    chosen: set[str] = set()
    total = 0
    for r in rows:  # sessions in order of first appearance, until their turns fill `requests`
        s = session_of(r)
        if s not in chosen and turns[s] >= min_turns and total < requests:
            chosen.add(s)
            total += turns[s]
    picked = [r for r in rows if session_of(r) in chosen][:requests]
    if not picked:
        return []
    t0, t1 = picked[0]["timestamp"], picked[-1]["timestamp"]
    scale = duration_s / max(t1 - t0, 1)
    cache: dict[str, list[int]] = {}

    def block(key: str) -> list[int]:
        if key not in cache:
            cache[key] = block_tokens_for(key, block_tokens, seed)
        return cache[key]

    out = []
    for i, r in enumerate(picked):
        s = session_of(r)
        tenant = tenant_of(s, tenants, seed)
        ids = list(r["hash_ids"])
        n_full = len(ids)
        length = max(1, math.ceil(r["input_length"] * block_tokens / TRACE_BLOCK))
        if n_full > max_blocks:
            ids, length = ids[:max_blocks], max_blocks * block_tokens
        prompt: list[int] = []
        for j, h in enumerate(ids):
            if j == 0 and h == 0:  # the trace's shared first block: this tenant's system prompt
                for k in range(system_blocks):
                    prompt += block(f"tenant{tenant}/sys{k}")
                length += (system_blocks - 1) * block_tokens
            else:
                prompt += block(f"h{h}")
        prompt = prompt[:max(length, 1)]
        out.append(Request(i, (r["timestamp"] - t0) * scale, s, tenant, ids, prompt))
    return out


def workload_stats(reqs: list[Request], block_tokens: int) -> dict:
    """Tokens total, and the tokens an infinite shared cache would still compute (first sight of a block)."""
    seen: set[tuple] = set()
    total = fresh = 0
    for r in reqs:
        total += len(r.prompt)
        nblk = len(r.prompt) // block_tokens
        for j in range(nblk):
            key = tuple(r.prompt[: (j + 1) * block_tokens][-block_tokens:]) + (j,)
            if key not in seen:
                seen.add(key)
                fresh += block_tokens
        fresh += len(r.prompt) - nblk * block_tokens
    return {"requests": len(reqs), "sessions": len({r.session for r in reqs}), "prompt_tokens": total,
            "min_computed_tokens": fresh, "max_prompt": max(len(r.prompt) for r in reqs),
            "mean_prompt": round(total / len(reqs), 1)}


def simulate(reqs: list[Request], engines: int, block_tokens: int, local_tokens: int, affinity: bool,
             store: bool, dead: tuple[int, int, int] | None = None) -> dict:
    """Hit accounting without engines: each engine an LRU of `local_tokens` worth of full blocks, the store
    unbounded; a request's blocks are looked up as vLLM does (longest local prefix, then the store's
    continuation; the last token is never a hit), then all its full blocks are inserted. Sequential (no
    concurrency, no blocks in flight). `dead` = (engine, first request idx, first idx back): that engine
    takes nothing in between and comes back empty. The rendezvous hash is the router's (server/pd_proxy.py)."""
    from collections import OrderedDict

    cap = max(local_tokens // block_tokens, 1)
    caches = [OrderedDict() for _ in range(engines)]
    shared: set = set()
    rr = 0
    tot = {"prompt": 0, "local": 0, "external": 0}
    for r in reqs:
        live = [e for e in range(engines) if not (dead and e == dead[0] and dead[1] <= r.idx < dead[2])]
        if dead and r.idx == dead[2]:
            caches[dead[0]].clear()
        if affinity:
            e = max(live, key=lambda u: hashlib.sha256(f"{r.session}|{u}".encode()).digest())
        else:
            e, rr = live[rr % len(live)], rr + 1
        keys = [tuple(r.prompt[: (j + 1) * block_tokens]) for j in range((len(r.prompt) - 1) // block_tokens)]
        keys = [hashlib.sha256(str(k).encode()).digest() for k in keys]
        n_local = 0
        while n_local < len(keys) and keys[n_local] in caches[e]:
            n_local += 1
        n_ext = n_local
        if store:
            while n_ext < len(keys) and keys[n_ext] in shared:
                n_ext += 1
        tot["prompt"] += len(r.prompt)
        tot["local"] += n_local * block_tokens
        tot["external"] += (n_ext - n_local) * block_tokens
        for k in keys:
            caches[e][k] = True
            caches[e].move_to_end(k)
            if store:
                shared.add(k)
        while len(caches[e]) > cap:
            caches[e].popitem(last=False)
    tot["computed"] = tot["prompt"] - tot["local"] - tot["external"]
    return tot


def affinity_split(reqs: list[Request], urls: list[str]) -> dict:
    """Where the router's rendezvous hash (server/pd_proxy.py Pool.pick) sends each session, all engines up."""
    out = {u: {"sessions": set(), "requests": 0, "prompt_tokens": 0} for u in urls}
    for r in reqs:
        u = max(urls, key=lambda x: hashlib.sha256(f"{r.session}|{x}".encode()).digest())
        out[u]["sessions"].add(r.session)
        out[u]["requests"] += 1
        out[u]["prompt_tokens"] += len(r.prompt)
    return {u: dict(v, sessions=len(v["sessions"])) for u, v in out.items()}


def kv_bytes_per_token(dtype: str) -> int:
    """SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K and V)."""
    return 30 * 3 * 64 * 2 * (4 if dtype == "float32" else 2)
