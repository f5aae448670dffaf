"""The attention estimate a save sends with its commit: a key-norm score per block (KnormPress: keys
with a low norm receive more attention), from a few sampled layers of the engine's KV.

The eviction policy (eviction/attention.py) takes the estimate as one input of a
block's value; it is advisory, so any failure here means "no estimate".
`block_key_norm_score` is the pure NumPy part (also used by
tools/bench/attention_signal.py); `KeyNormScorer` reads the keys out of the
engine's KV tensors in the layouts it knows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

SCORE_LAYERS = 2  # layers sampled for the estimate


def block_key_norm_score(keys, block_tokens: int) -> np.ndarray:
    """Per-block attention estimate from post-RoPE keys (KnormPress: low key norm, more attention).

    `keys`: array-like `[num_tokens, num_kv_heads, head_dim]` (numpy or torch,
    any float dtype) for one or more layers stacked on axis 0 of a 4-D input
    `[num_layers, num_tokens, heads, head_dim]`. Per (layer, head), token key
    norms are rank-normalised to [0, 1] (so scales of different heads do not
    mix), negated (low norm = high score), averaged over layers and heads, and
    averaged over each block's tokens. A trailing partial block is scored on
    its tokens. Returns float64 `[num_blocks]` in [0, 1], ranked within the
    call, ready for `commit(attention=...)`.
    """
    if hasattr(keys, "detach"):
        keys = keys.detach().float().cpu().numpy()
    k = np.asarray(keys, dtype=np.float32)
    if k.ndim == 3:
        k = k[None]
    if k.ndim != 4:
        raise ValueError("keys must be [tokens, heads, head_dim] or [layers, tokens, heads, head_dim]")
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    return score_from_norms(np.linalg.norm(k, axis=-1), block_tokens)


def score_from_norms(norms: np.ndarray, block_tokens: int) -> np.ndarray:
    """`block_key_norm_score` from key norms `[layers, tokens, heads]`."""
    num_tokens = norms.shape[1]
    if num_tokens == 0:
        return np.zeros(0)
    ranks = norms.argsort(axis=1).argsort(axis=1).astype(np.float64)
    token_score = 1.0 - ranks / max(num_tokens - 1, 1)  # low norm -> near 1
    per_token = token_score.mean(axis=(0, 2))
    num_blocks = -(-num_tokens // block_tokens)
    padded = np.full(num_blocks * block_tokens, np.nan)
    padded[:num_tokens] = per_token
    block = np.nanmean(padded.reshape(num_blocks, block_tokens), axis=1)
    if num_blocks == 1:
        return np.array([0.5])
    order = block.argsort().argsort().astype(np.float64)
    return order / (num_blocks - 1)


class KeyNormScorer:
    """Scores saved blocks from the keys of `SCORE_LAYERS` layers of the engine's KV tensors.

    Known layout: vLLM's logical per-layer view `[blocks, kv_heads, block_tokens, 2 * head_dim]`
    (K then V in the last dim, any physical order). The norms are computed on the tensors' device;
    on CUDA they come to the host without synchronizing the device (`Scores.result` waits for them,
    after the save that reads the same blocks is done).
    """

    def __init__(self, tensors: Sequence, block_tokens: int) -> None:
        n = len(tensors)
        self.layers = [tensors[i] for i in sorted({n // 2, n - 1})[:SCORE_LAYERS]]
        self.block_tokens = block_tokens
        view = self.layers[0]
        self.known = view.dim() == 4 and view.shape[2] == block_tokens and view.shape[3] % 2 == 0

    def submit(self, block_ids: Sequence[int]) -> "Scores | None":
        if not self.known or len(block_ids) < 2:
            return None
        try:
            import torch

            idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
            norms = []
            for view in self.layers:
                half = view.shape[3] // 2
                keys = view.index_select(0, idx)[..., :half]  # [n, heads, tokens, head_dim]
                norms.append(keys.float().norm(dim=-1).permute(0, 2, 1).reshape(-1, view.shape[1]))
            stacked = torch.stack(norms)  # [layers, n * tokens, heads]
            if stacked.device.type == "cuda":
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                return Scores(host, self.block_tokens, event)
            return Scores(stacked, self.block_tokens, None)
        except Exception as exc:  # advisory: no estimate
            log.debug("attention estimate failed: %r", exc)
            return None


class Scores:
    def __init__(self, norms, block_tokens: int, event) -> None:
        self._norms, self._block_tokens, self._event = norms, block_tokens, event

    def result(self) -> list[float] | None:
        try:
            if self._event is not None:
                self._event.synchronize()
            return [float(s) for s in score_from_norms(self._norms.numpy(), self._block_tokens)]
        except Exception as exc:
            log.debug("attention estimate failed: %r", exc)
            return None
