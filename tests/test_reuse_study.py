"""tools/bench/reuse_study.py: exact counts on a hand-made trace, invariants on a real excerpt."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.eviction.traces import Request
from tests.test_replay import TRACE, needs_trace
from kvstore.tools.bench import reuse_study
from kvstore.tools.replay import replay

# Block ids chain per request; times in seconds.
TINY = [
    Request(0.0, 1536, (1, 2, 3)),
    Request(10.0, 1536, (1, 2, 4)),  # first reuse of 1, 2 after 10 s
    Request(100.0, 1024, (1, 2)),  # repeat reuse of 1, 2 after 90 s
    Request(1000.0, 1536, (1, 2, 3)),  # 1, 2 repeat after 900 s; 3 first reuse after 1000 s
]


def test_reference_kinds_and_decompose_count_exactly():
    kinds = reuse_study.reference_kinds(TINY)
    assert kinds[0] == [None, None, None]
    assert kinds[1] == [("first reuse", "0-60s"), ("first reuse", "0-60s"), None]
    assert kinds[2] == [("repeat reuse", "60-180s")] * 2
    assert kinds[3] == [("repeat reuse", ">=600s")] * 2 + [("first reuse", ">=600s")]
    got = reuse_study.decompose(kinds, [0, 2, 1, 3])
    assert got == {("first reuse", "0-60s"): 2, ("repeat reuse", "60-180s"): 1,
                   ("repeat reuse", ">=600s"): 2, ("first reuse", ">=600s"): 1}


def test_predictability_uses_only_first_references():
    rows = {(r["feature"], r["value"]): r for r in reuse_study.predictability(TINY, horizon_s=180.0)}
    # first references: 1, 2, 3 at t=0 (1 and 2 come back after 10 s, 3 after 1000 s) and 4 at t=10 (never)
    assert rows[("all", "all")]["blocks"] == 4
    assert rows[("all", "all")]["p_reused"] == pytest.approx(2 / 4)
    assert rows[("last block", "yes")]["blocks"] == 2 and rows[("last block", "yes")]["p_reused"] == 0.0
    assert rows[("request", "continuation")]["blocks"] == 1  # block 4: request 2 hit two blocks


def test_hit_density_table_favours_blocks_that_come_back():
    # block 0 comes back every 30 s; each request's second block is never seen again
    trace = [Request(30.0 * i, 1024, (0, 1000 + i)) for i in range(200)]
    table = reuse_study.fit_hit_density(trace, horizon_s=120.0)
    assert set(table) == {(1,), (2,), (3,), (4,)}
    assert all(row.shape == (reuse_study.HD_BINS,) and np.all(row >= 0) and np.isfinite(row).all()
               for row in table.values())
    # class 1 is mostly one-off blocks; class 4+ is block 0, one hit per 30 s of residence
    assert table[(1,)][0] < 0.01 < table[(4,)][0]
    assert table[(4,)][0] == pytest.approx(1 / 30, rel=0.05)
    # with arrival features the one-off blocks (last block of their request) get their own class
    features = reuse_study.arrival_features(trace)
    assert features[0] == ("0-7", False, False) and features[1005] == ("0-7", False, True)
    split = reuse_study.fit_hit_density(trace, horizon_s=120.0, features=features)
    assert split[(1, "0-7", False, True)][0] == 0.0 and split[(4, "0-7", False, False)][0] == pytest.approx(1 / 30, rel=0.05)


@needs_trace
def test_study_invariants_on_a_real_excerpt():
    from kvstore.eviction.traces import read_trace

    requests = read_trace(TRACE, 1500)
    doc = reuse_study.study(requests, 300, ["lru", "s3fifo", "attention", "belady"], horizon_s=180.0)
    runs = doc["runs"]
    for name, split in doc["hits_by_kind"].items():
        # every hit is a reuse, so the split adds up to the replay's own hit count
        assert sum(split.values()) == runs[name]["hit_blocks"], name
        assert all(split[k] <= doc["available"][k] for k in split), name
    assert all(runs["belady"]["hit_ratio"] >= r["hit_ratio"] for r in runs.values())
    assert doc["best_baseline"] in ("lru", "s3fifo")
    assert set(doc["gap_closed"]) == {"attention", "belady", "hd-oracle", "hd-oracle+arrival"}
    assert doc["gap_closed"]["belady"] == pytest.approx(1.0)
    # the oracle policy through the real store: replay() itself would raise on orphans or check problems
    hits: list[int] = []
    features = reuse_study.arrival_features(requests)
    table = reuse_study.fit_hit_density(requests, 120.0, features)
    result = replay(requests, "lru", 300, factory=lambda clock: reuse_study.HitDensityOracle(table, clock, features),
                    hits_out=hits)
    assert result["orphans"] == 0 and result["check_problems"] == 0
    assert len(hits) == len(requests) and sum(hits) == result["hit_blocks"]
