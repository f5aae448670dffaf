"""Per-model Prometheus labels with bounded cardinality, and the Grafana dashboard built on them.

A real daemon with more models registered than get their own label: the
first MAX_MODEL_LABELS keep their names, the rest are summed under "_other",
per-model counts add up to the per-tier totals, and a model's hits are its
own. Every metric and label the dashboard's queries (and its variables) name
is in a real scrape, so the dashboard cannot drift from the daemon.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVClient
from kvstore.keys import hash_blocks
from kvstore.server.metrics import MAX_MODEL_LABELS, OTHER_MODEL
from tests.conftest import ROOT
from tests.helpers import namespace

DASHBOARD = ROOT / "docs" / "grafana" / "kvstore.json"
NUM_MODELS = MAX_MODEL_LABELS + 4


def scrape(daemon) -> dict[str, list]:
    status, body = daemon.http("/metrics")
    assert status == 200
    samples: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(body.decode()):
        samples.setdefault(family.name, [])
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def fill(daemon) -> None:
    with KVClient(daemon.socket_path) as c:
        for m in range(NUM_MODELS):
            ns = c.register(namespace(f"model-{m}"))
            n = m % 3 + 1
            hs = hash_blocks(np.arange(16 * n) + m * 10_000, 16)
            c.put(ns, [(h, p, np.zeros(64 * 1024, np.uint8)) for h, p in zip(hs, [None] + hs[:-1])])
            if m == 1:
                c.get(ns, hs)  # 2 hits for model-1
        try:
            c.call("no-such-op")
        except Exception:
            pass  # an error sample for the dashboard's error panel


def test_per_model_labels_are_bounded_and_add_up(daemon_factory, tmp_path):
    d = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0")
    fill(d)
    m = scrape(d)
    blocks = {(lab["model"], lab["tier"]): v for lab, v in m["kvstore_namespace_blocks"]}
    models = {model for model, _ in blocks}
    assert len(models) == MAX_MODEL_LABELS + 1 and OTHER_MODEL in models
    assert {f"model-{i}" for i in range(MAX_MODEL_LABELS)} <= models
    assert blocks[("model-0", "host")] == 1 and blocks[("model-2", "host")] == 3
    assert blocks[(OTHER_MODEL, "host")] == sum(i % 3 + 1 for i in range(MAX_MODEL_LABELS, NUM_MODELS))
    [(_, total)] = [(lab, v) for lab, v in m["kvstore_blocks"] if lab["tier"] == "host"]
    assert sum(v for (_, tier), v in blocks.items() if tier == "host") == total
    hits = {lab["model"]: v for lab, v in m["kvstore_namespace_hit_blocks_total"]}
    assert hits["model-1"] == 2 and sum(hits.values()) == 2
    puts = {lab["model"]: v for lab, v in m["kvstore_namespace_put_blocks_total"]}
    assert sum(puts.values()) == sum(i % 3 + 1 for i in range(NUM_MODELS))
    ops = {lab["op"]: v for lab, v in m["kvstore_requests_total"]}
    assert ops["register"] == NUM_MODELS and ops["commit"] >= NUM_MODELS
    assert m["kvstore_events_published_total"][0][1] > 0
    status, body = d.http("/stats")
    host = json.loads(body)["tiers"]["host"]  # the default policy's history, as the stats count it
    assert [(lab["tier"], v) for lab, v in m["kvstore_policy_history_ghosts"]] == [("host", host["policy_history_ghosts"])]
    assert [(lab["tier"], v) for lab, v in m["kvstore_policy_history_bytes"]] == [("host", host["policy_history_bytes"])]
    assert host["policy_history_bytes"] > 0  # (the tables' first arrays, before anything is evicted)


def test_dashboard_queries_name_only_what_the_daemon_exports(daemon_factory):
    d = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0")
    fill(d)
    m = scrape(d)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 10
    for expr in exprs:
        names = set(re.findall(r"\bkvstore_[a-z_]+\b", expr))
        assert names, expr
        for name in names:
            assert name in m, f"{name} (in {expr!r}) is not in the daemon's /metrics"
        have = {k for name in names for labels, _ in m[name] for k in labels}
        wanted = {lab.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for lab in group.split(",")}
        wanted |= set(re.findall(r"\b(model|tier|op|type)=~", expr))
        wanted |= set(re.findall(r"label_values\(\w+, (\w+)\)", expr)) - {"instance"}  # instance: added by Prometheus
        assert wanted <= have, f"{expr!r} groups by {wanted - have}, which its metrics do not carry"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_present_blocks_read_as_misses_are_in_stats_and_metrics_by_reason(daemon):
    """A miss on a present (committed) block is counted by reason in /stats and /metrics."""
    with KVClient(daemon.socket_path) as c:
        ns = c.register(namespace("present-misses"))
        hs = hash_blocks(np.arange(16 * 3), 16)
        c.put(ns, [(h, p, np.zeros(64 * 1024, np.uint8)) for h, p in zip(hs, [None] + hs[:-1])])
        absent = hash_blocks(np.arange(16) + 99_999, 16)[0]
        assert c.acquire(ns, [absent, hs[1], hs[2]], prefix=True) == [None, None, None]
    assert daemon.stats()["present_misses"] == {"after_a_miss": 2}
    samples = scrape(daemon)["kvstore_present_block_misses_total"]
    assert samples == [({"reason": "after_a_miss"}, 2.0)]
