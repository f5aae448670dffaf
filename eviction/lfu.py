"""Leaf-first LFU.

LFU orders blocks by `(reference count, last touch)`, SGLang's order: an
insert counts one, every block of a hit chain counts one more, and a block
evicted and inserted again resumes its count from a bounded ghost table. A hit
on a child is a hit on its parent, so counts never decrease going up a chain.

Its candidates are `LeafQueues` and its history a `GhostTable` (eviction/leaves.py).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key, register_policy
from kvstore.eviction.leaves import GhostTable, LeafQueues


class LFUPolicy(EvictionPolicy):
    """Evicts the leaf with the fewest references, the least recently touched among equals.

    A block's count survives its eviction in a ghost table of at most
    `ghost_factor` x (resident blocks) entries (default 4), oldest dropped first
    (the same bound as eviction/attention.py's history): a block that comes back resumes
    its count + 1, as in LFU with history (SGLang's and the project notes'
    variant), instead of starting over at 1.
    """

    name = "lfu"

    def __init__(self, clock=None, ghost_factor: float = 4.0, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        if not ghost_factor >= 0:
            raise ValueError("ghost_factor must be >= 0 (math.inf: remember every count, for evaluation)")
        self.ghost_factor = ghost_factor
        self._leaves = LeafQueues()
        self._hits: dict[Key, int] = {}
        self._ghost = GhostTable(ghost_factor)
        self._tick = itertools.count()

    def on_insert(self, info: BlockInfo) -> None:
        count = int(self._ghost.pop(info.key, 0)) + 1  # type: ignore[call-overload]
        self._hits[info.key] = count
        self._leaves.add(info.key, info.parent, info.nbytes, "lfu", (count, next(self._tick)))

    def on_access(self, keys: Sequence[Key]) -> None:
        leaves, hits = self._leaves, self._hits
        for key in reversed(keys):  # tail first: a parent is never staler than its child
            if key in hits:
                hits[key] += 1
                leaves.update(key, "lfu", (hits[key], next(self._tick)))

    def on_remove(self, key: Key) -> None:
        count = self._hits.pop(key, None)
        self._leaves.remove(key)
        if count is not None:
            self._ghost.remember(key, count, len(self._leaves))

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        return self._leaves.pick("lfu", n_bytes, evictable) or None

    def history(self) -> tuple[int, int]:
        return len(self._ghost), self._ghost.ghosts.nbytes

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        return [f"refs {self._hits[k]}" if k in self._hits else None for k in keys]

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)


register_policy("lfu", LFUPolicy)
