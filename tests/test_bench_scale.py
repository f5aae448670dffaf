"""tools/bench/bench_scale.py runs small on a CPU: a daemon filled with 10^4 blocks over a disk tier reports
every figure the scale goals name, restarts, keeps its blocks, and judges each goal."""

from __future__ import annotations

import json

from kvstore.tools.bench.bench_scale import main


def test_a_small_run_reports_each_figure_and_no_full_collection(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_BENCH_DIR", str(tmp_path))
    assert main(["--json", "--max-blocks", "10000", "--host-blocks", "2048", "--chain", "64", "--lookups", "50",
                 "--rounds", "1", "--churn", "0.5", "--no-mooncake"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(out[-1])
    assert [r["blocks"] for r in rows] == [10_000]
    r = rows[0]
    assert r["indexed_blocks"] == 10_000 and r["host_blocks"] == 2048 and r["churn_blocks"] == 5_000
    for key in ("rss_bytes_per_block", "lookup_p50_ms", "lookup_p99_ms", "read_us_per_block",
                "write_full_us_per_block", "restart_s", "disk_recovery_s", "rss_bytes_per_block_restarted"):
        assert r[key] > 0, key
    assert r["lookup_p99_ms"] >= r["lookup_p50_ms"]
    assert r["kept"] == r["sampled"] > 0  # every sampled block found again after the restart
    assert r["first_lookup_hits"] == r["first_lookup_sampled"] > 0  # the first chain looked up: a hit at once
    assert r["kept_at_ready"] == r["kept"] and r["kept_at_ready_s"] >= r["first_lookup_ms"] / 1e3
    assert r["rss_bytes_per_block_recovering"] > 0 and 0 < r["all_found_s"] <= r["recovered_s"]
    assert "recovering_lookups" in r  # (a second client looked up blocks while the restarted daemon recovered)
    assert r["write_full_disk"]["writes"] > 0  # the full-tier writes went through the disk tier
    assert r["gc_full_collections"] == 0 and r["gc_longest_pause_ms"] > 0  # young collections ran, no full one
    assert r["churn_lookups"] > 0  # a second client looked up blocks while the churn wrote
    for key in ("loop_stalls", "recovering_loop_stalls"):  # the daemons' event-loop stalls (server/stalls.py)
        assert set(r[key]) == {"stalls", "total_s", "longest_ms", "recent"}, key
    # The recovered store's memory a block, part by part: its disk blocks' entries, keys and locations.
    assert r["memory_parts_blocks"] > 0 and 100 < r["memory_parts"]["blocks at rest"] < 400  # (kvstore/resting.py)
    assert r["memory_parts"]["disk locations"] > 0 and r["memory_parts"]["total"] > 0
    verdicts = out[out.index("goals:") + 1 : -1]  # a line per goal, before the JSON
    assert len(verdicts) == 6 and all(v.startswith(("  [met]", "  [NOT met]", "  [not run]")) for v in verdicts)
    assert sum(v.startswith("  [not run]") for v in verdicts) == 2  # one size, no mooncake_master: not judged
