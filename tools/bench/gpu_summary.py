"""Summarize a `tools/bench/gpu_check` run: the device, the CUDA tests' counts, what each executor ran
(vLLM's ops, or the fallback where vLLM is absent), and every GPU goal with the value measured in the same
run and whether it is met. Prints JSON; exits 1 when a test failed or a goal is missed, 2 when a part
produced nothing.

    python tools/bench/gpu_summary.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET


def _load(path: str):
    try:
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if text else None
    except (OSError, ValueError, IndexError):
        return None


def tests(out: str) -> dict | None:
    try:
        root = ET.parse(os.path.join(out, "pytest.xml")).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    skipped = sorted({(s.get("message") or "")[:200] for s in suite.iter("skipped")})
    return {**counts, "failed": failed, "skip_reasons": skipped}


def goals(bench: dict | None, anchor: dict | None) -> list[dict]:
    rows: list[dict] = []
    if bench and "cases" in bench:
        g = bench["goals"]
        for c in bench["cases"]:
            name = f"{c['direction']} {c['tier']} {c['block_tokens']}tok {c['layout']}"
            if "error" in c:  # any executor's failed case is a failure of the run
                rows.append({"goal": f"{name} ({c['executor']}) moves the right bytes", "value": None,
                             "want": "no error", "met": False, "error": c["error"]})
            elif c["executor"] == "dma":  # `op`: vLLM's swap_blocks_batch, or the fallback where vLLM is absent
                rows.append({"goal": f"{name} vs plain copy", "value": c["vs_limit"], "want": f">= {g['vs_limit']}",
                             "met": c["vs_limit"] >= g["vs_limit"], "op": c.get("op")})
        for key, v in bench["step_load"].items():
            rows.append({"goal": f"8k step load {key} x plain copy", "value": v["x_plain_copy"],
                         "want": f"<= {g['step_load_x_plain_copy']}", "met": v["x_plain_copy"] <= g["step_load_x_plain_copy"]})
        inter = bench.get("interference", {})
        for key in [k for k in inter if k.endswith("_error")]:
            rows.append({"goal": f"loads beside the GEMM loop ({key[:-6]})", "value": None, "want": "no error",
                         "met": False, "error": inter[key]})
        if "dma_slowdown" in inter:
            rows.append({"goal": "GEMM slowdown beside loads (dma)", "value": inter["dma_slowdown"],
                         "want": f"<= {g['interference_slowdown']}", "met": inter["dma_slowdown"] <= g["interference_slowdown"]})
    if bench and "expand" in bench:
        g = bench["goals"]
        for key, v in bench["expand"].items():
            if key.endswith("_error"):
                rows.append({"goal": f"encoded blocks ({key[:-6]}) expanded into the gpu tier", "value": None,
                             "want": "no error", "met": False, "error": v})
            elif isinstance(v, dict):
                want = g.get("expand_x_exact_copy", 1.0)
                rows.append({"goal": f"{key} blocks expanded on the GPU x the exact pinned H2D copy (KV bytes/s)",
                             "value": v["x_exact_copy"], "want": f">= {want}", "met": v["x_exact_copy"] >= want})
    if bench and anchor:  # the same machine state: our limits against the anchor's
        for ours, theirs in (("limit_gbps", "h2d_limit_gbps"),):
            arena_loads = [c[ours] for c in bench.get("cases", [])
                           if c["tier"] == "arena" and c["direction"] == "load" and ours in c]
            if arena_loads and theirs in anchor:
                rows.append({"goal": "bench_gpu's pinned H2D limit vs the anchor's (same run)",
                             "value": max(arena_loads) / anchor[theirs], "want": "~1", "met": None})
    return rows


def main(argv=None) -> int:
    out = (argv or sys.argv[1:])[0]
    bench = _load(os.path.join(out, "bench_gpu.json"))
    anchor = _load(os.path.join(out, "anchor.json"))
    t = tests(out)
    rows = goals(bench, anchor)
    summary = {"device": (bench or {}).get("device") or (anchor or {}).get("device"), "tests": t, "goals": rows,
               "executors": (bench or {}).get("executors"), "bench_skipped": (bench or {}).get("skipped"),
               "anchor": anchor}
    print(json.dumps(summary, indent=1))
    if t is None or bench is None or "cases" not in bench:
        return 2
    failed = t["failures"] or t["errors"] or any(r["met"] is False for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
