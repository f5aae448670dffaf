"""tiers/pages.py: the free pages as a watermark under a stack hand out the pages a stack of every free
page would, in the same order, whatever was taken at the start and whatever was freed since."""

from __future__ import annotations

import tracemalloc
from array import array

import numpy as np
from hypothesis import given, settings, strategies as st

from kvstore.tiers.pages import PageAllocator

PAGE = 4096


class EveryPageStack:
    """The reference: a stack of every free page, built whole (the allocator before the watermark)."""

    def __init__(self, num_pages: int, used: list[int]) -> None:
        taken = np.zeros(num_pages, dtype=bool)
        taken[np.array(used, dtype=np.int64)] = True
        self.free = array("q", np.flatnonzero(~taken)[::-1].astype(np.int64).tobytes())

    def allocate(self, nbytes: int) -> list | None:
        n = -(-nbytes // PAGE)
        if n > len(self.free):
            return None
        pages = sorted(self.free[-n:])
        del self.free[-n:]
        extents: list = []
        for p in pages:  # runs of consecutive pages, the last one cut to the block's bytes
            if extents and extents[-1][0] + extents[-1][1] == p * PAGE:
                extents[-1][1] += PAGE
            else:
                extents.append([p * PAGE, PAGE])
        extents[-1][1] -= n * PAGE - nbytes
        return extents

    def free_extents(self, extents: list) -> None:
        pages = [q for off, length in extents for q in range(off // PAGE, off // PAGE + -(-length // PAGE))]
        self.free.extend(sorted(pages, reverse=True))


ops = st.lists(st.tuples(st.sampled_from(["alloc", "many", "free"]), st.integers(1, 4 * PAGE),
                         st.integers(0, 10_000)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(1, 64), used=st.sets(st.integers(0, 63), max_size=40), ops=ops)
def test_the_same_pages_as_a_stack_of_every_free_page(num_pages, used, ops):
    used = sorted(u for u in used if u < num_pages)
    alloc, ref = PageAllocator(num_pages, PAGE, np.array(used, dtype=np.int64)), EveryPageStack(num_pages, used)
    held: list = [[[u * PAGE, PAGE]] for u in used]  # (a restart's blocks, freed like any other)
    for op, nbytes, pick in ops:
        if op == "alloc":
            got = alloc.allocate(nbytes)
            assert got == ref.allocate(nbytes)
            if got is not None:
                held.append(got)
        elif op == "many":
            got = alloc.allocate_many(PAGE, pick % 5)
            want = [ref.allocate(PAGE) for _ in range(min(pick % 5, len(ref.free)))]
            assert got == want
            held += got
        elif held:
            extents = held.pop(pick % len(held))
            alloc.free(extents)
            ref.free_extents(extents)
        assert alloc.free_pages == len(ref.free)
        assert alloc.check(held) == []


def test_an_empty_tier_of_many_pages_costs_no_memory_a_page():
    tracemalloc.start()
    try:
        empty = PageAllocator(1 << 28, PAGE)  # 1 TiB of 4 KiB pages: a stack of them was 2 GiB
        not_read = PageAllocator.full(1 << 28, PAGE)  # (its records not read yet: no free page)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert empty.free_pages == 1 << 28 and not_read.free_pages == 0 and not_read.allocate(PAGE) is None
    assert empty.allocate(3 * PAGE) == [[0, 3 * PAGE]] and empty.allocate_many(PAGE, 2) == [[[3 * PAGE, PAGE]], [[4 * PAGE, PAGE]]]
