"""The event loop's background work, in slices: a restart's recovery and the blocks put to rest.

Both change the block index and the policies, which only the daemon's event loop touches, so both run on
it between requests. A request that arrives while they work waits for the slice under way: each turn of
the loop gives them one slice of at most SLICE_S (a step of the recovery, then a sweep of what it and the
requests sent to rest, again while time is left), then lets the requests in.

Two tasks, one for each, took a turn each: a request waited for both (a recovery's step of 250 records and
a sweep of 512 blocks, ~8 ms at 10^6 blocks), and a client looking up every 10 ms fell seconds behind
(docs/benchmarks.md, "A restart's work in slices"). In one slice, the blocks a step adopted are put to rest in the
same turn, before the next step adopts more: the objects they were are what the next step's take.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvstore.recovery import Recovery
    from kvstore.resting import Resting
    from kvstore.tiers.base import Tier

log = logging.getLogger(__name__)

SLICE_S = 0.001  # the most of one turn of the loop the background work takes (a step or sweep may run past it)
RECOVERY_STEP_BLOCKS = 32  # records a recovery's step adopts (~0.5 ms)
REST_STEP_BLOCKS = 128  # blocks a sweep looks at in one go (~0.5 ms)
RECOVERY_SCAN_POLL_S = 0.01  # how often a recovery waiting for a tier's scan looks again
REST_POLL_S = 0.05  # how often the sweep looks for blocks that entered the tier, when nothing else is to do


class Background:
    """The recovery of `recovery` (while it is active) and the sweep of `resting` (None: none), on the loop
    (`run`); `chain`: the store's tiers (told that the loop is busy while a recovery works)."""

    def __init__(self, recovery: "Recovery", resting: "Resting | None", chain: Sequence["Tier"]) -> None:
        self.recovery, self.resting, self.chain = recovery, resting, chain

    async def run(self) -> None:
        polled = time.monotonic()
        while self.recovery.active or self.resting is not None:
            if self.resting is not None and time.monotonic() - polled >= REST_POLL_S:
                self.resting.requeue()  # (blocks whose write was pending at their turn)
                polled = time.monotonic()
            try:
                more = self.slice(time.perf_counter() + SLICE_S)
            except Exception:  # (a fault of the store's own: said at once, not when the task is collected)
                log.exception("the background work (recovery, blocks to rest) stopped")
                raise
            if more:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(RECOVERY_SCAN_POLL_S if self.recovery.active else REST_POLL_S)

    def slice(self, end: float) -> bool:
        """Work until `end` (perf_counter) or until nothing is left to do now; whether work is left."""
        recovery, resting = self.recovery, self.resting
        if recovery.active:
            for tier in self.chain:  # the loop is busy: the kept blocks' checksums wait (for CHECK_LAG_S at most)
                tier.busy()
        while True:
            if recovery.active:
                recovery.step(RECOVERY_STEP_BLOCKS)  # (while a tier scans: whether its records are read)
            if resting is not None:
                while resting.arrived:  # (what the step adopted, before the next step adopts more)
                    resting.sweep(REST_STEP_BLOCKS)
                    if time.perf_counter() >= end:
                        return True
            if not recovery.active or recovery.scanning:
                return False
            if time.perf_counter() >= end:
                return True
