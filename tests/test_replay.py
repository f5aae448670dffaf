"""`kvstore replay` end to end on an excerpt of the Mooncake conversation trace.

The excerpt (the first 300 requests) is read from tools/traces at test
time; the test skips, saying why, when the trace is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstore.eviction.traces import expand, full_blocks, next_use_index, read_trace, Request
from kvstore.keys import block_key, ns_tag
from kvstore.tools import cli
from kvstore.tools.replay import ALL_POLICIES

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TRACE = os.path.join(ROOT, "tools", "traces", "mooncake_conversation_trace.jsonl")
needs_trace = pytest.mark.skipif(not os.path.exists(TRACE), reason=f"Mooncake trace not found at {TRACE}")


def test_expand_keeps_the_tree_and_the_partial_last_block():
    req = Request(0.0, 512 + 40, (7, 9))
    hashes, tokens = expand(req, 16)
    assert len(hashes) == 32 + 3 and tokens[-1] == 8 and sum(tokens) == 552
    assert len(set(hashes)) == len(hashes)
    again, _ = expand(Request(1.0, 1024, (7, 11)), 16)
    assert again[:32] == hashes[:32] and again[32] != hashes[32]
    assert expand(req)[1] == [512, 40]
    with pytest.raises(ValueError):
        expand(req, 100)


def test_full_blocks_drops_the_partial_tail_only():
    reqs = [Request(0.0, 512 + 40, (7, 9)), Request(1.0, 1024, (7, 11)), Request(2.0, 300, (5,)),
            Request(3.0, 4000, (7, 9))]  # the last breaks ceil(len/512): expand keeps its blocks, so do we
    cut = full_blocks(reqs)
    assert [(r.timestamp_s, r.input_length, r.hash_ids) for r in cut] == [
        (0.0, 512, (7,)), (1.0, 1024, (7, 11)), (3.0, 1024, (7, 9))]  # 300 tokens: no full block, left out
    assert expand(cut[0])[0] == expand(reqs[0])[0][:1]  # the partial tail went, the full block stayed
    assert expand(cut[1])[0] == expand(reqs[1])[0] and expand(cut[2])[0] == expand(reqs[3])[0]
    # at 16 tokens per block the partial trace block keeps its two full sub-blocks (40 -> 32 tokens)
    hashes, tokens = expand(full_blocks(reqs[:1], 16)[0], 16)
    assert hashes == expand(reqs[0], 16)[0][:34] and set(tokens) == {16}
    with pytest.raises(ValueError, match="must divide"):
        full_blocks(reqs, 100)


def test_next_use_index_lists_positions_in_order():
    tag = ns_tag("ns")
    future = next_use_index([[b"a", b"b"], [b"a"], [b"a", b"c"]], tag)
    assert future[tag + b"a"] == [0, 1, 2] and future[tag + b"c"] == [2] and future[block_key("ns", b"b")] == [0]


@needs_trace
def test_replay_cli_json_all_policies(capsys):
    rc = cli.main(["replay", TRACE, "--limit", "300", "--policy", "all", "--capacity-blocks", "300",
                   "--check-every", "50", "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["orphans"] == 0 and doc["check_problems"] == 0
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == set(ALL_POLICIES)
    for r in runs.values():
        for key in ("hit_ratio", "token_hit_ratio", "orphans", "prefill_tokens_saved", "hits_by_tier",
                    "evictions", "demotions", "capacity_blocks"):
            assert key in r, key
        assert 0.0 <= r["hit_ratio"] <= 1.0 and 0.0 <= r["token_hit_ratio"] <= 1.0
        assert r["orphans"] == 0 and r["requests"] == 300
        assert r["evictions"] > 0  # the excerpt overflows 300 blocks, so policies did choose
        assert sum(r["hits_by_tier"].values()) == r["hit_blocks"]
    for name, r in runs.items():
        assert runs["belady"]["hit_ratio"] >= r["hit_ratio"], name


@needs_trace
def test_replay_single_run_has_top_level_keys_and_random_attention(capsys):
    rc = cli.main(["replay", TRACE, "--limit", "300", "--policy", "attention", "--capacity-blocks", "200",
                   "--attention", "random", "--block-tokens", "128", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["policy"] == "attention" and doc["orphans"] == 0 and 0 <= doc["hit_ratio"] <= 1
    assert doc["blocks"] > 4 * 300  # 512-token ids became 128-token blocks


@needs_trace
def test_replay_subprocess_text_output():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.cli", "replay", TRACE, "--limit", "100", "--policy", "lru,belady",
         "--capacity-blocks", "100"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if "hit=" in l]
    assert len(lines) == 2 and all("orphans=0" in l for l in lines)


def test_replay_rejects_unknown_policy(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n')
    assert cli.main(["replay", str(trace), "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_replay_tiny_trace_counts_hits(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1500, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 1600, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 2000, "input_length": 1100, "hash_ids": [1, 2, 4]},
    ]
    trace.write_text("".join(json.dumps(l) + "\n" for l in lines))
    for policy in ALL_POLICIES:
        assert cli.main(["replay", str(trace), "--policy", policy, "--capacity-blocks", "100", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["hit_blocks"] == 5 and doc["blocks"] == 10, policy  # 2 + 3 hits, nothing evicted
        assert doc["hit_tokens"] == 2 * 512 + 1100 and doc["orphans"] == 0
    assert read_trace(str(trace), limit=2)[1].hash_ids == (1, 2, 4, 5)
    # full blocks only: [1, 2] then [1, 2, 4] (3 and 5 are partial tails), then [1, 2]: 2 + 2 hits of 7
    assert cli.main(["replay", str(trace), "--policy", "lru", "--capacity-blocks", "100", "--json",
                     "--full-blocks"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["hit_blocks"], doc["blocks"], doc["requests"]) == (4, 7, 3)


@needs_trace
def test_random_attention_does_not_hurt_the_attention_policy(capsys):
    """Noise as the attention signal: the gate keeps the policy at its no-attention hit ratio."""
    ratios = {}
    for mode in ("none", "random"):
        assert cli.main(["replay", TRACE, "--limit", "300", "--policy", "attention", "--capacity-blocks", "400",
                         "--attention", mode, "--block-tokens", "256", "--json"]) == 0
        ratios[mode] = json.loads(capsys.readouterr().out)["hit_ratio"]
    assert ratios["random"] >= ratios["none"] - 0.002, ratios


@needs_trace
def test_a_predictive_attention_signal_helps_the_attention_policy(capsys):
    """The oracle estimate (1 = the trace uses the block again) opens the gate and raises the hit ratio."""
    ratios = {}
    for mode in ("none", "oracle"):
        assert cli.main(["replay", TRACE, "--limit", "1500", "--policy", "attention", "--capacity-blocks", "1000",
                         "--attention", mode, "--json"]) == 0
        ratios[mode] = json.loads(capsys.readouterr().out)["hit_ratio"]
    assert ratios["oracle"] > ratios["none"] + 0.005, ratios


@needs_trace
def test_replay_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the 'plot' extra)")
    out = tmp_path / "hit.png"
    assert cli.main(["replay", TRACE, "--limit", "100", "--policy", "lru,attention", "--capacity-blocks", "50,100",
                     "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_trace
def test_replay_with_the_real_disk_tier_keeps_the_tree_and_serves_disk_hits(tmp_path, capsys):
    """Host 150 + disk 450 blocks over 1,500 requests: demotions, promotions and disk
    evictions all happen, with store.check() every 100 requests; the disk tier catches
    hits the host tier alone would miss."""
    args = ["replay", TRACE, "--limit", "1500", "--policy", "attention", "--json", "--check-every", "100"]
    assert cli.main([*args, "--capacity-blocks", "150", "--disk-blocks", "450", "--disk-path", str(tmp_path)]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["orphans"] == 0 and two["check_problems"] == 0
    assert two["demotions"] > 0 and two["hits_by_tier"].get("disk", 0) > 0, two["hits_by_tier"]
    assert sum(two["hits_by_tier"].values()) >= two["hit_blocks"] > 0  # a hit whose promotion fails is not served
    assert list(tmp_path.iterdir()) == [], "the temporary disk folder is removed"
    assert cli.main([*args, "--capacity-blocks", "150"]) == 0
    host_only = json.loads(capsys.readouterr().out)
    assert two["hit_ratio"] > host_only["hit_ratio"]


def test_replay_rejects_a_negative_disk_size(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "hash_ids": [1]}) + "\n")
    assert cli.main(["replay", str(trace), "--disk-blocks", "-1"]) == 2
    assert "--disk-blocks" in capsys.readouterr().err


@needs_trace
def test_replay_disk_ratio_runs_exact_and_compressed_disks_of_equal_bytes(tmp_path, capsys):
    """`--disk-ratio R`: each run twice, the disk holding N then floor(N x R) blocks; more blocks in the
    same bytes never lose hits here, and both runs keep the tree (check() every 100 requests)."""
    args = ["replay", TRACE, "--limit", "1500", "--policy", "lru", "--json", "--check-every", "100",
            "--capacity-blocks", "100", "--disk-blocks", "80", "--disk-ratio", "3", "--disk-path", str(tmp_path)]
    assert cli.main(args) == 0
    exact, lossy = json.loads(capsys.readouterr().out)["runs"]
    assert (exact["disk_blocks"], exact["disk_ratio"]) == (80, 1.0)
    assert (lossy["disk_blocks"], lossy["disk_ratio"]) == (240, 3.0)
    assert lossy["hits_by_tier"].get("disk", 0) > exact["hits_by_tier"].get("disk", 0)
    assert lossy["hit_ratio"] >= exact["hit_ratio"]
    assert exact["check_problems"] == lossy["check_problems"] == 0


@pytest.mark.parametrize("extra", [["--disk-ratio", "2"], ["--disk-blocks", "10", "--disk-ratio", "0.5"]])
def test_replay_rejects_a_disk_ratio_without_a_disk_or_below_one(tmp_path, capsys, extra):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "hash_ids": [1]}) + "\n")
    assert cli.main(["replay", str(trace), *extra]) == 2
    assert "--disk-ratio" in capsys.readouterr().err
