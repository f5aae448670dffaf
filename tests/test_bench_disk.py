"""tools/bench/bench_disk.py's compression arms run end to end on a real disk tier (a smoke run: the figures
themselves are the benchmark's, docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from kvstore.tools.bench import bench_disk


def test_compression_arms_report_exact_and_compressed_kv_bandwidth(tmp_path, capsys):
    assert bench_disk.main(["--dir", str(tmp_path), "--blocks", "4", "--block-bytes", "64KiB", "--repeat", "1",
                            "--compression", "k4v2", "--codec-block-tokens", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    codec = result["codec"]
    assert codec["profile"] == "k4v2" and codec["block_bytes"] == 30 * 3 * 16 * 2 * 64 * 2
    assert codec["codec_ratio"] > 3  # 4 + 2 bits and their scales, headers counted
    for key in ("write_exact_gbps", "write_gbps", "read_exact_gbps", "read_gbps", "codec_write_vs_exact",
                "codec_read_vs_exact"):
        assert codec[key] > 0  # (the figures themselves are the benchmark's: a smoke run's are noise)


def test_small_blocks_on_pages_of_their_size(tmp_path, capsys):
    """`--page-bytes` sets the disk tier's page: 4 KiB blocks on 4 KiB pages sit on adjacent pages (the
    default page of 64 KiB would leave 60 KiB between two of them); a page that O_DIRECT cannot use is
    refused."""
    assert bench_disk.main(["--dir", str(tmp_path), "--blocks", "64", "--block-bytes", "4KiB", "--page-bytes", "4KiB",
                            "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["page_bytes"] == 4096 and result["block_bytes"] == 4096
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    with pytest.raises(SystemExit):
        bench_disk.main(["--dir", str(tmp_path), "--page-bytes", "1000"])
