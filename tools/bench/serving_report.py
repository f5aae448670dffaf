"""The fleet benchmark's results (tools/bench/bench_serving.py): percentiles, hit ratios, the outputs of
every arm against the first arm's, arm e's windows against the arm without the restart, the markdown
table and the plot."""

from __future__ import annotations

import json
import math


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def hit_ratio(rows: list[dict]) -> float | None:
    p = sum(r["prompt_tokens"] for r in rows if r.get("cached_tokens") is not None)
    c = sum(r["cached_tokens"] for r in rows if r.get("cached_tokens") is not None)
    return round(c / p, 4) if p else None


def compare_outputs(arms: list[dict]) -> dict:
    ref = arms[0]
    ref_ids = {r["idx"]: r for r in ref["per_request"] if r["ok"]}
    out = {}
    for a in arms[1:]:
        mism, first_tok, compared = [], 0, 0
        for r in a["per_request"]:
            x = ref_ids.get(r["idx"])
            if not r["ok"] or not x:
                continue
            compared += 1
            ra, rb = r["token_ids"] or r["text"], x["token_ids"] or x["text"]
            if ra != rb:
                mism.append(r["idx"])
                if (r["token_ids"] or [None])[0] != (x["token_ids"] or [None])[0]:
                    first_tok += 1
        out[a["arm"]] = {"vs": ref["arm"], "compared": compared, "mismatches": len(mism),
                         "first_token_differs": first_tok, "mismatched_idx": mism[:50]}
    return out


def restart_vs_base(arms: list[dict]) -> dict:
    """Arm e's windows against the same requests in the arm without the restart (e_b vs b, e_d vs d): the hit
    ratio grows along a conversation anyway, so a window is only comparable with itself."""
    by = {a["arm"]: a for a in arms}
    out = {}
    for e, base in (("e_b", "b"), ("e_d", "d")):
        if e not in by or base not in by or "kill_s" not in by[e]["events"]:
            continue
        ev = by[e]["events"]
        arrivals = {r["idx"]: r["sent_s"] for r in by[base]["per_request"] if r["ok"]}  # no restart: sent on time
        res = {}
        for name, lo, hi in (("before", 0, ev["kill_s"]), ("down", ev["kill_s"], ev.get("back_s", 1e9)),
                             ("after", ev.get("back_s", 1e9), 1e9)):
            idx = {i for i, t in arrivals.items() if lo <= t < hi}
            rows_e = [r for r in by[e]["per_request"] if r["ok"] and r["idx"] in idx]
            rows_b = [r for r in by[base]["per_request"] if r["ok"] and r["idx"] in idx]
            both = {r["idx"] for r in rows_e} & {r["idx"] for r in rows_b}
            res[name] = {"requests": len(both),
                         "hit_ratio": hit_ratio([r for r in rows_e if r["idx"] in both]),
                         f"hit_ratio_{base}": hit_ratio([r for r in rows_b if r["idx"] in both]),
                         "ttft_p50_ms": round(pct([r["ttft_s"] for r in rows_e if r["idx"] in both], .5) * 1000),
                         f"ttft_p50_ms_{base}": round(pct([r["ttft_s"] for r in rows_b if r["idx"] in both], .5)
                                                      * 1000)}
        out[e] = res
    return out


def table(arms: list[dict]) -> str:
    lines = ["| arm | routing | kvstore | prompt tok | computed | local hits | external hits | reused | "
             "TTFT p50 / p90 / p99 ms | req/s | failed (retried) |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for a in arms:
        lines.append(f"| {a['arm']} | {'affinity' if a['affinity'] else 'round-robin'}"
                     f"{' + restart' if a['restart'] else ''} | {'yes' if a['kvstore'] else 'no'} | "
                     f"{a['prompt_tokens']} | {a['computed_tokens']} | {a['local_hit_tokens']} | "
                     f"{a['external_hit_tokens']} | {a['reused_frac']:.1%} | {a['ttft_p50_ms']:.0f} / "
                     f"{a['ttft_p90_ms']:.0f} / {a['ttft_p99_ms']:.0f} | {a['req_per_s']:.2f} | "
                     f"{a['failed']} ({a['retried']}) |")
    return "\n".join(lines)


def plot(arms: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    restarts = [a for a in arms if a["restart"]]
    fig, axes = plt.subplots(1, 3 if restarts else 2, figsize=(15 if restarts else 10, 4.2))
    names = [a["arm"] for a in arms]
    ax = axes[0]
    ax.bar(names, [a["computed_tokens"] for a in arms], label="computed")
    ax.bar(names, [a["local_hit_tokens"] for a in arms], bottom=[a["computed_tokens"] for a in arms],
           label="local prefix-cache hits")
    ax.bar(names, [a["external_hit_tokens"] for a in arms],
           bottom=[a["computed_tokens"] + a["local_hit_tokens"] for a in arms], label="kvstore hits")
    ax.set_title("prompt tokens by source")
    ax.legend(fontsize=8)
    ax = axes[1]
    w = 0.27
    xs = range(len(arms))
    for k, (q, off) in enumerate((("p50", -w), ("p90", 0), ("p99", w))):
        ax.bar([x + off for x in xs], [a[f"ttft_{q}_ms"] for a in arms], width=w, label=q)
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_title("TTFT (ms, client side)")
    ax.legend(fontsize=8)
    if not restarts:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    ax = axes[2]
    for a in restarts:
        rows = sorted((r for r in a["per_request"] if r["ok"] and r["cached_tokens"] is not None),
                      key=lambda r: r["sent_s"])
        xs2, ys = [], []
        for i in range(len(rows)):
            win = rows[max(0, i - 19): i + 1]
            xs2.append(rows[i]["sent_s"])
            ys.append(sum(r["cached_tokens"] for r in win) / max(sum(r["prompt_tokens"] for r in win), 1))
        ax.plot(xs2, ys, label=a["label"].split(",")[0] if not a["kvstore"] else "affinity + kvstore")
        ev = a["events"]
        if "kill_s" in ev:
            ax.axvline(ev["kill_s"], color="red", ls="--", lw=0.8)
            ax.axvline(ev.get("back_s", ev["kill_s"]), color="green", ls="--", lw=0.8)
    ax.set_title("arm e: hit ratio (20-request window); kill / back")
    ax.set_xlabel("s")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(arms: list[dict], plot_path: str = "") -> None:
    cmp = compare_outputs(arms) if len(arms) > 1 else {}
    print(table(arms))
    for a in arms:
        if "windows" in a:
            print(f"{a['arm']}: windows {json.dumps(a['windows'])}, events {json.dumps(a['events'])}")
    print("restart windows vs the same requests without the restart:", json.dumps(restart_vs_base(arms)))
    print("outputs vs arm", arms[0]["arm"], json.dumps({k: {x: v[x] for x in ("compared", "mismatches",
                                                          "first_token_differs")} for k, v in cmp.items()}))
    if plot_path:
        plot(arms, plot_path)
