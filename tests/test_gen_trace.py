"""The seeded trace generator (tools/gen_trace.py): format, determinism, and each shape's property."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvstore.tools import cli
from kvstore.tools.gen_trace import BLOCK, SHAPES, generate, requests_for


@pytest.fixture(scope="module")
def traces() -> dict:
    return {shape: generate(shape) for shape in SHAPES}


def test_every_shape_is_a_valid_mooncake_trace(traces):
    for shape, lines in traces.items():
        parent: dict = {}
        assert len(lines) > 1000, shape
        assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(lines, lines[1:])), shape
        for line in lines:
            assert len(line.hash_ids) == -(-line.input_length // BLOCK), (shape, line)
            assert line.output_length > 0
            prev = None
            for h in line.hash_ids:
                assert parent.setdefault(h, prev) == prev, f"{shape}: id {h} has two parents"
                prev = h


def test_same_seed_same_trace_other_seed_other_trace():
    for shape in SHAPES:
        a = [line.to_json() for line in generate(shape, seed=5)]
        assert a == [line.to_json() for line in generate(shape, seed=5)], shape
        assert a != [line.to_json() for line in generate(shape, seed=6)], shape


def test_tenants_share_system_prompts_and_have_short_private_tails(traces):
    lines = traces["tenants"]
    firsts = Counter(line.hash_ids[0] for line in lines)
    assert len(firsts) <= 4  # a few system prompts ...
    top, n = firsts.most_common(1)[0]
    sharing = [line.hash_ids for line in lines if line.hash_ids[0] == top]
    system = 0
    while all(len(ids) > system and ids[system] == sharing[0][system] for ids in sharing):
        system += 1
    tenants = {ids[system] for ids in sharing}
    assert system >= 6 and n > len(lines) / 4 and len(tenants) > 100  # ... each shared by many tenants
    by_tenant: dict = {}
    for ids in sharing:
        by_tenant.setdefault(ids[system], []).append(ids)
    for group in by_tenant.values():
        if len(group) < 2:
            continue
        common = 0  # the tenant's own prefix: system prompt + its instructions
        while all(len(ids) > common and ids[common] == group[0][common] for ids in group):
            common += 1
        assert common >= system + 2
        assert all(len(ids) - common <= 4 for ids in group)  # short private tails after it


def test_agentic_contexts_grow_step_after_step(traces):
    lines = traces["agentic"]
    by_prefix = {}
    grown = 0
    for line in lines:
        full = line.hash_ids[:-1]
        # a step continues a session whose previous request's full blocks are all its prefix
        for k in range(len(full), 0, -1):
            if full[:k] in by_prefix:
                if len(line.hash_ids) > by_prefix[full[:k]]:
                    grown += 1
                break
        for k in range(1, len(full) + 1):
            by_prefix[full[:k]] = len(line.hash_ids)
    assert grown > 0.7 * len(lines)
    lengths = [len(line.hash_ids) for line in lines]
    assert max(lengths) > 50 and sum(lengths) / len(lengths) > 15


def test_scan_mixes_one_off_long_documents_with_a_hot_set(traces):
    lines = traces["scan"]
    refs = Counter(h for line in lines for h in line.hash_ids)
    long = [line for line in lines if len(line.hash_ids) > 26]  # longer than any hot document + question
    assert 0.1 * len(lines) < len(long) < 0.3 * len(lines)
    assert all(refs[h] == 1 for line in long for h in line.hash_ids)  # read once, never again
    hot = [h for h, n in refs.items() if n >= 20]
    assert len(hot) > 500  # documents asked about again and again


def test_shift_moves_the_hot_set_halfway(traces):
    lines = traces["shift"]
    half = len(lines) // 2
    first = Counter(h for line in lines[:half] for h in line.hash_ids)
    second = Counter(h for line in lines[half:] for h in line.hash_ids)
    hot_first = {h for h, n in first.items() if n >= 10}
    hot_second = {h for h, n in second.items() if n >= 10}
    assert len(hot_first) > 1000 and len(hot_second) > 1000
    assert not hot_first & set(second) and not hot_second & set(first)


def test_mixed_interleaves_the_four_shapes(traces):
    lines = traces["mixed"]
    firsts = Counter(line.hash_ids[0] % 4 for line in lines)  # each stream has its own ids modulo 4
    assert len(firsts) == 4 and min(firsts.values()) > len(lines) / 8


def test_gen_trace_cli_and_replay_of_a_generated_trace(tmp_path, capsys):
    out = tmp_path / "scan.jsonl"
    assert cli.main(["gen-trace", "scan", "--seed", "3", "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert [json.loads(l) for l in lines[:3]] == [json.loads(line.to_json()) for line in generate("scan", 3)[:3]]
    assert cli.main(["replay", "gen:scan:3", "--limit", "200", "--policy", "lru", "--capacity-blocks", "500",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 200 and doc["orphans"] == 0 and doc["trace"] == "gen:scan:3"
    assert len(requests_for("gen:scan:3")) == len(lines)
    with pytest.raises(ValueError):
        requests_for("gen:nope")
