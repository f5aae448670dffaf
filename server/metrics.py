"""Prometheus families beyond the per-tier ones (server/admin.py's collector yields these too).

Per model (label `model`): blocks and bytes per tier, and the counters the
store keeps per namespace (hits, misses, lookups, puts, evictions). A model's
namespaces (TP ranks, tenants, dtypes) are summed under its name. Cardinality
is bounded: the first MAX_MODEL_LABELS models the daemon registered (in
registration order, which never changes while it runs) get their own label;
every later one is counted under OTHER_MODEL, so each series stays monotonic.
Names longer than MAX_LABEL_CHARS keep their last characters (a path's model
folder). Also: requests per op, the cyclic collector's pauses, and the KV-event publisher's counts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.server.stalls import STALL_S

MAX_MODEL_LABELS = 16
MAX_LABEL_CHARS = 96
OTHER_MODEL = "_other"
NS_COUNTERS = {  # store counter -> (metric name, help)
    "hit_blocks": ("kvstore_namespace_hit_blocks", "Blocks acquired (hits) per model"),
    "miss_blocks": ("kvstore_namespace_miss_blocks", "Blocks asked for and not present, per model"),
    "lookup_blocks": ("kvstore_namespace_lookup_blocks", "Blocks looked up per model"),
    "lookup_hit_blocks": ("kvstore_namespace_lookup_hit_blocks", "Blocks found by lookups per model"),
    "put_blocks": ("kvstore_namespace_put_blocks", "Blocks committed per model"),
    "evictions": ("kvstore_namespace_evictions", "Blocks evicted (demoted or dropped) per model, all tiers"),
}


def model_labels(by_namespace: dict[str, dict]) -> dict[str, str]:
    """namespace id -> its `model` label value."""
    labels: dict[str, str] = {}
    seen: dict[str, str] = {}
    for ns_id, ns in by_namespace.items():
        model = ns["model"]
        if model not in seen:
            seen[model] = model[-MAX_LABEL_CHARS:] if len(seen) < MAX_MODEL_LABELS else OTHER_MODEL
        labels[ns_id] = seen[model]
    return labels


def namespace_families(stats: dict) -> Iterator:
    by_ns = stats.get("by_namespace", {})
    labels = model_labels(by_ns)
    blocks: dict[tuple, int] = defaultdict(int)
    nbytes: dict[tuple, int] = defaultdict(int)
    counters: dict[str, dict[str, int]] = {k: defaultdict(int) for k in NS_COUNTERS}
    namespaces: dict[str, int] = defaultdict(int)
    chain = stats.get("chain", [])
    for ns_id, ns in by_ns.items():
        model = labels[ns_id]
        namespaces[model] += 1
        for tier in chain:
            blocks[(model, tier)] += ns["blocks"].get(tier, 0)
            nbytes[(model, tier)] += ns["bytes"].get(tier, 0)
        for key in NS_COUNTERS:
            counters[key][model] += ns["counters"].get(key, 0)
    g_blocks = GaugeMetricFamily("kvstore_namespace_blocks", "Committed blocks per model and tier",
                                 labels=["model", "tier"])
    g_bytes = GaugeMetricFamily("kvstore_namespace_bytes", "Bytes of committed blocks per model and tier",
                                labels=["model", "tier"])
    for (model, tier), n in blocks.items():
        g_blocks.add_metric([model, tier], n)
        g_bytes.add_metric([model, tier], nbytes[(model, tier)])
    yield g_blocks
    yield g_bytes
    g_ns = GaugeMetricFamily("kvstore_namespace_count", "Namespaces per model (TP ranks, tenants, dtypes)",
                             labels=["model"])
    for model, n in namespaces.items():
        g_ns.add_metric([model], n)
    yield g_ns
    for key, (name, help_text) in NS_COUNTERS.items():
        family = CounterMetricFamily(name, help_text, labels=["model"])
        for model, n in counters[key].items():
            family.add_metric([model], n)
        yield family


def daemon_families(stats: dict) -> Iterator:
    ops = CounterMetricFamily("kvstore_requests", "Data-plane requests served, per op", labels=["op"])
    for op, n in stats.get("ops", {}).items():
        ops.add_metric([op], n)
    yield ops
    pauses = stats.get("gc", {}).get("pauses")
    if pauses:  # the cyclic collector's pauses (server/daemon.py GcPauses): what they stop the event loop for
        total = CounterMetricFamily("kvstore_gc_pause_seconds", "Time in cyclic collections, per generation",
                                    labels=["generation"])
        longest = GaugeMetricFamily("kvstore_gc_pause_longest_seconds", "The longest cyclic collection, per generation",
                                    labels=["generation"])
        for g, p in enumerate(pauses):
            total.add_metric([str(g)], p["total_s"])
            longest.add_metric([str(g)], p["longest_ms"] / 1e3)
        yield total
        yield longest
    stalls = stats.get("event_loop_stalls")
    if stalls is not None:  # turns that held the event loop (server/stalls.py): every request waited
        yield CounterMetricFamily("kvstore_event_loop_stalls",
                                  f"Turns that held the event loop {STALL_S * 1e3:g} ms or more", value=stalls["stalls"])
        yield CounterMetricFamily("kvstore_event_loop_stall_seconds", "Time the event loop was held by such turns",
                                  value=stalls["total_s"])
        yield GaugeMetricFamily("kvstore_event_loop_stall_longest_seconds", "The longest turn that held the event loop",
                                value=stalls["longest_ms"] / 1e3)
    resting = stats.get("resting")
    if resting is not None:  # the disk tier's blocks at rest (kvstore/resting.py)
        yield GaugeMetricFamily("kvstore_resting_blocks", "Disk blocks kept as rows of bytes (at rest)",
                                value=resting["blocks"])
        yield GaugeMetricFamily("kvstore_resting_bytes", "Bytes of the rows of the blocks at rest", value=resting["bytes"])
        yield CounterMetricFamily("kvstore_resting_woken", "Blocks woken from rest (read or changed)",
                                  value=resting["woken"])
    events = stats.get("events")
    if events is not None:  # KV events are on
        yield CounterMetricFamily("kvstore_events_published", "KV events published", value=events.get("events", 0))
        yield CounterMetricFamily("kvstore_events_batches", "KV-event batches (ZMQ messages) published",
                                  value=events.get("batches", 0))
        yield CounterMetricFamily("kvstore_events_dropped", "KV events dropped (publisher behind; a resync follows)",
                                  value=events.get("events_dropped", 0))
        yield CounterMetricFamily("kvstore_events_resyncs", "Full-state resyncs after drops",
                                  value=events.get("resyncs", 0))
