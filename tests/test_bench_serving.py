"""tools/bench/bench_serving.py's workload mapping (no vLLM): seeded and deterministic, and the trace's prefix
structure kept: equal hash_id prefixes give equal token prefixes, different blocks give different tokens."""

from __future__ import annotations

import json

from kvstore.tools.bench.bench_serving import parse_metrics
from kvstore.tools.bench.serving_workload import TRACE, build_workload, load_trace, session_of, workload_stats

ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 7]},
    {"timestamp": 20, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3]},  # turn 2 of s1
    {"timestamp": 30, "input_length": 900, "output_length": 5, "hash_ids": [0, 9]},  # single turn: left out
    {"timestamp": 40, "input_length": 1100, "output_length": 5, "hash_ids": [0, 7, 8, 11]},
    {"timestamp": 50, "input_length": 5000, "output_length": 5, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 12, 13, 14]},
]


def build(rows=ROWS, **kw):
    args = dict(requests=10, block_tokens=64, max_blocks=6, seed=3, tenants=2, system_blocks=2, min_turns=2,
                duration_s=5.0)
    args.update(kw)
    return build_workload(rows, **args)


def test_sessions_turns_and_arrivals():
    reqs = build()
    assert [r.session for r in reqs] == ["s1", "s7", "s1", "s7", "s1"]  # s9 has one turn only
    assert [round(r.arrival_s, 3) for r in reqs] == [0.0, 1.0, 2.0, 4.0, 5.0]  # 0..50 ms -> 0..5 s, in order
    assert all(0 <= r.tenant < 2 for r in reqs)
    assert len({r.tenant for r in reqs if r.session == "s1"}) == 1


def test_lengths_scaled_capped_and_system_prompt_per_tenant():
    reqs = build()
    # 1500 trace tokens -> ceil(1500*64/512) = 188, plus the tenant's system prompt (2 blocks replace block 0)
    assert len(reqs[0].prompt) == 188 + 64
    assert len(reqs[2].prompt) == 250 + 64
    # capped at 6 blocks: the first 6 hash_ids, full blocks, + the extra system block
    assert reqs[4].hash_ids == [0, 1, 2, 3, 4, 5] and len(reqs[4].prompt) == 6 * 64 + 64


def test_equal_hash_prefixes_give_equal_token_prefixes():
    reqs = build()
    a, b, c = reqs[0], reqs[2], reqs[4]
    assert b.prompt[: len(a.prompt) - 60] == a.prompt[: len(a.prompt) - 60]  # [0,1,2] is a prefix of [0,1,2,3]
    assert c.prompt[: 4 * 64] == b.prompt[: 4 * 64]  # sys(2 blocks) + h1 + h2
    s7 = reqs[1]
    if s7.tenant == a.tenant:  # same tenant: the same system prompt, then different blocks
        assert s7.prompt[:128] == a.prompt[:128]
    else:
        assert s7.prompt[:64] != a.prompt[:64]
    assert s7.prompt[128:192] != a.prompt[128:192]
    # the same hash_id at the same place is the same block everywhere
    assert reqs[3].prompt[128:152] == reqs[1].prompt[128:152]  # h7 (reqs[1] ends inside it)


def test_seeded_and_deterministic():
    one, two = build(), build()
    assert [r.prompt for r in one] == [r.prompt for r in two]
    other = build(seed=4)
    assert [r.prompt for r in other] != [r.prompt for r in one]
    assert all(1000 <= t < 48000 for r in one for t in r.prompt)


def test_workload_stats_counts_first_sightings():
    reqs = build()
    st = workload_stats(reqs, 64)
    assert st["requests"] == 5 and st["sessions"] == 2
    assert st["prompt_tokens"] == sum(len(r.prompt) for r in reqs)
    assert st["min_computed_tokens"] < st["prompt_tokens"]


def test_real_trace_prefix_structure_if_present():
    if not TRACE.exists():
        return
    rows = load_trace(TRACE, limit=3000)
    reqs = build_workload(rows, requests=60, seed=0)
    assert len(reqs) == 60
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    # every later turn that extends an earlier turn's hash_ids extends its tokens too
    checked = 0
    for turns in by_session.values():
        for x, y in zip(turns, turns[1:]):
            n = 0
            while n < min(len(x.hash_ids), len(y.hash_ids)) and x.hash_ids[n] == y.hash_ids[n]:
                n += 1
            if n >= 2:
                k = (n - 1 + 4) * 64 if n < len(x.hash_ids) else len(x.prompt) - 64
                k = min(k, len(x.prompt), len(y.prompt))
                assert x.prompt[:k] == y.prompt[:k]
                checked += 1
    assert checked > 10
    assert session_of({"hash_ids": [0, 5, 6]}) == "s5"


def test_parse_metrics_sums_labelled_series():
    text = "\n".join([
        "# HELP vllm:prompt_tokens_total x",
        'vllm:prompt_tokens_total{engine="0",model_name="smol"} 100.0',
        'vllm:prompt_tokens_total{engine="1",model_name="smol"} 20.0',
        "vllm:prefix_cache_hits_total 7",
    ])
    m = parse_metrics(text)
    assert m["vllm:prompt_tokens_total"] == 120.0 and m["vllm:prefix_cache_hits_total"] == 7.0
    json.dumps(m)


def test_simulated_hit_accounting_orders_the_arms():
    from kvstore.tools.bench.serving_workload import simulate

    rows = load_trace(TRACE, limit=3000) if TRACE.exists() else None
    if rows is None:
        return
    reqs = build_workload(rows, requests=80, block_tokens=32, max_blocks=16, seed=0)
    small = 2000  # tokens of local cache per engine: far below the working set
    a = simulate(reqs, 2, 32, small, affinity=False, store=False)
    b = simulate(reqs, 2, 32, small, affinity=True, store=False)
    c = simulate(reqs, 2, 32, small, affinity=False, store=True)
    d = simulate(reqs, 2, 32, small, affinity=True, store=True)
    assert a["prompt"] == b["prompt"] == c["prompt"] == sum(len(r.prompt) for r in reqs)
    assert c["computed"] == d["computed"] < b["computed"] <= a["computed"]
    assert d["local"] >= c["local"]
    # a dead engine: affinity alone recomputes more, the store keeps what it had
    dead = (1, 30, 45)
    assert simulate(reqs, 2, 32, small, True, False, dead)["computed"] >= b["computed"]
    assert simulate(reqs, 2, 32, small, True, True, dead)["computed"] == d["computed"]
