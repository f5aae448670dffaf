"""Leaf-first S3-FIFO (Yang et al., SOSP'23), a baseline.

Three FIFO queues: a small probationary queue S (about 10% of the bytes), the
main queue M, and a ghost queue G of keys recently evicted from S. A new block
enters S, or M when its key is in G. A hit only bumps a 2-bit counter
(`freq`, capped at 3); nothing moves on a hit. To make room: while S holds at
least `SMALL_FRACTION` of the tracked bytes, the oldest leaf of S goes to M
when it was hit since admission, else it is the victim (and becomes a ghost
when removed); otherwise the oldest leaf of M is reinserted with `freq - 1`
when `freq > 0`, else it is the victim.

Adaptations: the queues hold the policy's *leaves* in FIFO order (a leaf is
ordered by the time it entered its queue), since only leaves may go; the
capacity is the tracked byte total at eviction time; G is trimmed to the
number of resident blocks. `victims` does S3-FIFO's lazy promotion and
reinsertion itself (it reorders its queues), but the set of tracked keys
changes only through `on_insert`/`on_remove`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key, register_policy
from kvstore.eviction.leaves import LeafQueues

SMALL_FRACTION = 0.10
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, clock=None, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self._leaves = LeafQueues()
        self._freq: dict[Key, int] = {}
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._tick = itertools.count()

    def on_insert(self, info: BlockInfo) -> None:
        queue = "s"
        if info.key in self._ghost:
            del self._ghost[info.key]
            queue = "m"
        self._freq[info.key] = 0
        self._leaves.add(info.key, info.parent, info.nbytes, queue, next(self._tick))

    def on_access(self, keys: Sequence[Key]) -> None:
        freq = self._freq
        for key in keys:
            if key in freq:
                freq[key] = min(freq[key] + 1, MAX_FREQ)

    def on_remove(self, key: Key) -> None:
        queue = self._leaves.queue_of(key)
        if queue is None:
            return
        self._leaves.remove(key)
        del self._freq[key]
        if queue == "s":
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._leaves), 1):
                self._ghost.popitem(last=False)

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        queues = {"s": "small", "m": "main"}
        return [f"{queues[self._leaves.queue_of(k)]} freq {self._freq[k]}" if k in self._freq else None for k in keys]

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        leaves, freq = self._leaves, self._freq
        chosen: list[Key] = []
        chosen_set: set = set()
        pending: dict = {}
        freed = small_chosen = 0
        budget = 4 * len(leaves) + 16  # every step moves or picks; freq bounds the moves
        while freed < n_bytes and budget > 0:
            budget -= 1
            total = leaves.bytes["s"] + leaves.bytes["m"] - freed
            use_small = leaves.bytes["s"] - small_chosen >= SMALL_FRACTION * total
            queue = "s" if use_small else "m"
            picked = leaves.pick(queue, 1, evictable, chosen_set, limit=1)
            if not picked:
                queue = "m" if use_small else "s"
                picked = leaves.pick(queue, 1, evictable, chosen_set, limit=1)
                if not picked:
                    break
            key = picked[0]
            if freq[key] > 0:
                freq[key] = freq[key] - 1 if queue == "m" else 0
                leaves.update(key, "m", next(self._tick))
                continue
            chosen.append(key)
            chosen_set.add(key)
            freed += leaves.nbytes_of(key)
            if queue == "s":
                small_chosen += leaves.nbytes_of(key)
            if leaves.exposes_parent(key, pending):
                break  # its parent is a leaf next; let the store ask again
        return chosen or None

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)


register_policy("s3fifo", S3FIFOPolicy)
