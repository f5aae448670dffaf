"""The chaos run's oracles: pure functions over what the run recorded; each returns a verdict dict with
`ok` and the numbers behind it. No vLLM, no daemon here (tools/bench/chaos_run.py gathers the inputs).

- `outputs`: every request an engine finished has the baseline's greedy token ids
  (the baseline: that request served alone, tools/bench/chaos_run.py says how), and
  a `prompt_logprobs` request has one logprob per prompt token after the first,
  each within LOGPROB_ATOL of the baseline's; none is lost or failed by the engine.
- `stored_bytes`: sampled stored blocks hold the KV a fresh engine computes for their
  prefix: max |stored - fresh| / max |fresh| <= BYTES_RTOL; the same measure against
  another block's KV (the wrong-block scale) is reported beside it.
- `daemon_state`: check() clean and no pins, reservations, announcements or waits,
  after the run with the engines still connected and after each restart.
- `rss`: over the last two thirds of the run, each process's anonymous RSS grew by at most
  RSS_GROWTH_MIB (an engine; DAEMON_RSS_GROWTH_MIB the daemon), growth measured as the
  median of the window's second half minus that of its first half; the least-squares
  slope (MiB/min) is reported beside it. An engine's anonymous RSS moves in steps of
  ~18 MiB as the allocator meets a larger batch shape (its warm-up burst reaches most
  of them first) and by tens of MiB either way as it returns memory.
- `reuse`: every engine loaded blocks from the store (the connector's worker count of
  blocks copied in; vLLM's external hit tokens, reported beside it, leave out the hits of
  preempted requests readmitted), and after each restart it loaded again within
  RESUME_BOUND_S in every engine that looked up MIN_LOOKUPS prompts in that time.
"""

from __future__ import annotations

import numpy as np

LOGPROB_ATOL = 2e-3
BYTES_RTOL = 1e-3
RSS_GROWTH_MIB = 96.0
DAEMON_RSS_GROWTH_MIB = 16.0
RESUME_BOUND_S = 30.0
MIN_LOOKUPS = 3  # an engine that looked up this many prompts after a restart must have had a hit by then


def outputs(requests: dict, results: dict, baseline: dict) -> dict:
    """`requests`: rid -> ChaosRequest dict; `results`: rid -> the chaos engine's result; `baseline`:
    rid -> the baseline's result (finished) for the same request."""
    mismatches, lost, engine_failed, compared, logprob_err = [], [], [], 0, 0.0
    for rid, req in requests.items():
        got = results.get(rid)
        if got is None:
            lost.append(rid)
            continue
        if got["outcome"] == "aborted":
            continue
        if got["outcome"] != "finished":
            engine_failed.append(rid)
            continue
        want = baseline.get(rid)
        if want is None:
            engine_failed.append(rid)  # no baseline: never expected
            continue
        compared += 1
        problem = _compare(req, got, want)
        if problem is None and req.get("prompt_logprobs") is not None:
            problem, err = _compare_logprobs(req, got, want)
            logprob_err = max(logprob_err, err)
        if problem is not None:
            mismatches.append({"rid": rid, "engine": req["engine"], "kind": req["kind"], "problem": problem,
                               "num_cached_tokens": got.get("num_cached_tokens")})
    return {"ok": not (mismatches or lost or engine_failed) and compared > 0, "compared": compared,
            "mismatches": len(mismatches), "mismatch_detail": mismatches[:10], "lost": lost,
            "engine_failed": engine_failed, "max_prompt_logprob_err": logprob_err}


def _compare(req: dict, got: dict, want: dict) -> str | None:
    a, b = got["token_ids"], want["token_ids"]
    if a == b:
        return None
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"output differs at token {first} of {len(b)}"


def _compare_logprobs(req: dict, got: dict, want: dict) -> tuple[str | None, float]:
    a, b = got.get("prompt_logprobs") or [], want.get("prompt_logprobs") or []
    n = len(req["ids"])
    values = a[1:]
    if len(a) != n or any(v is None for v in values):
        missing = sum(v is None for v in values) + n - len(a)
        return f"prompt_logprobs: {missing} of {n - 1} missing", 0.0
    err = float(np.max(np.abs(np.asarray(values) - np.asarray(b[1:])))) if n > 1 else 0.0
    if err > LOGPROB_ATOL:
        return f"prompt_logprobs differ by {err:.3g}", err
    return None, err


def block_error(stored: np.ndarray, fresh: np.ndarray) -> float:
    """max |stored - fresh| / max |fresh| over a block's values (float32)."""
    scale = float(np.max(np.abs(fresh))) or 1.0
    return float(np.max(np.abs(stored.astype(np.float64) - fresh.astype(np.float64)))) / scale


def stored_bytes(samples: list[dict]) -> dict:
    """`samples`: per sampled block {"hash", "depth", "stored": array, "fresh": array, "other": array or
    None (a fresh block of another prefix, the wrong-block scale)}."""
    errors = [block_error(s["stored"], s["fresh"]) for s in samples]
    wrong = [block_error(s["stored"], s["other"]) for s in samples if s.get("other") is not None]
    bad = [{"hash": s["hash"].hex()[:16], "depth": s["depth"], "error": e}
           for s, e in zip(samples, errors) if e > BYTES_RTOL]
    return {"ok": bool(samples) and not bad, "sampled": len(samples), "bad": len(bad), "bad_detail": bad[:10],
            "max_error": max(errors, default=0.0), "tolerance": BYTES_RTOL,
            "min_wrong_block_error": min(wrong, default=None)}


def daemon_state(snapshots: list[dict]) -> dict:
    """`snapshots`: {"when", "problems", "stats"} after each restart (engines not yet reconnected when
    stats' sessions is 0) and after the run (engines connected, idle)."""
    failures = []
    for snap in snapshots:
        s = snap["stats"]
        left = {k: s.get(k, 0) for k in ("pinned_blocks", "reserved_blocks", "announced_blocks", "waited_blocks")}
        if snap["problems"]:
            failures.append({"when": snap["when"], "check": snap["problems"][:5]})
        if snap["when"] == "restart" and s.get("sessions", 0):
            continue  # engines reconnected before the snapshot: their pins are live ones
        if any(left.values()):
            failures.append({"when": snap["when"], **left})
    return {"ok": bool(snapshots) and not failures, "snapshots": len(snapshots), "failures": failures}


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (wall time s, bytes) samples, in MiB per minute."""
    if len(samples) < 3:
        return 0.0
    t = np.array([s[0] for s in samples]) / 60.0
    b = np.array([s[1] for s in samples]) / float(1 << 20)
    return float(np.polyfit(t - t[0], b, 1)[0])


def rss(series: dict[str, list[tuple[float, float]]], windows: dict[str, tuple[float, float]]) -> dict:
    """`series`: process name -> (wall time, anonymous RSS bytes) samples; `windows`: process name -> the
    (start, end) of its run (an engine's, after its warm-up; the daemon's: the whole run, or from its last
    restart). Each is judged over the last two thirds of its own window."""
    slopes, growth, over, spans = {}, {}, {}, {}
    for name, points in series.items():
        start, end = windows[name]
        cut = start + (end - start) / 3.0
        pts = [p for p in points if cut <= p[0] <= end]
        spans[name] = end - cut
        slopes[name] = slope_mib_per_min(pts)
        half = len(pts) // 2
        growth[name] = (float(np.median([v for _, v in pts[half:]]) - np.median([v for _, v in pts[:half]]))
                        / float(1 << 20)) if half else 0.0
        limit = DAEMON_RSS_GROWTH_MIB if name == "daemon" else RSS_GROWTH_MIB
        if growth[name] > limit or len(pts) < 3:
            over[name] = growth[name]
    return {"ok": bool(series) and not over, "growth_mib": growth, "slope_mib_per_min": slopes,
            "limit_mib": {"engine": RSS_GROWTH_MIB, "daemon": DAEMON_RSS_GROWTH_MIB}, "window_s": spans,
            "over": over}


def reuse(timelines: dict[str, list[dict]], restarts: list[float]) -> dict:
    """`timelines`: engine name -> its timeline (t, loaded_blocks, lookups, external_hit_tokens);
    `restarts`: wall times at which a restarted daemon was ready."""
    loaded = {name: (tl[-1]["loaded_blocks"] if tl else 0) for name, tl in timelines.items()}
    hits = {name: (tl[-1]["external_hit_tokens"] if tl else 0.0) for name, tl in timelines.items()}
    resume: dict[str, list] = {}
    late, trace = [], {}
    for name, tl in timelines.items():
        resume[name] = []
        for t_ready in restarts:
            before = max((p["loaded_blocks"] for p in tl if p["t"] <= t_ready), default=0)
            after = next((p["t"] for p in tl if p["t"] > t_ready and p["loaded_blocks"] > before), None)
            resume[name].append(None if after is None else after - t_ready)
            if after is not None and after - t_ready <= RESUME_BOUND_S:
                continue
            window = [p["lookups"] for p in tl if t_ready < p["t"] <= t_ready + RESUME_BOUND_S]
            if window and window[-1] - before_lookups(tl, t_ready) >= MIN_LOOKUPS:
                late.append(name)  # it kept looking blocks up, and loaded none
                trace[name] = [(round(p["t"] - t_ready, 1), p["lookups"], p["loaded_blocks"]) for p in tl
                               if t_ready - 2 < p["t"] <= t_ready + RESUME_BOUND_S + 5]
    return {"ok": bool(loaded) and all(n > 0 for n in loaded.values()) and not late, "loaded_blocks": loaded,
            "external_hit_tokens": hits, "resume_s": resume, "bound_s": RESUME_BOUND_S, "late": late,
            "late_trace": trace}


def before_lookups(tl: list[dict], t: float) -> int:
    return max((p.get("lookups", 0) for p in tl if p["t"] <= t), default=0)
