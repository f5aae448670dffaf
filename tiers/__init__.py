"""Tiers: one module per tier. A tier moves bytes and knows nothing of eviction order.

`TIER_ORDER` names every tier, fastest first; it also ranks them (a store's
chain is any subsequence of it).
"""

TIER_ORDER = ("gpu", "host", "disk", "remote")  # fastest first
