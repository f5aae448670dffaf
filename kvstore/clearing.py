"""Admin removals in steps: a clear (every committed, unpinned block whose subtree is unpinned and
committed leaves the store, leaves first), and a removal of given blocks with their subtrees.

A clear goes over a snapshot of the index's keys and, from each block that is a
leaf (no child in any tier), takes it and then each ancestor that became a
leaf by it, as long as they are committed and unpinned. A pinned or reserved
block stays, and so do its ancestors (they keep a child). Each block is looked
at about twice, so a clear costs O(blocks), not O(blocks x depth).

`clear_steps` yields every `step` blocks: `TieredStore.clear` runs it at once
with the store's listeners muted, then reports one `cleared` and a `stored`
for each survivor; the admin plane's `clear_in_steps` lets the daemon serve
between steps (a clear of 10^6 blocks was ~7 s of its loop), muting only its
own drops, and reports the same at the end, the survivors a step at a time.
Between two steps the blocks not taken yet are reported as they change, and a
block committed meanwhile is not cleared (it was not in the snapshot).

`remove_steps` takes each given block's subtree when no block in it is pinned
or reserved (looked over first, a step at a time), children first, reporting
each block as it goes; `TieredStore.remove` runs it at once, the admin plane's
`remove` RPC (`kvstore evict`) with `run_in_steps`. A prefix shared by every
prompt is the root of nearly the whole cache: its removal was one turn of the
loop. A block pinned, or given a child, after the look stays, and so do its
ancestors.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Generator, Sequence

from kvstore.entry import children_of
from kvstore.keys import block_key

if TYPE_CHECKING:
    from kvstore.store import TieredStore

ALL_AT_ONCE = 1 << 62  # a step no store reaches (`TieredStore.clear` and `remove`)
CLEAR_STEP_BLOCKS = 1024  # blocks a clear looks at between two turns of the daemon's loop (~10-20 ms)


def clear_steps(store: TieredStore, step: int = CLEAR_STEP_BLOCKS) -> Generator[None, None, int]:
    """Clear `store` (module docstring), yielding every `step` blocks looked at; returns how many went.
    Reports nothing itself: the caller mutes the listeners around it and reports the result."""
    get, drop = store.index.get, store.placement.drop  # (a block at rest is woken when its turn comes)
    keys = list(store.index.entries)  # (a copy in C)
    if store.index.resting is not None:
        keys += store.index.resting.keys()
    removed = done = 0
    for key in keys:
        done += 1
        e = get(key)
        while e is not None and e.child_keys is None and not e.pins and e.last_access is not None:  # committed
            parent = e.parent
            drop(e)
            removed += 1
            done += 1
            e = get(parent) if parent is not None else None
        if done >= step:
            done = 0
            yield
    return removed


def remove_steps(store: TieredStore, ns_id: str, hashes: Sequence[bytes],
                 step: int = CLEAR_STEP_BLOCKS) -> Generator[None, None, int]:
    """Remove each of `hashes` with its subtree, unless a block in it is pinned or reserved (module
    docstring), yielding every `step` blocks looked at or taken; returns how many went."""
    store.namespace(ns_id)
    get, drop = store.index.get, store.placement.drop  # (a block at rest is woken: kvstore/resting.py)
    removed = done = 0
    for h in hashes:
        root = get(block_key(ns_id, h))
        if root is None or not root.committed:
            continue
        keys, stack = [], [root.key]  # (preorder: reversed, every block comes after its subtree)
        while stack:
            e = get(stack.pop())
            if e is None:
                continue
            if e.pins or not e.committed:
                break
            keys.append(e.key)
            stack.extend(children_of(e))
            done += 1
            if done >= step:
                done = 0
                yield
        else:
            for key in reversed(keys):
                e = get(key)
                if e is not None and e.child_keys is None and not e.pins and e.committed:
                    drop(e)
                    removed += 1
                done += 1
                if done >= step:
                    done = 0
                    yield
    return removed


def at_once(steps: Generator[None, None, int]) -> int:
    """Run `steps` to the end: its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def run_in_steps(steps: Generator[None, None, int]) -> int:
    """Run `steps` on the running loop, a step per turn: its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


def _muted(steps: Generator[None, None, int], store: TieredStore) -> Generator[None, None, int]:
    """`steps` with the store's `stored`/`removed` listeners muted during each step, not between."""
    while True:
        with store.shared.listeners.muted():
            try:
                next(steps)
            except StopIteration as done:
                return done.value
        yield


async def clear_in_steps(store: TieredStore, step: int = CLEAR_STEP_BLOCKS) -> int:
    """`clear_steps` on the running loop: a step per turn, its drops muted; then one `cleared` of every
    namespace and a `stored` for each block that survived, a step of them per turn."""
    removed = await run_in_steps(_muted(clear_steps(store, step), store))
    listeners = store.shared.listeners
    listeners.cleared(list(store.shared.namespaces))
    for _ in store.report_steps(step):
        await asyncio.sleep(0)
    return removed
