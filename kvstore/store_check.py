"""The store's consistency check, and what stats and inspection show of its parts.

`check` verifies, for every tier of the chain and every pair of tiers: the
index against itself (keys, depths, parents present), the tree rule (no child
in a faster tier than its parent), the per-tier child counts and the children
index, each policy against the committed blocks of its tier, refcounts against
the owners' pins, every tier's pages against the locations the index holds
(plus the pages promotions in flight hold), and each persistent tier's index
against its blocks. It is for tests and post-mortems: it walks everything.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Sequence

from kvstore.compaction import Compactor
from kvstore.entry import RANK, TIERS, Key, child_counts, children_of
from kvstore.index import BlockIndex
from kvstore.keys import TAG_BYTES, key_ns, key_text, ns_tag
from kvstore.placement import Placement
from kvstore.promotion import Promoter

if TYPE_CHECKING:
    from kvstore.store import TieredStore


def store_stats(store: TieredStore) -> dict:
    """`TieredStore.stats`: from the index's tally and the parts' own counts (no pass over the blocks)."""
    index = store.index
    committed = sum(blocks for blocks, _ in index.held.values())
    return {
        "policy": store.policy_name,
        "chain": [t.name for t in store.chain],
        "namespaces": len(store.shared.namespaces),
        "blocks": committed,
        "reserved_blocks": len(index.entries) + len(index.resting or ()) - committed,
        "pinned_blocks": index.num_pinned(),
        "tiers": tier_rows(store.placement, store.absent),
        "counters": dict(store.shared.counters),
        **({"remote": store.sharing.stats()} if store.sharing is not None else {}),
        **({"compaction": store.compactor.stats()} if store.compactor is not None else {}),
        **({"gpu_decode": {"on": store.expander is not None, "reason": store.gpu_decode_off}}
           if "gpu" in store.tiers and store.compression is not None and store.compression.tiers else {}),
        "by_namespace": namespace_rows(store.placement),
        "announced_blocks": store.waits.num_expected(),  # in flight by a producer's word
        "waited_blocks": store.waits.num_waited_keys(),  # keys some consumer waits on now
        **({"recovery": store.recovery.stats()} if store.recovery.active else {}),
        **({"resting": store.resting.stats()} if store.resting is not None and store.resting.on else {}),
    }


def tier_rows(placement: Placement, absent: dict[str, str]) -> dict[str, dict]:
    """Per tier (absent ones too): its blocks, bytes, hits, moves, and the tier's own stats."""
    per_tier: dict[str, dict] = {}
    counters, index = placement.counters, placement.index
    held: dict[str, list[int]] = {name: [0, 0] for name in TIERS}
    for (_, tier), (blocks, nbytes) in index.held.items():
        held[tier][0] += blocks
        held[tier][1] += nbytes
    for name in TIERS:
        st = placement.tier_stats[name]
        row = {
            "blocks": held[name][0],
            "bytes": held[name][1],
            "hits": st.hits,
            "evictions": st.evictions,
            "demotions_in": st.demotions_in,
            "promotions_in": st.promotions_in,
        }
        tier = placement.tiers.get(name)
        if tier is None:
            row["absent"] = absent.get(name, "not configured")
        else:
            row.update(tier.stats())
            row["promotions_out"] = st.promotions_out
            if name in index.device_bytes:  # per device: the bytes of committed blocks in its pool
                row["device_bytes"] = {**{d: 0 for d in row.get("devices", {})}, **index.device_bytes[name]}
            policy = placement.policies.get(name)
            half_life = getattr(policy, "half_life_s", None)
            if half_life is not None:  # the attention policy's current choice (eviction/halflife.py)
                row["policy_half_life_s"] = half_life
            history = policy.history() if policy is not None else None
            if history is not None:  # what the policy remembers of blocks gone (capped: eviction/ghosts.py)
                row["policy_history_ghosts"], row["policy_history_bytes"] = history
            row["checksum_failures"] = counters.get(f"{name}_checksum_failures", 0)
            if tier.persistent:
                # (its blocks less the writes still queued: a count, not a pass over the blocks)
                pending = row.get("pending_writes", row.get("pending_records", 0))
                row["durable_blocks"] = max(0, held[name][0] - pending)
                row["copies"] = len(index.copies[name]) + len(index.encoded_copies[name])
                row["encoded_copies"] = len(index.encoded_copies[name])
        per_tier[name] = row
    return per_tier


def namespace_rows(placement: Placement) -> dict[str, dict]:
    """Per namespace, in registration order: what identifies it, its blocks and bytes per tier, its counters."""
    out: dict[str, dict] = {}
    shared = placement.shared
    for ns_id, ns in shared.namespaces.items():
        out[ns_id] = {"model": ns.model, "tenant": ns.tenant, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                      "dtype": ns.dtype, "block_tokens": ns.block_tokens, "block_bytes": ns.block_bytes,
                      "num_layers": ns.num_layers, "layout": ns.layout,
                      "anchor": ns.anchor,  # (a hybrid model's attachments: kvstore/connectors/hybrid.py)
                      "blocks": {}, "bytes": {}, "counters": dict(shared.ns_counters.get(ns_id, {}))}
    for (tag, tier), (blocks, nbytes) in placement.index.held.items():
        row = out.get(key_ns(tag))
        if row is not None and blocks:
            row["blocks"][tier] = blocks
            row["bytes"][tier] = nbytes
    return out


def describe_blocks(placement: Placement, ns_id: str, hashes: Sequence[bytes]) -> list[dict | None]:
    tag = ns_tag(ns_id)
    found = [placement.index.get(tag + h) for h in hashes]
    by_tier: dict[str, list[Key]] = defaultdict(list)
    for e in found:
        if e is not None:
            by_tier[e.tier].append(e.key)
    values: dict[Key, str | None] = {}
    for tier, keys in by_tier.items():
        values.update(zip(keys, placement.policies[tier].describe(keys)))
    now = placement.shared.clock()
    return [None if e is None else {
        "tier": e.tier, "committed": e.committed, "pins": e.pins, "hits": e.hits, "depth": e.depth,
        "idle_s": now - e.last_access if e.last_access else None, "policy_value": values.get(e.key),
        "copies": sorted(e.copies or ()), "nbytes": e.nbytes, "attention": e.attention,
        "codec": getattr(e.location, "codec", None),  # the tag of a block stored compressed (disk), else None
    } for e in found]


def check(index: BlockIndex, placement: Placement, promoter: Promoter, compactor: Compactor | None = None) -> list[str]:
    """Every inconsistency between index, tiers, policies, refcounts and prefix tree (empty = clean).
    The caller flushes the tiers first, so that persistent tiers' indexes compare exactly. Blocks at rest
    (kvstore/resting.py) are woken first: as they were, they compare with the tiers and policies."""
    if index.resting is not None:
        index.resting.wake_all()
    entries, tiers, policies = index.entries, placement.tiers, placement.policies
    problems: list[str] = []
    children: dict[Key, list[int]] = defaultdict(lambda: [0] * len(TIERS))
    for key, e in entries.items():
        if e.key != key:
            problems.append(f"entry filed under the wrong key {key_text(key)}")
        if e.tier not in tiers:
            problems.append(f"{key_text(key)} sits in {e.tier}, which is not in the chain")
            continue
        if e.pins < 0:
            problems.append(f"negative refcount on {key_text(key)}")
        if e.parent is not None:
            parent = entries.get(e.parent)
            ns_id = key_ns(key)
            ns = placement.shared.namespaces.get(ns_id)
            if ns is not None and key_ns(e.parent) != (ns.anchor or ns_id):
                problems.append(f"{key_text(key)}'s parent {key_text(e.parent)} is not in its namespace's parent "
                                "namespace")
            if parent is None:
                problems.append(f"orphan: parent of {key_text(key)} is absent")
            elif RANK[e.tier] < RANK[parent.tier]:
                problems.append(f"{key_text(key)} sits in {e.tier}, faster than its parent in {parent.tier}")
            elif parent.depth + 1 != e.depth:
                problems.append(f"depth of {key_text(key)} does not follow its parent")
            children[e.parent][RANK[e.tier]] += 1
        if (key in policies[e.tier]) != e.committed:
            problems.append(f"policy of {e.tier} disagrees with commit state of {key_text(key)}")
        if not e.committed and (index.reservation_holding(key) is None or not tiers[e.tier].client_readable):
            problems.append(f"uncommitted {key_text(key)} belongs to no live reservation in a client-readable tier")
    for key, e in entries.items():
        counts = child_counts(e)
        if counts != children.get(key, [0] * len(TIERS)):
            problems.append(f"child counts of {key_text(key)} are {counts}, tree says {children.get(key)}")
        kids = children_of(e)
        if sum(counts) != len(kids) or any(entries.get(k, e).parent != key for k in kids):
            problems.append(f"children index of {key_text(key)} does not match its children's parent links")
    problems += _check_pins(index)
    problems += _check_copies(index)
    problems += _check_tally(index)
    held = promoter.held_pages()
    if compactor is not None:  # a compaction in flight holds its new pages; the record follows them once durable
        held += [("disk", slot) for slot in compactor.held_pages()]
    for tier in placement.chain:
        in_tier = {k: e for k, e in entries.items() if e.tier == tier.name}
        copies = {k: entries[k].copies[tier.name] for k in index.copy_keys(tier.name) if k in entries}
        num_committed = sum(1 for e in in_tier.values() if e.committed)
        if len(policies[tier.name]) != num_committed:
            problems.append(f"policy of {tier.name} tracks {len(policies[tier.name])} blocks, "
                            f"the tier holds {num_committed}")
        in_flight = [alloc for name, alloc in held if name == tier.name]
        problems += tier.check([e.location for e in in_tier.values()] + list(copies.values()) + in_flight)
        if tier.persistent:
            if not tier.client_readable:  # blocks arrive there committed (the host arena has reservations)
                problems += [f"{tier.name} entry {key_text(k)} is uncommitted"
                             for k, e in in_tier.items() if not e.committed]
            placed = {**{k: e.location for k, e in in_tier.items() if e.committed}, **copies}
            if compactor is not None and tier is compactor.disk:
                placed.update(compactor.records())
            problems += tier.check_records(placed)
    return problems


def _check_tally(index: BlockIndex) -> list[str]:
    """The index's tally (what stats report) counts exactly its committed entries."""
    held: dict[tuple[bytes, str], list[int]] = defaultdict(lambda: [0, 0])
    device_bytes: dict[str, Counter] = {tier: Counter() for tier in index.device_of}
    for e in index.entries.values():
        if e.committed:
            row = held[(e.key[:TAG_BYTES], e.tier)]
            row[0] += 1
            row[1] += e.nbytes
            if e.tier in index.device_of:
                device_bytes[e.tier][index.device_of[e.tier](e.location)] += e.nbytes
    kept = {k: v for k, v in index.held.items() if v != [0, 0]}
    problems = [f"tally of {key_ns(k[0])} in {k[1]} says {kept.get(k)}, the index holds {held.get(k)}"
                for k in set(kept) | set(held) if kept.get(k) != held.get(k)]
    for tier, per_device in device_bytes.items():
        if +Counter(index.device_bytes[tier]) != +per_device:
            problems.append(f"device tally of {tier} says {index.device_bytes[tier]}, the index holds {dict(per_device)}")
    return problems


def _check_copies(index: BlockIndex) -> list[str]:
    """Copies sit in persistent tiers slower than their block, and the per-tier index lists exactly them."""
    problems = []
    listed = {(tier, key) for tier in index.copies for key in index.copy_keys(tier)}
    for key, e in index.entries.items():
        for tier in e.copies or ():
            if (tier, key) not in listed:
                problems.append(f"copy of {key_text(key)} in {tier} is not in the copies index")
            elif key not in index.copy_list(tier, e.copies[tier]) or (
                    key in index.encoded_copies[tier] and key in index.copies[tier]):
                problems.append(f"copy of {key_text(key)} in {tier} is listed apart from the copies of its kind "
                                "(exact, encoded)")
            if tier not in index.copies or RANK[tier] <= RANK[e.tier] or not e.committed:
                problems.append(f"copy of {key_text(key)} in {tier} is not in a slower persistent tier")
        if e.copies == {}:
            problems.append(f"{key_text(key)} has an empty copies map")
    for tier, key in listed:
        e = index.entries.get(key)
        if e is None or tier not in (e.copies or ()):
            problems.append(f"the copies index of {tier} lists {key_text(key)}, which has no copy there")
    return problems


def _check_pins(index: BlockIndex) -> list[str]:
    problems = []
    pin_sum: Counter = Counter()
    for pins in index.pins_by_owner.values():
        pin_sum.update(pins)
    for key, e in index.entries.items():
        if pin_sum.get(key, 0) != e.pins:
            problems.append(f"refcount of {key_text(key)} is {e.pins}, owners hold {pin_sum.get(key, 0)}")
    for key in pin_sum:
        if key not in index.entries:
            problems.append(f"an owner pins {key_text(key)}, which is not in the index")
    for owner, ghosts in index.ghost_pins.items():
        if any(n < 0 for n in ghosts.values()):
            problems.append(f"negative ghost pin of owner {owner}")
    return problems
