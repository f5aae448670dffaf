"""tools/bench/bench_control_plane.py runs small on a CPU: every arm moves every block through daemons in
their own processes, and the goals table names what was measured."""

from __future__ import annotations

import json

import pytest

from kvstore.tools.bench import bench_control_plane
from kvstore.tools.bench.bench_control_plane import GOALS, chains, main, profile_top


def test_chains_are_distinct_and_linked():
    blocks = chains(100, 32, seed=3)
    assert len(blocks) == 100 and len({h for h, _ in blocks}) == 100
    assert [p is None for _, p in blocks].count(True) == 4  # chains of 32, 32, 32, 4
    assert all(p == blocks[i - 1][0] for i, (_, p) in enumerate(blocks) if p is not None)
    assert chains(100, 32, seed=4)[0][0] != blocks[0][0]


def test_a_small_run_measures_every_arm_and_reports_the_goals(capsys):
    # (exits non-zero, through SystemExit, if a put stores fewer blocks or a get misses or returns other bytes)
    assert main(["--json", "--blocks", "256", "--rounds", "1", "--batch", "64", "8", "--chain", "32",
                 "--lookup-iters", "20", "--bandwidth-mib", "8", "--bandwidth-rounds", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    for batch in ("64", "8"):
        for policy in ("attention", "lru"):
            row = result["batches"][batch][policy]
            assert all(row[f"{arm}_us"] > 0 for arm in ("write_free", "lookup", "get", "write_full", "read"))
            assert row["full_tier_evictions"] >= 256  # every timed block of the full tier evicted one
    lookup = result["lookup"]
    assert "skipped" in lookup or (lookup["kvstore"]["per_s"] > 0 and lookup["mooncake_master"]["per_s"] > 0)
    assert {r["block_bytes"] for r in result["bandwidth"]["free"]} == {256 << 10, 2 << 20}
    goals = {g["goal"]: g for g in result["goals"]}
    assert any(g.startswith(f"read <= {GOALS['read_us'] * 2:g} us/block, batch 8") for g in goals)
    assert all(isinstance(g["met"], bool) for g in goals.values())
    for goal, g in goals.items():  # a goal the default policy misses shows LRU's figure from the same run
        if "default policy" in goal and not g["met"]:
            assert "LRU" in g["measured"] and "bookkeeping" in g["measured"]


def test_profile_top_reads_py_spy_raw_stacks(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text("main (a.py:1);serve (b.py:2);work (c.py:3) 30\n"
                   "main (a.py:1);serve (b.py:2) 10\n"
                   "Thread._bootstrap (threading.py:1);hash (d.py:4) 50\n")
    top = profile_top(str(raw))
    assert top[0] == (75.0, 75.0, "work (c.py:3)")  # the loop thread's samples only
    assert (25.0, 100.0, "serve (b.py:2)") in top


def test_profile_without_py_spy_is_a_usage_error_before_any_daemon_starts(monkeypatch, capsys):
    monkeypatch.setattr(bench_control_plane, "py_spy", lambda: None)
    monkeypatch.setattr(bench_control_plane, "bench_batch", lambda *a, **k: pytest.fail("a daemon was started"))
    with pytest.raises(SystemExit) as exit_:
        bench_control_plane.main(["--profile", "/nonexistent-dir/prof"])
    assert exit_.value.code == 2 and "py-spy" in capsys.readouterr().err


def test_the_store_core_alone_is_measured_with_and_without_the_kept_arenas_index_and_leaves_nothing():
    import glob

    import tempfile

    left = ["/dev/shm/kvstore-bench-cp-*", f"{tempfile.gettempdir()}/kvstore-bench-cp-disk-*"]  # arenas, disk folders
    before = {pattern: set(glob.glob(pattern)) for pattern in left}
    r = bench_control_plane.in_process(["lru"], n=256, batch=64, chain=64, rounds=1)
    assert set(r) == {f"lru_{arena}_{op}_us" for arena in ("plain", "kept")
                      for op in ("write_full", "write_full_disk", "read")}
    assert all(v > 0 for v in r.values())
    assert {pattern: set(glob.glob(pattern)) for pattern in left} == before


def test_instructions_without_the_in_process_arms_is_a_usage_error_before_any_daemon_starts(monkeypatch, capsys):
    monkeypatch.setattr(bench_control_plane, "bench_batch", lambda *a, **k: pytest.fail("a daemon was started"))
    with pytest.raises(SystemExit) as exit_:
        bench_control_plane.main(["--instructions"])
    assert exit_.value.code == 2 and "--in-process" in capsys.readouterr().err


def test_instructions_per_block_are_the_difference_of_two_counted_store_runs(monkeypatch):
    from kvstore.tools.bench import callgrind

    seen = []

    def count(commands, jobs=2):  # a made-up cost: 1,000 per run, 7 (kept: 9) per block written
        out = []
        for argv in commands:
            assert argv[2] == "--store-run"
            policy, kept, op, rounds, n = argv[3], argv[4] == "1", argv[5], int(argv[6]), int(argv[7])
            seen.append((policy, kept, op, rounds))
            per_block = (9 if kept else 7) * (1 if op == "read" else 2)
            out.append(1000 + per_block * n * (1 + rounds))  # the fill and the rounds
        return out

    monkeypatch.setattr(callgrind, "instructions_many", count)
    r = bench_control_plane.in_process_instructions(["lru"], n=256, batch=64, chain=64)
    assert r == {"lru_plain_write_full_instructions": 14.0, "lru_kept_write_full_instructions": 18.0,
                 "lru_plain_write_full_disk_instructions": 14.0, "lru_kept_write_full_disk_instructions": 18.0,
                 "lru_plain_read_instructions": 7.0, "lru_kept_read_instructions": 9.0}
    assert sorted(seen) == sorted((p, kept, op, rounds) for p in ["lru"] for kept in (False, True)
                                  for op in ("write_full", "write_full_disk", "read") for rounds in (1, 3))


def test_a_counted_store_run_writes_through_the_store_and_leaves_nothing():
    import glob
    import subprocess
    import sys

    before = set(glob.glob("/dev/shm/kvstore-bench-cp-*"))
    # its own process, as under callgrind: it turns the index's checksums off and tunes the collector
    for op in ("write_full", "write_full_disk", "read"):
        subprocess.run([sys.executable, bench_control_plane.__file__, "--store-run", "attention", "1", op, "1", "256",
                        "64", "64"], check=True, timeout=120)
    assert set(glob.glob("/dev/shm/kvstore-bench-cp-*")) == before
