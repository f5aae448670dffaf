"""What bench_compression.py measures with: a real model's KV cache as stored blocks, the codec round
trip, the quality measures, and the calibration that gives per-head budgets their distortion table.

The model runs with transformers on CPU (float32). A prefix's KV becomes
stored blocks exactly as the connector lays them out for vLLM's CPU backend
(`HNC`: per layer, heads x tokens x [K | V]), each block goes through the
codec alone (kvstore/codec.py, the daemon's own code), and the decoded blocks
replace the prefix's cache. Full blocks only: a prefix is cut to a multiple of
the block size, as a store holds it.

Quality of a setting against the exact cache, teacher-forcing the tokens that
follow the prefix: relative increase of the mean NLL, mean KL(exact || codec)
of the next-token distributions, top-1 agreement, and the length of the greedy
continuation that matches the exact cache's greedy continuation. Passkey: a
number hidden in filler text, asked for after it; the stored part is the
filler and the key, the question is computed fresh.

Calibration (`calibrate`): on a calibration prompt, two measurements. End to
end: the model's KL when one layer's keys (or values) are stored at a reference
width, the rest exact (what the layer costs). Attention-weighted: the queries
of the tokens that follow the prefix are captured with its keys and values,
and each group (layer, KV head, K or V) is round-tripped alone at each width;
its distortion is the change of the layer's attention output through the
head's slice of the output projection (a key error moves the softmax of the
queries that attend to it, a value error is weighted by the attention its
token receives). A group's distortion is its layer's KL times its share of the
layer's attention-weighted distortion at the reference width, scaled by how
its own distortion falls with more bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvstore.codec import BlockLayout, Budget, decode, encode, encoded_bytes

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class Model:
    model: object
    tokenizer: object
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_tokens: int = 16

    def layout(self, dtype: str = "float32") -> BlockLayout:
        return BlockLayout(self.num_layers, self.num_kv_heads, self.block_tokens, self.head_size, dtype)


def load_model(path: str, threads: int) -> Model:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Model(model, tok, cfg.num_hidden_layers, cfg.num_key_value_heads, head)


# -- the cache as stored blocks ---------------------------------------------------------------
def cache_kv(cache) -> tuple[list, list]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def make_cache(keys: list, values: list):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


def to_blocks(keys: list, values: list, block_tokens: int) -> np.ndarray:
    """float32 [blocks, layers, heads, tokens, 2 * head]: the HNC payload of each full block."""
    import torch

    k = torch.stack([t[0] for t in keys]).float()  # [L, H, T, D]
    v = torch.stack([t[0] for t in values]).float()
    L, H, T, D = k.shape
    nb = T // block_tokens
    kv = torch.cat((k[:, :, : nb * block_tokens], v[:, :, : nb * block_tokens]), dim=-1)
    return kv.reshape(L, H, nb, block_tokens, 2 * D).permute(2, 0, 1, 3, 4).contiguous().numpy()


def from_blocks(blocks: np.ndarray) -> tuple[list, list]:
    """The inverse of `to_blocks`: per layer [1, H, T, D] keys and values."""
    import torch

    nb, L, H, N, C = blocks.shape
    t = torch.from_numpy(np.ascontiguousarray(blocks)).permute(1, 2, 0, 3, 4).reshape(L, H, nb * N, C)
    return [t[i, :, :, : C // 2][None].contiguous() for i in range(L)], [t[i, :, :, C // 2 :][None].contiguous() for i in range(L)]


# -- settings ---------------------------------------------------------------------------------------
@dataclass
class Setting:
    """A way to store blocks: `apply` returns the blocks as a reader gets them back."""

    codec: str
    mean_bits: float
    ratio: float  # the block's bfloat16 size over its stored size, everything counted
    apply: Callable[[np.ndarray], np.ndarray]
    budget: Budget | None = None


def codec_setting(name: str, m: Model, budget: Budget) -> Setting:
    f32, bf16 = m.layout("float32"), m.layout("bfloat16")

    def apply(blocks: np.ndarray) -> np.ndarray:
        out = np.empty_like(blocks)
        for i, block in enumerate(blocks):
            out[i] = decode(encode(block.view(np.uint8).reshape(-1), f32, budget), f32).view(np.float32).reshape(block.shape)
        return out

    return Setting(name, budget.mean_bits(), bf16.block_bytes / encoded_bytes(bf16, budget), apply, budget)


def fp8_setting(m: Model) -> Setting:
    """fp8 E4M3 with one float16 scale per (block, layer, head, K/V): the plain cast baseline."""
    import torch

    bf16 = m.layout("bfloat16")
    stored = bf16.block_bytes // 2 + 2 * bf16.num_groups

    def apply(blocks: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(blocks)
        D = t.shape[-1] // 2
        halves = []
        for part in (t[..., :D], t[..., D:]):
            amax = part.abs().amax(dim=(-2, -1), keepdim=True)
            scale = (amax / 448.0).clamp_min(1e-12).half().float()
            halves.append((part / scale).to(torch.float8_e4m3fn).float() * scale)
        return torch.cat(halves, dim=-1).numpy()

    return Setting("fp8-e4m3", 8.0, bf16.block_bytes / stored, apply)


# -- quality measures -------------------------------------------------------------------------------
@dataclass
class Reference:
    """The exact cache's answers for one prefix: what every setting is compared with."""

    prefix_blocks: np.ndarray
    follow: object  # torch [1, F] tokens after the prefix
    logits: object  # torch [F - 1, V], teacher-forced on the exact cache
    greedy: list


def _teacher_force(m: Model, keys, values, follow):
    import torch

    with torch.no_grad():
        out = m.model(follow, past_key_values=make_cache(keys, values), use_cache=True)
    return out.logits[0, :-1].float()


def _greedy(m: Model, keys, values, first, steps: int) -> list[int]:
    import torch

    cache, tok, got = make_cache(keys, values), first, []
    with torch.no_grad():
        for _ in range(steps):
            out = m.model(tok, past_key_values=cache, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            got.append(nxt)
            tok = torch.tensor([[nxt]])
    return got


def reference(m: Model, ids, prefix_tokens: int, follow_tokens: int, greedy_steps: int) -> Reference:
    import torch

    with torch.no_grad():
        out = m.model(ids[:, :prefix_tokens], use_cache=True)
    keys, values = cache_kv(out.past_key_values)
    blocks = to_blocks(keys, values, m.block_tokens)
    follow = ids[:, prefix_tokens : prefix_tokens + follow_tokens + 1]
    k, v = from_blocks(blocks)
    return Reference(blocks, follow, _teacher_force(m, k, v, follow), _greedy(m, k, v, follow[:, :1], greedy_steps))


def compare(m: Model, ref: Reference, blocks: np.ndarray) -> dict:
    """NLL, KL, top-1 and greedy match of decoded `blocks` against the exact cache."""
    import torch

    k, v = from_blocks(blocks)
    logits = _teacher_force(m, k, v, ref.follow)
    target = ref.follow[0, 1:]
    lp_ref, lp = torch.log_softmax(ref.logits, -1), torch.log_softmax(logits, -1)
    nll_ref = float(-lp_ref[torch.arange(len(target)), target].mean())
    nll = float(-lp[torch.arange(len(target)), target].mean())
    kl = float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())
    top1 = float((lp_ref.argmax(-1) == lp.argmax(-1)).float().mean())
    greedy = _greedy(m, k, v, ref.follow[:, :1], len(ref.greedy))
    match = next((i for i, (a, b) in enumerate(zip(greedy, ref.greedy)) if a != b), len(ref.greedy))
    return {"nll_ref": nll_ref, "nll": nll, "kl": kl, "top1": top1, "greedy_match": match}


@dataclass
class Passkey:
    blocks: np.ndarray
    rest: object  # torch [1, R]: the tokens after the stored blocks, the question included
    key: str


def passkeys(m: Model, count: int, filler_tokens: int, seed: int) -> list[Passkey]:
    """Prompts hiding a 5-digit key at a varying depth of about `filler_tokens` of filler, prefilled."""
    import torch

    rng = np.random.default_rng(seed)
    unit = len(m.tokenizer(FILLER).input_ids)
    reps = max(2, filler_tokens // unit)
    out = []
    for i in range(count):
        key = str(int(rng.integers(10000, 99999)))
        depth = int(reps * (i + 0.5) / count)
        text = (FILLER * depth + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + FILLER * (reps - depth) + "What is the pass key? The pass key is")
        ids = m.tokenizer(text, return_tensors="pt").input_ids
        stored = (ids.shape[1] - 12) // m.block_tokens * m.block_tokens  # the question stays out of the blocks
        with torch.no_grad():
            cache = m.model(ids[:, :stored], use_cache=True).past_key_values
        out.append(Passkey(to_blocks(*cache_kv(cache), m.block_tokens), ids[:, stored:], key))
    return out


def passkey_correct(m: Model, p: Passkey, blocks: np.ndarray) -> bool:
    import torch

    k, v = from_blocks(blocks)
    cache = make_cache(k, v)
    with torch.no_grad():
        out = m.model(p.rest, past_key_values=cache, use_cache=True)
        toks = [int(out.logits[0, -1].argmax())]
        for _ in range(5):
            out = m.model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
            toks.append(int(out.logits[0, -1].argmax()))
    return p.key in m.tokenizer.decode(toks).replace(" ", "")


# -- calibration -----------------------------------------------------------------------------------
def capture_attention(m: Model, ids, prefix_tokens: int, follow_tokens: int) -> tuple[list, np.ndarray]:
    """Per layer (q [Hq, F, D], k [H, T, D], v [H, T, D]) of `follow_tokens` queries over the prefix and
    themselves, and the prefix's blocks."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query[0].detach(), key[0].detach(), value[0].detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvstore_capture", capture)
    with torch.no_grad():
        out = m.model(ids[:, :prefix_tokens], use_cache=True)
        blocks = to_blocks(*cache_kv(out.past_key_values), m.block_tokens)
        m.model.set_attn_implementation("kvstore_capture")
        try:
            m.model(ids[:, prefix_tokens : prefix_tokens + follow_tokens], past_key_values=out.past_key_values,
                    use_cache=True)
        finally:
            m.model.set_attn_implementation("sdpa")
    return [seen[i] for i in range(m.num_layers)], blocks


def calibrate(m: Model, ids, prefix_tokens: int, follow_tokens: int, widths, rotate: bool = True,
              key_mode: str = "token", measure_bits: int = 2) -> np.ndarray:
    """Distortion [L, H, 2, len(widths)] of each group of a calibration prefix at each width.

    Two measurements: the model's KL when one layer's keys (or values) are stored at
    `measure_bits` (what the layer costs, end to end), and each group's attention-weighted
    output change at every width (`attention_distortion`: how that cost splits over the layer's
    heads, and how it falls with more bits). Distortion = the layer's KL x the group's share."""
    captured, blocks = capture_attention(m, ids, prefix_tokens, follow_tokens)
    f32 = m.layout("float32")
    decoded = {w: codec_setting(f"k{w}v{w}", m, Budget.uniform(f32, w, rotate=rotate, key_mode=key_mode)).apply(blocks)
               for w in sorted(set(widths) | {measure_bits})}
    share = attention_distortion(m, captured, {w: from_blocks(decoded[w]) for w in widths}, blocks.shape[0] * m.block_tokens)
    at = attention_distortion(m, captured, {measure_bits: from_blocks(decoded[measure_bits])},
                              blocks.shape[0] * m.block_tokens)[..., 0]
    ref = reference(m, ids, prefix_tokens, follow_tokens, 1)
    D = m.head_size
    layer_kl = np.zeros((m.num_layers, 2))
    for layer in range(m.num_layers):
        for kv in (0, 1):
            mixed = blocks.copy()
            part = slice(0, D) if kv == 0 else slice(D, 2 * D)
            mixed[:, layer, :, :, part] = decoded[measure_bits][:, layer, :, :, part]
            layer_kl[layer, kv] = max(kl_only(m, ref, mixed), 1e-9)
    total = np.maximum(at.sum(axis=1, keepdims=True), 1e-30)  # [L, 1, 2]
    return layer_kl[:, None, :, None] * share / total[..., None]


def kl_only(m: Model, ref: Reference, blocks: np.ndarray) -> float:
    import torch

    k, v = from_blocks(blocks)
    lp = torch.log_softmax(_teacher_force(m, k, v, ref.follow), -1)
    lp_ref = torch.log_softmax(ref.logits, -1)
    return float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())


def attention_distortion(m: Model, captured: list, decoded: dict, prefix: int) -> np.ndarray:
    """[L, H, 2, widths]: mean squared change of each layer's attention output after o_proj when one
    group's prefix keys or values are replaced by their decoded ones."""
    import torch

    attn_layers = [layer.self_attn for layer in m.model.model.layers]
    H, D = m.num_kv_heads, m.head_size
    widths = sorted(decoded)
    dist = np.zeros((m.num_layers, H, 2, len(widths)))
    with torch.no_grad():
        for layer, (q, k, v) in enumerate(captured):
            group = q.shape[0] // H
            F, T = q.shape[1], k.shape[1]
            mask = torch.ones(F, T, dtype=torch.bool).tril(diagonal=T - F)
            wo = attn_layers[layer].o_proj.weight  # [hidden, Hq * D]
            scale = attn_layers[layer].scaling
            for h in range(H):
                qh = q[h * group : (h + 1) * group]  # the query heads that read KV head h
                base = _attend(qh, k[h], v[h], mask, scale)
                w_h = wo[:, h * group * D : (h + 1) * group * D]
                for wi, w in enumerate(widths):
                    for kv in (0, 1):
                        kk, vv = k[h].clone(), v[h].clone()
                        (kk if kv == 0 else vv)[:prefix] = decoded[w][kv][layer][0, h][:prefix]
                        delta = _attend(qh, kk, vv, mask, scale) - base  # [group, F, D]
                        out = delta.permute(1, 0, 2).reshape(F, group * D) @ w_h.T
                        dist[layer, h, kv, wi] = float((out ** 2).sum(-1).mean())
    return dist


def _attend(q, k, v, mask, scale):
    import torch

    s = (q @ k.T) * scale
    s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, dim=-1) @ v
