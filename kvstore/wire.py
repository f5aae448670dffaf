"""The types both ends of the data plane share: what the daemon answers and the client returns.

The client (`kvstore/client.py`, imported by every engine worker) takes its
reply types from here, never from the store's modules, so a worker loads no
placement, promotion, eviction or tier code beyond the arena it maps.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tiers import TIER_ORDER

TIERS = TIER_ORDER  # ("gpu", "host", "disk", "remote"), fastest first: where a block can sit
RANK = {name: i for i, name in enumerate(TIERS)}

Extents = list  # [[offset, length], ...]: a block's runs of pages in the host arena


@dataclass(frozen=True, slots=True)
class LookupResult:
    """`hits` leading blocks are present; `tiers` names the tier of each."""

    hits: int
    tiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WaitResult:
    """How a wait for in-flight blocks ended (kvstore/waits.py)."""

    ready: int  # leading blocks committed when the wait ended
    waited: tuple[int, ...]  # indices (< ready) of the blocks that were not yet committed when asked
    reason: str  # "done", "absent", "aborted", "timeout" or "shutdown"
