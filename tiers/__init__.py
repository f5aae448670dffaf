"""Tiers: one module per tier. A tier moves bytes and knows nothing of eviction order."""
