"""tools/bench/policy_sim.py follows the store's eviction rules: same hits per request as the real replay."""

from __future__ import annotations

import json
import sys

import pytest

from kvstore.eviction.base import policy_names
from kvstore.tools.bench.policy_sim import load, main, simulate
from kvstore.tools.replay import replay


@pytest.mark.parametrize("trace,capacity", [("gen:agentic", 120), ("gen:mixed", 200), ("gen:scan", 90)])
def test_simulator_matches_the_store_request_by_request(trace, capacity):
    reqs = load(trace, limit=500)
    for policy in policy_names():
        via_store: list[int] = []
        replay(reqs, policy, capacity, hits_out=via_store)
        via_sim: list[int] = []
        res = simulate(reqs, policy, capacity, hits_out=via_sim)
        assert via_sim == via_store, f"{policy} on {trace} at {capacity} blocks: the simulator diverged"
        assert 0 < res["hit_blocks"] < res["blocks"]  # the capacity makes the policies evict


def test_smaller_blocks_and_the_cli(capsys):
    reqs = load("gen:tenants", limit=120)
    via_store: list[int] = []
    replay(reqs, "attention", 300, block_tokens=128, hits_out=via_store)
    via_sim: list[int] = []
    simulate(reqs, "attention", 300, block_tokens=128, hits_out=via_sim)
    assert via_sim == via_store
    assert main(["gen:tenants", "--policy", "lru", "--capacity-blocks", "50", "--limit", "50"]) == 0
    assert "gen:tenants" in capsys.readouterr().out


def test_full_blocks_in_both_replays(capsys):
    reqs = load("gen:scan", limit=300, full=512)
    assert reqs and all(r.input_length % 512 == 0 for r in reqs)
    assert sum(len(r.hash_ids) for r in reqs) < sum(len(r.hash_ids) for r in load("gen:scan", limit=300))
    for policy in ("lru", "attention"):
        via_store: list[int] = []
        replay(reqs, policy, 90, hits_out=via_store)
        via_sim: list[int] = []
        simulate(reqs, policy, 90, hits_out=via_sim)
        assert via_sim == via_store and sum(via_sim) > 0
    assert main(["gen:scan", "--policy", "lru", "--capacity-blocks", "90", "--limit", "300", "--full-blocks",
                 "--json"]) == 0
    blocks = json.loads(capsys.readouterr().out)["blocks"]
    assert blocks == sum(len(r.hash_ids) for r in reqs)


def test_a_policy_naming_a_pinned_victim_is_an_error():
    from kvstore.eviction.lru import LRUPolicy

    class Bad(LRUPolicy):
        def victims(self, n_bytes, evictable):
            return list(self._order)[:1] or None  # ignores evictable: may name a parent

    with pytest.raises(RuntimeError, match="not evictable"):
        simulate(load("gen:agentic", limit=200), lambda clock: Bad(clock=clock), 20)


def test_variants_and_the_summary_against_the_best_baseline(capsys):
    from kvstore.tools.bench.policy_sim import summary, variant

    label, factory = variant("h30:half_life_s=30,gate=false,adapt=false")
    pol = factory(lambda: 0.0)
    assert label == "h30" and pol.params.half_life_s == 30 and pol.params.gate is False and pol.experts is None
    with pytest.raises(ValueError, match="not one of the experts"):
        variant("x:half_life_s=45")  # adapting: the start must be an expert
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        variant("x:no_such_field=1")
    with pytest.raises(ValueError, match="positive"):
        variant("x:half_life_s=0")  # AttentionParams' own check
    label, factory = variant("e4:half_lives=8/30/240/2000,half_life_s=240")  # a tuple field: values joined by /
    pol = factory(lambda: 0.0)
    assert pol.experts.half_lives == (8.0, 30.0, 240.0, 2000.0) and pol.half_life_s == 240.0
    with pytest.raises(ValueError, match="needs numbers joined by"):
        variant("x:half_lives=8/soon")
    with pytest.raises(ValueError, match="needs a number or true/false"):
        variant("x:gate=maybe")
    label, factory = variant("all:sample_bits=0")  # an integer field
    assert factory(lambda: 0.0).experts.sample_bits == 0
    with pytest.raises(ValueError, match="needs an integer"):
        variant("x:sample_bits=1.5")
    with pytest.raises(ValueError, match="sample_bits must be an integer"):
        variant("x:sample_bits=17")
    # Two cells: the variant is above the best baseline in one, below in the other; the oracle takes the better.
    lines = summary({("t", 1): {"lru": 0.5, "arc": 0.6, "a": 0.7, "b": 0.1},
                     ("t", 2): {"lru": 0.5, "arc": 0.4, "a": 0.3, "b": 0.55}})
    assert lines[0].split()[0] == "a" and "1/2 cells, mean -0.0500, worst -0.2000" in lines[0]
    assert lines[1].split()[0] == "b" and "1/2 cells, mean -0.2250, worst -0.5000" in lines[1]
    assert lines[2].split()[0] == "oracle" and "2/2 cells, mean +0.0750, worst +0.0500" in lines[2]
    assert main(["gen:agentic", "--limit", "80", "--capacity-blocks", "40", "--policy", "lru",
                 "--variant", "short:half_life_s=5,adapt=false", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "short" in out and "oracle" in out and "cells" in out


def test_an_unknown_policy_is_refused_before_any_replay(capsys):
    with pytest.raises(SystemExit):  # argparse's error exit, before the pool or a trace is loaded
        main(["gen:agentic", "--policy", "lru", "belady", "--jobs", "2"])
    err = capsys.readouterr().err
    assert "unknown eviction policy 'belady'" in err and "kvstore replay" in err


def test_draws_of_a_shape_are_summarised_per_shape_and_jobs_change_nothing(capsys):
    from kvstore.tools.bench.policy_sim import by_shape, shape_of

    assert shape_of("gen:tenants:7") == "gen:tenants" == shape_of("gen:tenants")
    assert shape_of("../traces/a.jsonl") == "../traces/a.jsonl"
    # a subject above the best baseline in one draw of two, below it in the other; a shape drawn once is left out
    lines = by_shape({("gen:s", 1): {"lru": 0.5, "arc": 0.6, "a": 0.7},
                      ("gen:s:7", 1): {"lru": 0.5, "arc": 0.4, "a": 0.3},
                      ("gen:t", 1): {"lru": 0.5, "a": 0.1}})
    assert len(lines) == 1 and lines[0].split()[:2] == ["a", "gen:s"]
    assert "1/2 draws, mean -0.0500, worst -0.2000" in lines[0]
    argv = ["gen:agentic", "--limit", "120", "--capacity-blocks", "30,60", "--policy", "lru", "arc",
            "--variant", "short:half_life_s=5,adapt=false", "--seeds", "7", "--summary"]
    assert main(argv) == 0
    serial = capsys.readouterr().out
    assert "gen:agentic:7" in serial and "draws" in serial
    assert main(argv + ["--jobs", "2"]) == 0
    assert capsys.readouterr().out == serial  # the same rows, in the same order, and the same summary
    for bad in (["--jobs", "0"], ["--jobs", "2", "--segments", "2"], ["--seeds", "7,x"]):
        with pytest.raises(SystemExit):
            main(argv + bad)


def test_segments_split_the_hit_ratio_by_stretch_of_requests(capsys):
    from kvstore.eviction.traces import expand
    from kvstore.tools.bench.policy_sim import segments

    reqs = load("gen:shift", 400)
    hits: list[int] = []
    res = simulate(reqs, "lru", 300, hits_out=hits)
    sizes = [len(expand(r, 512)[0]) for r in reqs]
    lines = segments(sizes, {"lru": hits}, 4)
    rows = [line.split() for line in lines[1:]]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    blocks = [int(r[1]) for r in rows]
    assert sum(blocks) == sum(sizes) == res["blocks"]
    # the stretches' hits, weighted by their blocks, add up to the whole run's
    assert sum(b * float(r[2]) for b, r in zip(blocks, rows)) == pytest.approx(
        res["hit_blocks"], abs=4 * 0.5e-4 * max(blocks))
    assert len({r[2] for r in rows}) > 1  # the hot set's move shows: the stretches differ
    assert main(["gen:shift", "--limit", "100", "--capacity-blocks", "50", "--policy", "lru", "--segments", "2"]) == 0
    out = capsys.readouterr().out
    assert "in each 1/2 of the requests" in out and len([ln for ln in out.splitlines() if ln.split()[:1] == ["1"]]) == 1
    with pytest.raises(SystemExit):
        main(["gen:shift", "--limit", "10", "--policy", "lru", "--segments", "-1"])


def test_policy_cost_drives_every_phase_and_refuses_unknown_policies(capsys):
    from kvstore.tools.bench import policy_cost

    for spec in ("lru", "attention", "attention/1"):
        times = policy_cost.run_rounds(spec, 1)  # raises if a removal left a block tracked
        assert len(times) == 3 and all(len(t) == 1 and t[0] > 0 for t in times)
    argv = sys.argv
    try:
        sys.argv = ["policy_cost.py", "--policy", "attention/2"]
        with pytest.raises(SystemExit):
            policy_cost.main()
    finally:
        sys.argv = argv
    assert "unknown policy 'attention/2'" in capsys.readouterr().err
