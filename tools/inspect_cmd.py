"""`kvstore inspect`: how much of a prompt the store holds, block by block, and in which tier.

The prompt (`--text`/`--file`, tokenized with `--model`'s own tokenizer, or
`--tokens`/`--tokens-file` as a JSON list of ids) is cut and hashed exactly as
the vLLM connector does (`kvstore.keys.hash_blocks` with the namespace's block
size and the request's extra keys: `--lora`, `--cache-salt`), and the daemon
describes each hash (the `describe` op: tier, pins, hits, the policy's value,
last access). The namespace is `--ns`, or the one whose model is
`--model-name` (default: `--model`, the name the connector gives a model by
default); a TP engine's ranks count as one namespace (a block is cached when
every rank holds it, in the slowest rank's tier). When that is ambiguous the
candidates are listed. Bad input, an unknown model or a daemon that is down is
one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from kvstore.client import KVClient
from kvstore.entry import RANK
from kvstore.errors import KVStoreError
from kvstore.keys import ExtraKeys, hash_blocks, lora_key

TEXT_CHARS = 28
MISSING = "missing"


class InspectError(Exception):
    """Bad input or an unknown namespace: one line for the user."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="how much of a prompt is cached, block by block, and where")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the prompt text (tokenized with --model's tokenizer)")
    src.add_argument("--file", help="a file holding the prompt text")
    src.add_argument("--tokens", help="the prompt as a JSON list of token ids")
    src.add_argument("--tokens-file", help="a file holding a JSON list of token ids")
    p.add_argument("--model", help="the model folder: its tokenizer, and (by default) the namespace's model name")
    p.add_argument("--model-name", help="the namespace's model name when it is not --model (the connector's model_id)")
    p.add_argument("--ns", help="the namespace id (see `kvstore stats --json`), instead of a model name")
    p.add_argument("--cache-salt", help="the request's cache_salt")
    p.add_argument("--lora", help="the request's LoRA adapter name")
    p.add_argument("--lora-path", default="", help="the LoRA adapter's path, as the engine was given it")
    p.add_argument("--no-special-tokens", action="store_true", help="tokenize without BOS/EOS (vLLM adds them)")
    p.add_argument("--socket", help="Unix socket path (default: $KVSTORE_SOCKET or the per-user default)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(run=run)


# -- input -----------------------------------------------------------------------------------
class _FastTokenizer:
    """A model's tokenizer.json run by `tokenizers` (the library under transformers' fast tokenizers): the
    same ids, without importing transformers and torch (~10 s of every command line)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def _fast_tokenizer(model: str) -> _FastTokenizer | None:
    """The model's tokenizer.json through `tokenizers`, where nothing in its tokenizer_config.json changes
    what transformers would make of it (BOS/EOS switches, which transformers applies on load, or spaces
    cleaned up in decoded text); else None."""
    path = os.path.join(model, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(os.path.join(model, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError):
        return None
    if any(config.get(k) is not None for k in ("add_bos_token", "add_eos_token")) \
            or config.get("clean_up_tokenization_spaces"):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        return _FastTokenizer(Tokenizer.from_file(path))
    except Exception:  # a file tokenizers cannot read: transformers tries it and says why
        return None


def _tokenizer(model: str):
    fast = _fast_tokenizer(model)
    if fast is not None:
        return fast
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a bad folder
        raise InspectError(f"cannot load the tokenizer of --model {model}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def _parse_tokens(text: str, where: str) -> list[int]:
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InspectError(f"{where} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                           f"expected a list of token ids such as [1, 2, 3]") from None
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                          for t in ids)):
        raise InspectError(f"{where} must be a JSON list of token ids (integers in [0, 2**32))")
    return ids


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InspectError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def prompt_tokens(args: argparse.Namespace) -> tuple[list[int], object | None]:
    """The prompt's token ids, and the tokenizer (None without --model) for showing each block's text."""
    tok = _tokenizer(args.model) if args.model else None
    if args.tokens is not None or args.tokens_file is not None:
        text = args.tokens if args.tokens is not None else _read(args.tokens_file, "--tokens-file")
        return _parse_tokens(text, "--tokens" if args.tokens is not None else f"--tokens-file {args.tokens_file}"), tok
    if tok is None:
        raise InspectError("--text and --file need --model PATH: the prompt is tokenized with the model's tokenizer")
    text = args.text if args.text is not None else _read(args.file, "--file")
    return list(tok(text, add_special_tokens=not args.no_special_tokens)["input_ids"]), tok


# -- namespace ---------------------------------------------------------------------------------
@dataclass
class Target:
    """The namespaces of one engine (one per TP rank, rank 0 first) and what they share."""

    ns_ids: list[str]
    info: dict
    attachments: list[str] = field(default_factory=list)  # a hybrid model's, anchored to ns_ids (rank order)


def _engine(info: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in info.items() if k not in ("tp_rank", "blocks", "bytes", "counters")))


def _describe_ns(ns_id: str, info: dict) -> str:
    blocks = sum(info["blocks"].values())
    tenant = f" tenant {info['tenant']}" if info.get("tenant") else ""
    return (f"{ns_id}  model {info['model']}  {info['dtype']}  {info['block_tokens']} tokens/block  "
            f"tp {info['tp_rank']}/{info['tp_size']}{tenant}  {blocks} blocks")


def _matches(model: str, name: str) -> bool:
    base = model.split("|", 1)[0]
    return name in (model, base) or os.path.basename(base.rstrip("/")) == os.path.basename(name.rstrip("/"))


def resolve(by_ns: dict[str, dict], ns: str | None, name: str | None) -> Target:
    if ns is not None:
        if ns not in by_ns:
            raise InspectError(f"unknown namespace {ns}; the daemon has {len(by_ns)}: {', '.join(by_ns) or 'none'}")
        picked = {ns: by_ns[ns]}
    else:
        if name is None:
            models = sorted({i["model"] for i in by_ns.values()})
            if len(models) != 1:
                raise InspectError(f"say which model (--model or --model-name); the daemon has: "
                                   f"{', '.join(models) or 'no namespaces yet'}")
            name = models[0]
        picked = {k: i for k, i in by_ns.items() if _matches(i["model"], name) and not i.get("anchor")}
        if not picked:
            models = sorted({i["model"] for i in by_ns.values()})
            raise InspectError(f"no namespace for model {name!r}; the daemon's models: {', '.join(models) or 'none'}")
    engines: dict[tuple, list[str]] = {}
    for ns_id, info in picked.items():
        engines.setdefault(_engine(info), []).append(ns_id)
    if len(engines) > 1:
        listing = "\n".join("  " + _describe_ns(k, picked[k]) for k in picked)
        raise InspectError(f"model {name!r} has {len(picked)} namespaces here; pick one with --ns:\n{listing}")
    [ns_ids] = engines.values()
    ns_ids.sort(key=lambda k: picked[k]["tp_rank"])
    by_anchor = {i.get("anchor"): k for k, i in by_ns.items() if i.get("anchor")}
    attachments = [by_anchor[k] for k in ns_ids if k in by_anchor]
    return Target(ns_ids, picked[ns_ids[0]], attachments if len(attachments) == len(ns_ids) else [])


# -- the report ----------------------------------------------------------------------------------
def _block_text(tok, ids: list[int]) -> str:
    if tok is None:
        shown = ", ".join(map(str, ids[:4]))
        return f"[{shown}, ...]" if len(ids) > 4 else f"[{shown}]"
    text = " ".join(tok.decode(ids).split())
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"


def _age(idle_s: float | None) -> str:
    if idle_s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if idle_s >= size:
            return f"{idle_s / size:.1f}{unit} ago"
    return f"{idle_s:.1f}s ago"


def _combine(per_rank: list[dict | None]) -> dict | None:
    """A block of a TP engine: cached when every rank holds it committed; its tier is the slowest rank's."""
    if any(d is None or not d["committed"] for d in per_rank):
        return None
    out = dict(per_rank[0])  # type: ignore[arg-type]
    out["tier"] = max((d["tier"] for d in per_rank), key=lambda t: RANK.get(t, len(RANK)))  # type: ignore[index]
    return out


def build_report(tokens: list[int], target: Target, described: list[list[dict | None]], tok,
                 attached: list[list[dict | None]] | None = None) -> dict:
    """`attached`: per rank, each block's attachment (a hybrid model: what the other KV cache groups need to
    resume after that block); a hit can end only after a block that has one."""
    bt = target.info["block_tokens"]
    blocks, cached, leading = [], Counter(), True
    ends = [_combine(list(a)) is not None for a in zip(*attached)] if attached else None
    for i, per_rank in enumerate(zip(*described)):
        d = _combine(list(per_rank))
        leading = leading and d is not None
        if leading:
            cached[d["tier"]] += 1  # type: ignore[index]
        blocks.append({
            "index": i, "start": i * bt, "end": (i + 1) * bt, "text": _block_text(tok, tokens[i * bt:(i + 1) * bt]),
            "tier": d["tier"] if d else MISSING, "pins": d["pins"] if d else 0, "hits": d["hits"] if d else 0,
            "policy_value": d["policy_value"] if d else None, "idle_s": d["idle_s"] if d else None,
            "copies": d["copies"] if d else [], "codec": d.get("codec") if d else None,
            **({"attachment": ends[i]} if ends is not None else {}),
        })
    num_cached = sum(cached.values())
    limit = min(num_cached, (len(tokens) - 1) // bt) if tokens else 0  # vLLM computes at least the last token
    if ends is not None:  # a hybrid hit ends at the deepest block boundary with an attachment
        limit = max((j for j in range(1, limit + 1) if ends[j - 1]), default=0)
    return {
        "namespace": target.ns_ids[0], "namespaces": target.ns_ids, "model": target.info["model"], "block_tokens": bt,
        "num_tokens": len(tokens), "total_blocks": len(blocks), "cached_blocks": num_cached,
        "cached_tokens": num_cached * bt, "tiers": dict(cached),
        "reusable_tokens": limit * bt, "hybrid": ends is not None,
        "blocks": blocks,
    }


def summary(r: dict) -> str:
    where = ", ".join(f"{n} {t}" for t, n in sorted(r["tiers"].items(), key=lambda x: RANK.get(x[0], 9)))
    head = (f"first {r['cached_blocks']} of {r['total_blocks']} blocks cached" if r["cached_blocks"]
            else f"none of {r['total_blocks']} blocks cached")
    return f"{head}{': ' + where if where else ''}; {r['reusable_tokens']} of {r['num_tokens']} tokens would be reused"


def print_table(r: dict, hashes: list[bytes]) -> None:
    print(f"namespace {r['namespace']}  model {r['model']}  {r['block_tokens']} tokens/block"
          + (f"  ({len(r['namespaces'])} TP ranks)" if len(r["namespaces"]) > 1 else ""))
    print(f"{'#':>4} {'tokens':>11}  {'text':{TEXT_CHARS}}  {'hash':16}  {'tier':7} {'pins':>4} {'hits':>5}  "
          f"{'policy':18} {'last access'}")
    for b, h in zip(r["blocks"], hashes):
        mark = ("+" if b.get("attachment") else " ") if r["hybrid"] else ""  # +: a hit may end after this block
        print(f"{b['index']:>4} {b['start']:>5}-{b['end']:<5}  {b['text']:{TEXT_CHARS}}  {h.hex()[:16]}  "
              f"{b['tier']:7} {b['pins']:>4} {b['hits']:>5}  {b['policy_value'] or '-':18} {_age(b['idle_s'])}{mark}")
    if r["hybrid"]:
        print("(a hybrid model: a hit ends after a block marked +, where its sliding windows or states are stored)")
    print(summary(r))


def run(args: argparse.Namespace) -> int:
    try:
        tokens, tok = prompt_tokens(args)
        with KVClient(args.socket, name="kvstore-inspect") as client:
            by_ns = client.stats()["by_namespace"]
            target = resolve(by_ns, args.ns, args.model_name or args.model)
            extra = ExtraKeys(lora=lora_key(args.lora, args.lora_path) if args.lora else None,
                              cache_salt=args.cache_salt)
            hashes = hash_blocks(tokens, target.info["block_tokens"], extra)
            described = [client.describe(ns_id, hashes) for ns_id in target.ns_ids]
            attached = [client.describe(ns_id, hashes) for ns_id in target.attachments] or None
    except (InspectError, KVStoreError) as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    report = build_report(tokens, target, described, tok, attached)
    if args.json:
        for b, h in zip(report["blocks"], hashes):
            b["hash"] = h.hex()
        report["summary"] = summary(report)
        print(json.dumps(report))
    else:
        print_table(report, hashes)
    return 0
