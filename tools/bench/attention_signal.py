"""How well does a save-time attention signal predict the attention a block gets from LATER prompts?

A small study on a real model (SmolLM2-135M, built by tools/harness/build_models.py into
.cache/models/smollm2-135m). For each shared document (offline text: licenses
in /usr/share/common-licenses) the model prefills the document once, as an
engine would before saving its KV. From that save-time state we compute the
candidate per-block signals:

- `keynorm`: `kvstore.connectors.attention_score.block_key_norm_score` over all layers'
  post-RoPE keys (what the connector can compute in `save_kv_layer`);
  `keynorm_late` the same over the second half of the layers only;
  `keynorm_2layers` over layers L/2 and L-1, what connectors/vllm_worker.py samples;
  `keynorm_raw` the plain mean of -||k|| (no per-head rank normalisation);
- `window`: mean attention from the document's own last 16 tokens (SnapKV's
  observation window; needs queries, so a connector cannot get it without an
  engine hook; shown for comparison);
- `position`: earlier blocks first (a sink/prefix prior);
- `random`: seeded uniform scores, metrics averaged over 20 draws (the floor).

Ground truth: several different follow-up questions are run on top of the
cached document (`past_key_values`, eager attention, `output_attentions`),
and a block's truth is the attention mass its tokens receive from the
question tokens, averaged over layers, heads, query tokens and questions.

Metrics: Spearman rank correlation between signal and truth, and recall@k
(the share of the truth's top-k blocks that the signal's top-k contains,
k = 20% of blocks), each with and without block 0 (the attention sink, which
dominates raw mass). Everything runs on CPU in about a minute.

    PYTHONPATH=. .venv/bin/python -m kvstore.tools.bench.attention_signal [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np

from kvstore.connectors.attention_score import block_key_norm_score

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), ".cache", "models",
                             "smollm2-135m")
DOCUMENTS = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/MPL-2.0",
             "/usr/share/common-licenses/Artistic")
QUESTIONS = (
    "\n\nQuestion: Can I use this work in a commercial product? Answer:",
    "\n\nQuestion: What must I do if I distribute a modified version? Answer:",
    "\n\nQuestion: Does the licensor give any warranty or accept liability? Answer:",
    "\n\nQuestion: What do the definitions at the start say a 'Contribution' is? Answer:",
    "\n\nQuestion: Which parts talk about patents or trademarks? Answer:",
    "\n\nQuestion: How are copyright notices to be kept in copies? Answer:",
)
WINDOW = 16
RANDOM_DRAWS = 20


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denom) if denom else 0.0


def recall_at_k(signal: np.ndarray, truth: np.ndarray, frac: float = 0.2) -> float:
    k = max(1, int(round(frac * len(truth))))
    top_truth = set(np.argsort(-truth)[:k])
    top_signal = set(np.argsort(-signal)[:k])
    return len(top_truth & top_signal) / k


def block_sums(per_token: np.ndarray, block_tokens: int) -> np.ndarray:
    n = len(per_token) // block_tokens
    return per_token[: n * block_tokens].reshape(n, block_tokens).sum(axis=1)


def cached_keys(cache) -> np.ndarray:
    """Post-RoPE keys of every layer as [layers, tokens, kv_heads, head_dim]."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        ks = [layer.keys for layer in layers]
    else:  # older transformers
        ks = list(cache.key_cache)
    return np.stack([k[0].transpose(0, 1).float().numpy() for k in ks])


def attention_mass(attentions, doc_len: int) -> np.ndarray:
    """Mean over layers, heads and query tokens of the attention each document token receives."""
    total = None
    for layer in attentions:  # [1, heads, q, kv]
        a = layer[0, :, :, :doc_len].float().mean(dim=(0, 1)).numpy()
        total = a if total is None else total + a
    return total / len(attentions)


def _metrics(sig: np.ndarray, truth: np.ndarray, truths: list) -> dict:
    per_q = [spearman(sig[1:], t[1:]) for t in truths]
    return {
        "spearman": spearman(sig, truth),
        "spearman_no_sink": spearman(sig[1:], truth[1:]),
        "spearman_no_sink_per_question": float(np.mean(per_q)),
        "recall20": recall_at_k(sig, truth),
        "recall20_no_sink": recall_at_k(sig[1:], truth[1:]),
    }


def study_document(model, tokenizer, text: str, block_tokens: int, max_tokens: int, seed: int) -> dict:
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    doc_len = ids.shape[1] - ids.shape[1] % block_tokens
    ids = ids[:, :doc_len]
    num_blocks = doc_len // block_tokens
    with torch.no_grad():
        head = model(ids[:, :-WINDOW], use_cache=True)
        tail = model(ids[:, -WINDOW:], past_key_values=head.past_key_values, use_cache=True, output_attentions=True)
        cache = tail.past_key_values
        keys = cached_keys(cache)[:, :doc_len]
        half = keys.shape[0] // 2
        raw = -np.linalg.norm(keys, axis=-1).mean(axis=(0, 2))  # [tokens], no per-head rank normalisation
        signals = {
            "keynorm": block_key_norm_score(keys, block_tokens),
            "keynorm_late": block_key_norm_score(keys[half:], block_tokens),
            "keynorm_2layers": block_key_norm_score(keys[[half, keys.shape[0] - 1]], block_tokens),
            "keynorm_raw": raw.reshape(num_blocks, block_tokens).mean(axis=1),
            "window": block_sums(attention_mass(tail.attentions, doc_len), block_tokens),
            "position": -np.arange(num_blocks, dtype=float),
        }
        rng = np.random.default_rng(seed)
        randoms = [rng.random(num_blocks) for _ in range(RANDOM_DRAWS)]
        truths = []
        for q in QUESTIONS:
            q_ids = tokenizer(q, return_tensors="pt", add_special_tokens=False).input_ids
            out = model(q_ids, past_key_values=copy.deepcopy(cache), use_cache=True, output_attentions=True)
            truths.append(block_sums(attention_mass(out.attentions, doc_len), block_tokens))
    truth = np.mean(truths, axis=0)
    result: dict = {"tokens": int(doc_len), "blocks": int(num_blocks), "sink_share": float(truth[0] / truth.sum())}
    for name, sig in signals.items():
        result[name] = _metrics(sig, truth, truths)
    draws = [_metrics(r, truth, truths) for r in randoms]
    result["random"] = {m: float(np.mean([d[m] for d in draws])) for m in draws[0]}
    # How much do different questions agree with each other (a ceiling for any query-agnostic signal)?
    pairs = [spearman(truths[i][1:], truths[j][1:]) for i in range(len(truths)) for j in range(i + 1, len(truths))]
    result["question_agreement_no_sink"] = float(np.mean(pairs))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.tools.bench.attention_signal", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF folder of a causal LM (default: SmolLM2-135M)")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1024, help="document prefix length in tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        print(f"attention_signal: no model at {args.model}; run tools/harness/build_models.py first", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    docs = {}
    for path in DOCUMENTS:
        with open(path, encoding="utf-8") as f:
            docs[os.path.basename(path)] = study_document(model, tokenizer, f.read(), args.block_tokens,
                                                          args.max_tokens, args.seed)
    signals = ("keynorm", "keynorm_late", "keynorm_2layers", "keynorm_raw", "window", "position", "random")
    metrics = ("spearman", "spearman_no_sink", "spearman_no_sink_per_question", "recall20", "recall20_no_sink")
    mean = {s: {m: float(np.mean([d[s][m] for d in docs.values()])) for m in metrics} for s in signals}
    report = {"model": os.path.basename(args.model), "block_tokens": args.block_tokens, "questions": len(QUESTIONS),
              "documents": docs, "mean": mean}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"model {report['model']}, {args.block_tokens}-token blocks, {len(QUESTIONS)} follow-up questions per doc")
    for name, d in docs.items():
        print(f"  {name}: {d['tokens']} tokens, {d['blocks']} blocks, sink share {d['sink_share']:.2f}, "
              f"question-question agreement (Spearman, no sink) {d['question_agreement_no_sink']:.2f}")
    print(f"{'signal':>15} " + " ".join(f"{m:>30}" for m in metrics))
    for s in signals:
        print(f"{s:>15} " + " ".join(f"{mean[s][m]:>30.3f}" for m in metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
