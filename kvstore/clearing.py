"""An admin clear: every committed, unpinned block whose subtree is unpinned and committed leaves the
store, leaves first.

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
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Generator

if TYPE_CHECKING:
    from kvstore.store import TieredStore

CLEAR_STEP_BLOCKS = 1024  # blocks a clear looks at between two turns of the daemon's loop (~10-20 ms)


def clear_steps(store: TieredStore, step: int = CLEAR_STEP_BLOCKS) -> Generator[None, None, int]:
    """Clear `store` (module docstring), yielding every `step` blocks looked at; returns how many went.
    Reports nothing itself: the caller mutes the listeners around it and reports the result."""
    entries, drop = store.index.entries, store.placement.drop
    removed = done = 0
    for key in list(entries):  # (a copy in C)
        done += 1
        e = entries.get(key)
        while e is not None and e.child_keys is None and not e.pins and e.last_access is not None:  # committed
            parent = e.parent
            drop(e)
            removed += 1
            done += 1
            e = entries.get(parent) if parent is not None else None
        if done >= step:
            done = 0
            yield
    return removed


def clear_at_once(store: TieredStore) -> int:
    """`clear_steps` with no step: how many blocks went (the caller mutes and reports)."""
    steps = clear_steps(store, step=1 << 62)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def clear_in_steps(store: TieredStore, step: int = CLEAR_STEP_BLOCKS) -> int:
    """`clear_steps` on the running loop: a step per turn, its drops muted; then one `cleared` of every
    namespace and a `stored` for each block that survived, a step of them per turn."""
    steps, listeners = clear_steps(store, step), store.shared.listeners
    while True:
        with listeners.muted():
            try:
                next(steps)
            except StopIteration as done:
                removed = done.value
                break
        await asyncio.sleep(0)
    listeners.cleared(list(store.shared.namespaces))
    report = store.report_all(step)
    assert report is not None
    for _ in report:
        await asyncio.sleep(0)
    return removed
