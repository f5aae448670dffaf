"""Leaf-first ARC (Megiddo & Modha, FAST'03), a baseline.

Resident blocks sit in T1 (seen once since admission) or T2 (hit again); the
ghost lists B1/B2 remember keys recently evicted from each. Admitting a key
found in B1 grows the target size `p` of T1, one found in B2 shrinks it; either
goes to T2. A hit moves a block to the MRU end of T2. To make room, the LRU
*leaf* of T1 goes when |T1| > p, else the LRU leaf of T2 (falling back to the
other list when one has no evictable leaf). Like every LeafQueues policy it
names victims in eviction order and stops after one that exposes its parent
as a new leaf (see `LeafQueues.pick`); the store asks again.

Adaptations to the store's interface, documented because they differ from the
paper: the capacity `c` is not known to a policy, so it is taken as the
largest number of resident blocks seen when eviction was needed; the incoming
key is not known to `victims`, so REPLACE's "x in B2 and |T1| == p" case is
dropped; a block becomes a ghost when the store removes it (`on_remove`), not
when it is named. Ghost lists are trimmed to |T1|+|B1| <= c and total <= 2c.
Recency is a per-event tick; within a hit chain the tail is touched first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key, register_policy
from kvstore.eviction.leaves import LeafQueues


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, clock=None, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self._leaves = LeafQueues()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0
        self._c = 0
        self._tick = itertools.count()

    def on_insert(self, info: BlockInfo) -> None:
        key = info.key
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(b2 / b1, 1.0))
            del self._b1[key]
            queue = "t2"
        elif key in self._b2:
            self._p = max(0.0, self._p - max(b1 / b2, 1.0))
            del self._b2[key]
            queue = "t2"
        else:
            queue = "t1"
        self._leaves.add(key, info.parent, info.nbytes, queue, next(self._tick))

    def on_access(self, keys: Sequence[Key]) -> None:
        leaves = self._leaves
        for key in reversed(keys):
            if key in leaves:
                leaves.update(key, "t2", next(self._tick))

    def on_remove(self, key: Key) -> None:
        queue = self._leaves.queue_of(key)
        if queue is None:
            return
        self._leaves.remove(key)
        (self._b1 if queue == "t1" else self._b2)[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = max(self._c, len(self._leaves))
        t1 = self._leaves.count["t1"]
        while self._b1 and t1 + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._leaves) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        self._c = max(self._c, len(self._leaves))
        first, second = ("t1", "t2") if self._leaves.count["t1"] > self._p else ("t2", "t1")
        pending: dict = {}
        chosen = self._leaves.pick(first, n_bytes, evictable, pending=pending)
        freed = sum(self._leaves.nbytes_of(k) for k in chosen)
        if not chosen:  # nothing evictable in the preferred list
            chosen = self._leaves.pick(second, n_bytes - freed, evictable, pending=pending)
        return chosen or None

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        names = {"t1": "T1 (seen once)", "t2": "T2 (seen again)"}
        return [names.get(self._leaves.queue_of(k), None) for k in keys]

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)


register_policy("arc", ARCPolicy)
