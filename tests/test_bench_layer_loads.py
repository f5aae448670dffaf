"""tools/bench/bench_layer_loads.py drives the connector's worker side against a real daemon and checks
what it loaded (it exits when a block fails or holds other bytes than engine A stored)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
pytest.importorskip("torch")

from kvstore.tools.bench import bench_layer_loads  # noqa: E402


def test_a_small_run_loads_every_block_in_both_arms(daemon_factory):
    d = daemon_factory(host_bytes="64MiB", page_bytes="256KiB", admin=False)
    r = bench_layer_loads.bench(d.socket_path, 3 * 128 + 5, [0.2], repeats=2)
    assert r["blocks"] == 3 and r["block_bytes"] == 30 * 3 * 128 * 2 * 64 * 2
    (row,) = r["runs"]
    for arm in ("whole_step", "layer_wise"):
        assert len(row[f"all_{arm}_step_ms"]) == 2 and row[f"{arm}_step_ms"] > 0
    # The stand-in forward was calibrated to 30 layers of 0.2 ms and ran them. Calibration takes the best of
    # five probes, and a later run may go faster (a CPU that boosts, warm caches): half the target is the
    # bound, which a forward that skipped its work (no rounds) misses by far.
    assert row["forward_rounds"] >= 1
    assert row["forward_alone_ms"] >= 0.5 * 30 * 0.2
    assert d.alive()


def test_a_block_that_fails_to_load_stops_the_run(daemon_factory, monkeypatch):
    from kvstore.connectors.cpu_copy import CpuExecutor

    real = CpuExecutor.run

    def broken(self, plan):
        if len(set(plan.layer.tolist())) == 1 and len(plan):  # a layer-wise load's plan (saves span layers)
            raise RuntimeError("injected")
        real(self, plan)

    monkeypatch.setattr(CpuExecutor, "run", broken)
    d = daemon_factory(host_bytes="64MiB", page_bytes="256KiB", admin=False)
    with pytest.raises(SystemExit, match="failed to load"):
        bench_layer_loads.bench(d.socket_path, 2 * 128 + 5, [0.1], repeats=1)


@pytest.mark.parametrize("bad", ["", "abc", "1,-2", ","])
def test_bad_per_layer_times_are_refused_before_a_daemon_starts(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_layer_loads.main(["--per-layer-ms", bad])
    assert exit_.value.code == 2 and "--per-layer-ms" in capsys.readouterr().err
