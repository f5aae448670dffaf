"""`kvstore gen-trace SHAPE`: seeded synthetic traces in the Mooncake FAST'25 format.

Each shape is a workload the eviction policies must handle without being tuned
for it. Every request is one JSON line, `timestamp` (ms), `input_length`,
`output_length`, `hash_ids` (prefix-chained ids of 512-token blocks), exactly
as in `tools/traces/`: `len(hash_ids) == ceil(input_length / 512)` and every id
always has the same parent. Only the request's last block may be partial, and a
partial block gets a fresh id in every request that ends in it (its tokens
differ once the context grows), so the ids stay a prefix tree.

Shapes (`SHAPES`; the default seed of each is `DEFAULT_SEEDS`):

- `tenants`: many tenants behind a few shared system prompts; a request is
  system prompt + the tenant's own instructions + a short private tail (the
  user's message), sometimes a repeat of a recent one. Hot shared prefixes,
  a long tail of one-off blocks: frequency pays.
- `agentic`: agent loops whose context grows every step (tool calls and their
  results appended), many sessions interleaved, each on one of a few shared
  tool-definition prefixes. Each step reuses the whole previous context soon
  after it was written: recency pays.
- `scan`: a hot set of documents queried with short unique questions, mixed
  with one-off long documents read once (a scan). Scan resistance pays.
- `shift`: a hot set of prompts whose popularity moves to a different set
  halfway. Frequency learned in the first half must be forgotten.
- `mixed`: the four above interleaved in one trace (each stream at a
  quarter of its rate and its own ids), like a shared deployment.

The generator uses `random.Random(seed)` only, so a (shape, seed) pair gives
the same bytes on every machine. `kvstore replay gen:SHAPE[:SEED]` replays a
shape without writing a file.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import random
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from kvstore.eviction.traces import TRACE_BLOCK_TOKENS, Request

BLOCK = TRACE_BLOCK_TOKENS
DEFAULT_SEEDS = {"tenants": 16, "agentic": 17, "scan": 18, "shift": 19, "mixed": 20}


@dataclass(frozen=True, slots=True)
class TraceLine:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp_ms, "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})

    def to_request(self) -> Request:
        return Request(self.timestamp_ms / 1000.0, self.input_length, self.hash_ids)


class Ids:
    """Fresh block ids; `stride` and `offset` keep interleaved streams disjoint."""

    def __init__(self, offset: int = 0, stride: int = 1) -> None:
        self._next = itertools.count(offset, stride)

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


class Zipf:
    """Draws 0..n-1 with P(i) proportional to 1 / (i + 1)^s."""

    def __init__(self, n: int, s: float) -> None:
        self._cum = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))

    def draw(self, rng: random.Random) -> int:
        return bisect.bisect_left(self._cum, rng.random() * self._cum[-1])


def _line(t_s: float, full: list[int], tail_tokens: int, ids: Ids, rng: random.Random) -> TraceLine:
    """A request of the full blocks `full` plus `tail_tokens` more tokens in fresh blocks."""
    n_tail = -(-tail_tokens // BLOCK)
    hash_ids = tuple(full) + tuple(ids.take(n_tail))
    return TraceLine(int(t_s * 1000), len(full) * BLOCK + tail_tokens, rng.randint(16, 600), hash_ids)


def _arrivals(rng: random.Random, rate_per_s: float) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate_per_s)


# -- shapes: each yields (time_s, TraceLine) in time order ------------------------------------------
def tenants(rng: random.Random, ids: Ids, num_requests: int = 12000, rate: float = 3.5) -> Iterator[TraceLine]:
    systems = [ids.take(rng.randint(6, 20)) for _ in range(4)]
    num_tenants = 2000
    tenant_prefix = [systems[Zipf(4, 1.0).draw(rng)] + ids.take(rng.randint(2, 12)) for _ in range(num_tenants)]
    pick = Zipf(num_tenants, 0.8)
    recent: dict[int, list[tuple[list[int], int]]] = {}
    for _, t in zip(range(num_requests), _arrivals(rng, rate)):
        tenant = pick.draw(rng)
        prefix = tenant_prefix[tenant]
        past = recent.setdefault(tenant, [])
        if past and rng.random() < 0.25:  # the same message again (a retry, a shared link)
            tail_ids, tail_tokens = rng.choice(past)
            yield TraceLine(int(t * 1000), len(prefix) * BLOCK + tail_tokens, rng.randint(16, 600),
                            tuple(prefix + tail_ids))
            continue
        line = _line(t, prefix, rng.randint(64, 4 * BLOCK), ids, rng)
        past.append((list(line.hash_ids[len(prefix):]), line.input_length - len(prefix) * BLOCK))
        del past[:-4]
        yield line


def agentic(rng: random.Random, ids: Ids, num_requests: int = 9000, rate: float = 2.5) -> Iterator[TraceLine]:
    tools = [ids.take(rng.randint(4, 12)) for _ in range(6)]
    pick_tools = Zipf(len(tools), 1.0)
    concurrent = 96
    # (next time, session id, full ids, partial tokens, steps left)
    queue: list = []
    sid = itertools.count()

    def new_session(t: float) -> None:
        full = list(tools[pick_tools.draw(rng)]) + ids.take(rng.randint(1, 6))
        heapq.heappush(queue, (t + rng.expovariate(1 / 5.0), next(sid), full, rng.randint(64, BLOCK - 1),
                               rng.randint(4, 60)))

    for _ in range(concurrent):
        new_session(rng.uniform(0, 60))
    for _ in range(num_requests):
        t, s, full, partial, left = heapq.heappop(queue)
        yield _line(t, full, partial, ids, rng)
        # the step appends the model's call and the tool's result: the partial block fills up
        grown = partial + rng.randint(100, 3 * BLOCK)
        new_full = grown // BLOCK
        full = full + ids.take(new_full)  # blocks that became full get ids of their final content
        partial = grown % BLOCK or 1
        if left > 1:
            think = rng.expovariate(1 / (concurrent / rate))
            heapq.heappush(queue, (t + think, s, full, partial, left - 1))
        else:
            new_session(t)


def scan(rng: random.Random, ids: Ids, num_requests: int = 9000, rate: float = 2.5) -> Iterator[TraceLine]:
    docs = [ids.take(rng.randint(4, 24)) for _ in range(700)]
    pick = Zipf(len(docs), 0.8)
    for _, t in zip(range(num_requests), _arrivals(rng, rate)):
        if rng.random() < 0.2:  # a one-off long document: read once, never again
            yield _line(t, [], rng.randint(20 * BLOCK, 100 * BLOCK), ids, rng)
        else:
            yield _line(t, docs[pick.draw(rng)], rng.randint(32, 2 * BLOCK), ids, rng)


def shift(rng: random.Random, ids: Ids, num_requests: int = 10000, rate: float = 3.0) -> Iterator[TraceLine]:
    def hot_set() -> list[list[int]]:
        return [ids.take(rng.randint(6, 30)) for _ in range(800)]

    first, second = hot_set(), hot_set()
    pick = Zipf(800, 0.9)
    for i, t in zip(range(num_requests), _arrivals(rng, rate)):
        prompts = first if i < num_requests // 2 else second
        yield _line(t, prompts[pick.draw(rng)], rng.randint(32, 2 * BLOCK), ids, rng)


def mixed(rng: random.Random, ids: Ids, num_requests: int = 12000, rate: float = 3.5) -> Iterator[TraceLine]:
    parts = [tenants, agentic, scan, shift]
    streams = [part(random.Random(rng.random()), Ids(k, len(parts)), num_requests // len(parts), rate / len(parts))
               for k, part in enumerate(parts)]
    yield from heapq.merge(*streams, key=lambda line: line.timestamp_ms)


SHAPES: dict[str, Callable[..., Iterator[TraceLine]]] = {
    "tenants": tenants, "agentic": agentic, "scan": scan, "shift": shift, "mixed": mixed}


def generate(shape: str, seed: int | None = None) -> list[TraceLine]:
    """The trace of `shape` for `seed` (DEFAULT_SEEDS[shape] when None), in time order."""
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; known: {', '.join(SHAPES)}")
    seed = DEFAULT_SEEDS[shape] if seed is None else seed
    return sorted(SHAPES[shape](random.Random(seed), Ids()), key=lambda line: line.timestamp_ms)


def requests_for(spec: str) -> list[Request]:
    """`gen:SHAPE` or `gen:SHAPE:SEED` as replay requests (what `kvstore replay` accepts)."""
    parts = spec.split(":")
    if parts[0] != "gen" or len(parts) not in (2, 3):
        raise ValueError(f"a generated trace is gen:SHAPE[:SEED], got {spec!r}")
    seed = int(parts[2]) if len(parts) == 3 else None
    return [line.to_request() for line in generate(parts[1], seed)]


# -- CLI ------------------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gen-trace", help="write a seeded synthetic Mooncake-format trace")
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, help="random seed (default: the shape's own, see DEFAULT_SEEDS)")
    p.add_argument("-o", "--output", help="output file (default stdout)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    lines = generate(args.shape, args.seed)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for line in lines:
            out.write(line.to_json() + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
