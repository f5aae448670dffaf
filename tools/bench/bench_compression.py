"""Quality of lossy stored blocks on a real model: the codec's settings against the exact cache and
against the usual baselines at the same bits, in one run.

SmolLM2-135M (built by tools/harness/build_models.py into .cache/models/smollm2-135m)
prefills real text (licenses in /usr/share/common-licenses), the prefix's blocks are
round-tripped through each setting, and the next tokens are teacher-forced
(tools/bench/kv_quality.py says how each measure is taken). Settings:

- `perhead-<bits>`: per-(layer, head, K/V) bits from a profile calibrated in this run on
  another document (kvstore/codec_profile.py), rotated, per-token scales;
- `rot-k<K>v<V>`: the same codec with the same bits everywhere (TurboQuant-style: Hadamard
  rotation, then uniform levels): the per-head setting's `uniform_same_bits_kl` is the KL of
  this one at the same mean bits;
- `tok-k<K>v<V>`: per-token, no rotation (does the rotation pay?);
- `kivi-k<K>v<V>`: KIVI-style, keys per channel and values per token, no rotation;
- `fp8-e4m3`: a plain cast with one scale per (block, layer, head, K/V).

`ratio` is the block's bfloat16 size over its stored size with every byte of metadata
(header, bits table, scales), whatever dtype the model runs in (float32 here).

    PYTHONPATH=. .venv/bin/python -m kvstore.tools.bench.bench_compression [--quick] [--json]
        [--write-profile PATH]

With --json the last line is a JSON list, one object per setting: codec, mean_bits, ratio,
nll_increase_rel, kl, top1, greedy_match, passkey_acc, passkey_acc_exact, and for per-head
settings uniform_same_bits_kl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kvstore.codec import Budget
from kvstore.codec_profile import Profile, allocate_bits
from kvstore.tools.bench import kv_quality as q

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, ".cache", "models", "smollm2-135m")
LICENSES = "/usr/share/common-licenses"
EVAL_DOCS = ("GPL-3", "MPL-2.0", "Apache-2.0")
CALIBRATION_DOC = "GFDL-1.3"
WIDTHS = (2, 3, 4, 5, 6, 8)


def plan(quick: bool) -> list[tuple[str, float]]:
    """(setting, mean bits) to run; per-head settings are compared with rot-* at the same bits."""
    if quick:
        return [("perhead", 3.0), ("rot", 3.0), ("tok", 3.0), ("kivi", 3.0), ("fp8", 8.0)]
    return [("perhead", 2.5), ("perhead", 3.0), ("perhead", 4.0), ("rot", 2.5), ("rot", 3.0), ("rot", 4.0),
            ("rot", 2.0), ("tok", 3.0), ("tok", 4.0), ("kivi", 2.0), ("kivi", 3.0), ("kivi", 4.0), ("fp8", 8.0)]


def uniform_bits(mean: float) -> tuple[int, int]:
    """K and V bits of a uniform setting with this mean (keys take the odd bit)."""
    total = int(round(2 * mean))
    return (total + 1) // 2, total // 2


def build_settings(m: q.Model, wanted, dist: np.ndarray | None, rotate: bool) -> list[q.Setting]:
    layout = m.layout("float32")
    out = []
    for kind, mean in wanted:
        if kind == "fp8":
            out.append(q.fp8_setting(m))
            continue
        if kind == "perhead":
            assert dist is not None
            budget = Budget(allocate_bits(dist, WIDTHS, mean), rotate=rotate)
            out.append(q.codec_setting(f"perhead-{mean:g}", m, budget))
            continue
        kb, vb = uniform_bits(mean)
        rot, mode = {"rot": (True, "token"), "tok": (False, "token"), "kivi": (False, "channel")}[kind]
        out.append(q.codec_setting(f"{kind}-k{kb}v{vb}", m, Budget.uniform(layout, kb, vb, rotate=rot, key_mode=mode)))
    return out


def read_doc(name: str) -> str:
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        return f.read()


def run(args) -> list[dict]:
    t0 = time.monotonic()
    m = q.load_model(args.model, args.threads)
    wanted = plan(args.quick)
    docs = EVAL_DOCS[:1] if args.quick else EVAL_DOCS
    prefix = args.prefix_tokens // m.block_tokens * m.block_tokens
    dist = None
    if any(kind == "perhead" for kind, _ in wanted) or args.write_profile:
        ids = m.tokenizer(read_doc(CALIBRATION_DOC), return_tensors="pt").input_ids
        dist = q.calibrate(m, ids, args.calibration_tokens, 64, WIDTHS, measure_bits=3)
        log(f"calibrated on {CALIBRATION_DOC} ({args.calibration_tokens} + 64 tokens) in {time.monotonic() - t0:.0f} s")
    settings = build_settings(m, wanted, dist, rotate=True)
    refs = []
    for name in docs:
        ids = m.tokenizer(read_doc(name), return_tensors="pt").input_ids
        refs.append(q.reference(m, ids, prefix, args.follow_tokens, args.greedy_steps))
    keys = q.passkeys(m, args.passkeys, args.passkey_tokens, seed=0)
    exact_pass = [q.passkey_correct(m, p, p.blocks) for p in keys]
    log(f"exact references ({len(docs)} documents, {len(keys)} passkeys) at {time.monotonic() - t0:.0f} s")
    results = []
    for s in settings:
        per_doc = [q.compare(m, ref, s.apply(ref.prefix_blocks)) for ref in refs]
        nll_ref = float(np.mean([d["nll_ref"] for d in per_doc]))
        nll = float(np.mean([d["nll"] for d in per_doc]))
        row = {"codec": s.codec, "mean_bits": round(s.mean_bits, 3), "ratio": round(s.ratio, 3),
               "nll_increase_rel": (nll - nll_ref) / nll_ref,
               "kl": float(np.mean([d["kl"] for d in per_doc])),
               "top1": float(np.mean([d["top1"] for d in per_doc])),
               "greedy_match": float(np.mean([d["greedy_match"] for d in per_doc])),
               "passkey_acc": float(np.mean([q.passkey_correct(m, p, s.apply(p.blocks)) for p in keys])),
               "passkey_acc_exact": float(np.mean(exact_pass)), "nll_exact": nll_ref}
        results.append(row)
        log(f"{s.codec}: done at {time.monotonic() - t0:.0f} s")
    by_name = {r["codec"]: r for r in results}
    for r in results:
        if r["codec"].startswith("perhead-"):
            kb, vb = uniform_bits(r["mean_bits"])
            same = by_name.get(f"rot-k{kb}v{vb}")
            r["uniform_same_bits_kl"] = same["kl"] if same else None
    if args.write_profile:
        budget = Budget(allocate_bits(dist, WIDTHS, args.profile_bits), rotate=True)
        name = os.path.splitext(os.path.basename(args.write_profile))[0]
        Profile(name, budget, model=os.path.basename(args.model),
                calibration={"document": CALIBRATION_DOC, "prefix_tokens": args.calibration_tokens,
                             "follow_tokens": 64, "widths": list(WIDTHS), "mean_bits": args.profile_bits,
                             "measure": "layer KL at 3 bits x attention-weighted output change per head"}
                ).save(args.write_profile)
        log(f"profile written to {args.write_profile}")
    return results


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.tools.bench.bench_compression", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quick", action="store_true", help="one document, four passkeys, the default setting and its baselines")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--follow-tokens", type=int, default=256)
    p.add_argument("--greedy-steps", type=int, default=32)
    p.add_argument("--passkeys", type=int, default=None, help="passkey prompts (default 4 quick, 10 full)")
    p.add_argument("--passkey-tokens", type=int, default=None, help="filler tokens per passkey (default 600 quick, 1200 full)")
    p.add_argument("--calibration-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-profile", default="", help="also write the per-head profile (JSON) here")
    p.add_argument("--profile-bits", type=float, default=3.0, help="mean bits of the written profile")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.passkeys = args.passkeys or (4 if args.quick else 10)
    args.passkey_tokens = args.passkey_tokens or (600 if args.quick else 1200)
    if not os.path.isdir(args.model):
        print(f"bench_compression: no model at {args.model}; run tools/harness/build_models.py first", file=sys.stderr)
        return 2
    results = run(args)
    cols = ("codec", "mean_bits", "ratio", "nll_increase_rel", "kl", "top1", "greedy_match", "passkey_acc",
            "passkey_acc_exact", "uniform_same_bits_kl")
    print(" ".join(f"{c:>14}" for c in cols))
    for r in results:
        print(" ".join(f"{_fmt(r.get(c)):>14}" for c in cols))
    if args.json:
        print(json.dumps(results))
    return 0


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
