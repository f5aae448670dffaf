"""The eviction-policy interface and the policy registry.

One policy instance serves one tier. The store calls:

- `on_insert(info)` when a committed block enters the tier (a put, a
  demotion into it, or a promotion into it); `on_insert_many(infos)` for the
  blocks of one commit (by default, `on_insert` for each);
- `on_access(keys)` when a chain of blocks is hit (acquired), keys root first;
- `on_remove(key)` when a block leaves the tier (evicted, demoted, promoted, dropped);
- `on_feedback(key, attention)` for an attention estimate that arrives after the block was
  inserted (a commit passes its estimate in `BlockInfo.attention`; no RPC sends a later one yet);
- `victims(n_bytes, evictable)` when the tier needs `n_bytes` of room;
- `evict(missing, evictable, take)`, the store's eviction loop: victims are
  named and taken one after the other until `missing()` is <= 0 (below);
- `describe(keys)` for inspection tools (read-only).

`victims` answers with keys for which `evictable(key)` is true *now* (the
store's predicate: committed, unpinned, and a leaf of the prefix tree within
this tier), whose sizes add up to at least `n_bytes` if it can, or `None` when
it can name nothing. It changes nothing itself: the store removes the victims
and calls `on_remove` for each, then asks again if it still needs room (a parent
becomes a leaf only once its last child has gone). A policy may answer with
fewer bytes than asked: it should stop after a victim whose removal exposes its
parent as a new leaf, if that parent could be the next victim in its order;
otherwise one large request trims the tails of many chains instead of finishing
the least valuable one.

`evict` is that loop in one call: it names a victim, has the store `take` it
(the store demotes it and calls `on_remove`) and names the next one against
the state that removal left, until `missing()` (the bytes the tier still
needs) is <= 0, or answers False when it can name nothing more. Each victim is
the one `victims` would have named at that moment, so a policy gets the same
decisions either way; the default asks `victims` for rounds of them, and a
policy whose candidates live in `LeafQueues` takes them straight off its heap
(no round ends at an exposed parent: the parent is a candidate as soon as its
last child is taken).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Hashable, Iterable, NamedTuple, Sequence

Key = Hashable
Clock = Callable[[], float]


class PolicyError(RuntimeError):
    """A policy broke its contract (named a victim that is not evictable): a bug in the policy."""


class BlockInfo(NamedTuple):
    """What a policy may know of a block. `depth` is its index in its chain (0 = first block).

    A named tuple, not a frozen dataclass: the store makes one per committed block on the
    commit path, and a tuple is made ~5x faster (0.3 against 1.4 us)."""

    key: Key
    parent: Key | None
    depth: int
    nbytes: int
    block_tokens: int = 16
    attention: float | None = None


class EvictionPolicy(ABC):
    """Base class; subclasses override the event hooks they need and `victims`."""

    name: ClassVar[str] = "base"
    # The store's prefix tree, for read-only walks (`describe`): a key's children's keys, whatever tier
    # they sit in. The store sets it (kvstore/placement.py); None for a policy used on its own (policy_sim,
    # replay's swapped policies), which then walks its own state.
    tree_children: Callable[[Key], Iterable[Key]] | None = None

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock

    @abstractmethod
    def on_insert(self, info: BlockInfo) -> None: ...

    def on_insert_many(self, infos: Sequence[BlockInfo]) -> None:
        """`on_insert` for blocks that entered the tier together (one commit), in order; a policy may
        read its clock once for all of them."""
        for info in infos:
            self.on_insert(info)

    @abstractmethod
    def on_access(self, keys: Sequence[Key]) -> None: ...

    @abstractmethod
    def on_remove(self, key: Key) -> None: ...

    def on_feedback(self, key: Key, attention: float) -> None:
        """An attention estimate for a block; policies without an attention term ignore it."""

    def history(self) -> tuple[int, int] | None:
        """(ghosts, bytes of their arrays): what the policy remembers of blocks that left its tier
        (eviction/ghosts.py), for stats and metrics; None where it keeps no such table."""
        return None

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        """What the policy holds of each key, in a few words for `kvstore inspect` (None: untracked).
        Read-only; it runs on the daemon's loop, so it should cost what the keys (and, with
        `tree_children`, their subtrees) cost, not what the tier holds."""
        return [None] * len(keys)

    @abstractmethod
    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None: ...

    def evict(self, missing: Callable[[], int], evictable: Callable[[Key], bool],
              take: Callable[[Key], None]) -> bool:
        """Name victims and have the store `take` each (it removes it, calling `on_remove`) until
        `missing()` <= 0; False when no victim can be named. Raises PolicyError for a named victim
        that is not evictable."""
        while (need := missing()) > 0:
            victims = self.victims(need, evictable)
            if not victims:
                return False
            for key in victims:
                if not evictable(key):
                    raise PolicyError(f"policy {self.name} named a victim that is not evictable")
                take(key)
                if missing() <= 0:
                    break
        return True

    # -- blocks at rest (kvstore/resting.py): a policy that can keep a block's record apart overrides all three
    def rest(self, key: Key, parent: Key | None) -> tuple[object, object] | None:
        """Give up `key`'s record if it holds nothing of the block's own (an inner block of a chain, not
        read since it arrived): the two objects it shares with other blocks that `restore` makes it again
        from. None (nothing changes) where it cannot: the default."""
        return None

    def restore(self, key: Key, parent: Key | None, refs: tuple[object, object]) -> None:
        """`key`'s record again, as `rest` found it (it counted in `len` and `in` meanwhile)."""
        raise NotImplementedError

    def compact(self) -> None:
        """Make a table that holds a small share of what it held again at its size (after blocks went to
        rest): nothing by default."""

    def wake_hook(self, wake: Callable[[Key], object], holds: Callable[[Key], bool]) -> None:
        """`wake(key)` restores a resting `key` (a truthy result), which the policy calls before it changes
        one (a parent whose last child leaves); `holds(key)`: whether `key` rests."""
        raise NotImplementedError

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}


def register_policy(name: str, factory: Callable[..., EvictionPolicy]) -> None:
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, clock: Clock = time.monotonic) -> EvictionPolicy:
    """A new policy instance by registered name; ValueError lists the known names."""
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(clock=clock)


def _load_builtin() -> None:
    # Importing the modules registers their policies; a module that is absent
    # (not yet written) simply contributes nothing.
    import importlib

    for module in ("kvstore.eviction.lru", "kvstore.eviction.lfu", "kvstore.eviction.arc", "kvstore.eviction.s3fifo", "kvstore.eviction.attention"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
