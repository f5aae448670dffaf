"""Eviction policies: pure Python, they see keys and events and name victims.

Policies never touch bytes and never import tiers/. The store owns the prefix
tree, pins and refcounts; it tells a policy which keys are evictable right now
through the `evictable` predicate passed to `victims`.
"""

from kvstore.eviction.base import BlockInfo, EvictionPolicy, make_policy, register_policy

__all__ = ["BlockInfo", "EvictionPolicy", "make_policy", "register_policy"]
