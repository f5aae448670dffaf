"""`kvstore inspect` against a real daemon, without an engine (tests/test_inspect_vllm.py has one).

Token-id prompts: the summary and JSON fields, cache_salt and LoRA keys, a TP
engine's ranks seen as one namespace (a block counts when every rank holds it),
a model with several namespaces listed, and bad input as one line with exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from kvstore.client import KVClient
from kvstore.keys import ExtraKeys, Namespace, hash_blocks, lora_key
from tests.conftest import ROOT

BT = 16
TOKENS = list(range(1000, 1000 + 5 * BT + 3))  # 5 full blocks and 3 tokens


def ns(**kw) -> Namespace:
    return Namespace(**{"model": "m", "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 64,
                        "block_tokens": BT, "block_bytes": 64 * 1024, **kw})


def put(client: KVClient, ns_id: str, hashes: list[bytes]) -> None:
    payload = np.zeros(64 * 1024, np.uint8)
    assert client.put(ns_id, [(h, p, payload) for h, p in zip(hashes, [None] + hashes[:-1])]) == len(hashes)


def inspect(sock: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "inspect", "--socket", sock, *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)


def report(sock: str, *args: str) -> dict:
    r = inspect(sock, "--tokens", json.dumps(TOKENS), "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_summary_salt_lora_and_tp_ranks(daemon):
    hashes = hash_blocks(TOKENS, BT)
    salted = hash_blocks(TOKENS, BT, ExtraKeys(cache_salt="a"))
    lora = hash_blocks(TOKENS, BT, ExtraKeys(lora=lora_key("sql", "/adapters/sql")))
    with KVClient(daemon.socket_path) as c:
        one = c.register(ns())
        put(c, one, hashes[:3])
        put(c, one, salted[:2])
        put(c, one, lora[:4])
        c.get(one, hashes[:1])
        r0, r1 = c.register(ns(model="tp", tp_size=2)), c.register(ns(model="tp", tp_rank=1, tp_size=2))
        put(c, r0, hashes[:4])
        put(c, r1, hashes[:2])  # rank 1 holds fewer: the engine can load 2
    r = report(daemon.socket_path, "--model-name", "m")
    assert (r["cached_blocks"], r["total_blocks"], r["cached_tokens"], r["reusable_tokens"]) == (3, 5, 48, 48)
    assert [b["tier"] for b in r["blocks"]] == ["host"] * 3 + ["missing"] * 2
    assert [b["hash"] for b in r["blocks"]] == [h.hex() for h in hashes]
    assert r["blocks"][0]["hits"] == 1 and r["blocks"][1]["hits"] == 0 and r["blocks"][0]["policy_value"]
    assert r["summary"] == "first 3 of 5 blocks cached: 3 host; 48 of 83 tokens would be reused"
    assert report(daemon.socket_path, "--model-name", "m", "--cache-salt", "a")["cached_blocks"] == 2
    assert report(daemon.socket_path, "--model-name", "m", "--cache-salt", "b")["cached_blocks"] == 0
    assert report(daemon.socket_path, "--model-name", "m", "--lora", "sql", "--lora-path",
                  "/adapters/sql")["cached_blocks"] == 4
    tp = report(daemon.socket_path, "--model-name", "tp")
    assert tp["cached_blocks"] == 2 and tp["namespaces"] == [r0, r1]
    assert report(daemon.socket_path, "--ns", r0)["cached_blocks"] == 4  # rank 0 alone
    table = inspect(daemon.socket_path, "--tokens", json.dumps(TOKENS), "--model-name", "m")
    assert table.returncode == 0 and "first 3 of 5 blocks cached: 3 host" in table.stdout
    assert hashes[0].hex()[:16] in table.stdout and "missing" in table.stdout


def test_several_namespaces_are_listed_and_bad_input_is_one_line(daemon, tmp_path):
    with KVClient(daemon.socket_path) as c:
        a, b = c.register(ns()), c.register(ns(dtype="float16"))
    r = inspect(daemon.socket_path, "--tokens", "[1, 2, 3]", "--model-name", "m")
    assert r.returncode == 1 and "has 2 namespaces" in r.stderr and a in r.stderr and b in r.stderr
    bad_json = tmp_path / "tokens.json"
    bad_json.write_text('{"ids": [1, 2]}')
    not_json = tmp_path / "broken.json"
    not_json.write_text("[1, 2,")
    cases = [
        (("--tokens-file", str(bad_json), "--ns", a), "must be a JSON list of token ids"),
        (("--tokens-file", str(not_json), "--ns", a), "is not JSON"),
        (("--tokens-file", str(tmp_path / "none.json"), "--ns", a), "cannot read --tokens-file"),
        (("--tokens", "[1, -2]", "--ns", a), "must be a JSON list of token ids"),
        (("--tokens", "[1]", "--model-name", "unknown"), "no namespace for model 'unknown'"),
        (("--tokens", "[1]", "--ns", "ns-nope"), "unknown namespace ns-nope"),
        (("--text", "hello", "--ns", a), "--text and --file need --model"),
    ]
    for args, why in cases:
        r = inspect(daemon.socket_path, *args)
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    r = inspect(str(tmp_path / "no-daemon.sock"), "--tokens", "[1]", "--ns", a)
    assert r.returncode == 1 and "cannot reach the kvstore daemon" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_hybrid_prefix_is_reusable_up_to_its_deepest_attachment(daemon):
    """A hybrid model's spine and its anchored attachments (connectors/hybrid.py) are one engine: the spine
    holds 4 blocks, an attachment follows blocks 1 and 3 (index 0, 2), so 64 tokens would be reused."""
    import dataclasses

    hashes = hash_blocks(TOKENS, BT)
    with KVClient(daemon.socket_path) as c:
        spine = ns(model="hybrid", layout="cpu/default/hybrid-x/spine-full")
        spine_id = c.register(spine)
        att_id = c.register(dataclasses.replace(spine, layout="cpu/default/hybrid-x/attachment", anchor=spine_id))
        put(c, spine_id, hashes[:4])
        payload = np.zeros(64 * 1024, np.uint8)
        assert c.put(att_id, [(h, h, payload) for h in (hashes[1], hashes[3])]) == 2
    r = report(daemon.socket_path, "--model-name", "hybrid")  # the attachments' namespace is not a second engine
    assert r["namespace"] == spine_id and r["hybrid"] and r["cached_blocks"] == 4
    assert [b["attachment"] for b in r["blocks"]] == [False, True, False, True, False]
    assert r["reusable_tokens"] == 4 * BT
    text = inspect(daemon.socket_path, "--tokens", json.dumps(TOKENS[: 3 * BT + 1]), "--model-name", "hybrid")
    assert text.returncode == 0 and "32 of 49 tokens would be reused" in text.stdout  # not 48: no attachment after block 2


def test_stats_shows_a_hybrid_model_s_attachments_on_its_spine_s_line():
    from kvstore.tools.stats_cmd import namespace_lines

    row = lambda **kw: {"model": "h", "tp_rank": 0, "tp_size": 1, "block_tokens": 16, "anchor": "",  # noqa: E731
                        "blocks": {"host": 4}, "bytes": {"host": 4 << 20}, **kw}
    lines = namespace_lines({"ns-spine": row(), "ns-att": row(anchor="ns-spine", blocks={"disk": 2},
                                                                bytes={"disk": 6 << 20}), "ns-dense": row(model="d")})
    assert len(lines) == 2 and "ns-att" not in "".join(lines)
    assert "blocks 4" in lines[0] and "+ hybrid attachments 2 (6.0 MiB" in lines[0] and "attachments" not in lines[1]


def test_the_prompt_is_tokenized_as_transformers_does_without_importing_it(tmp_path):
    """`--model`'s tokenizer.json read by `tokenizers` gives transformers' ids and text (SmolLM2, with and
    without special tokens); a tokenizer_config.json that switches BOS or EOS (which transformers applies on
    load) or cleans up spaces leaves the model to transformers."""
    import shutil

    from transformers import AutoTokenizer

    from kvstore.tools.harness.vllm_helpers import build_model, corpus_text
    from kvstore.tools.inspect_cmd import _FastTokenizer, _fast_tokenizer

    model = build_model("smollm2")
    fast, ref = _fast_tokenizer(model), AutoTokenizer.from_pretrained(model)
    assert isinstance(fast, _FastTokenizer)
    text = corpus_text(3000, offset=500) + " <|im_start|>user\nWhat's 2+2?<|im_end|>"
    for special in (True, False):
        ids = fast(text, add_special_tokens=special)["input_ids"]
        assert ids == ref(text, add_special_tokens=special)["input_ids"] and len(ids) > 500
        assert fast.decode(ids[100:164]) == ref.decode(ids[100:164])
    for switch in ({"add_bos_token": True}, {"add_eos_token": False}, {"clean_up_tokenization_spaces": True}):
        other = tmp_path / str(len(list(tmp_path.iterdir())))
        other.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(model, name), other / name)
        assert _fast_tokenizer(str(other)) is not None  # (the copy alone is read by tokenizers)
        config = json.loads((other / "tokenizer_config.json").read_text())
        (other / "tokenizer_config.json").write_text(json.dumps({**config, **switch}))
        assert _fast_tokenizer(str(other)) is None, switch
