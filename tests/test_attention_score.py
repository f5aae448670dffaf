"""The attention estimate sent with commits (connectors/attention_score.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.connectors.attention_score import KeyNormScorer, block_key_norm_score


def test_key_norm_score_prefers_low_norm_blocks():
    keys = np.ones((64, 2, 8), dtype=np.float32)
    keys[:16] *= 0.1  # block 0: low key norm -> most attention expected
    keys[48:] *= 10.0  # block 3: high norm -> least
    score = block_key_norm_score(keys, 16)
    assert score.shape == (4,) and score.min() >= 0 and score.max() <= 1
    assert score[0] == 1.0 and score[3] == 0.0
    assert block_key_norm_score(keys[:20], 16).shape == (2,)


def test_scorer_reads_the_keys_of_the_saved_blocks_from_the_engine_tensors():
    torch = pytest.importorskip("torch")
    nb, heads, tokens, head_dim, layers = 8, 2, 4, 8, 4
    raw = torch.randn(layers, nb, heads, tokens, 2 * head_dim)  # vLLM's [B, H, N, K|V] per layer
    views = [raw[i] for i in range(layers)]
    ids = [6, 1, 3]
    scores = KeyNormScorer(views, tokens).submit(ids).result()
    sampled = [views[layers // 2], views[layers - 1]]  # the two layers the scorer samples
    keys = torch.stack([v[ids][..., :head_dim].permute(0, 2, 1, 3).reshape(-1, heads, head_dim) for v in sampled])
    assert scores == pytest.approx(block_key_norm_score(keys, tokens).tolist())
    values_only = [v.clone() for v in views]
    for v in values_only:
        v[..., head_dim:] = 0  # the V half does not enter the score
    assert KeyNormScorer(values_only, tokens).submit(ids).result() == scores
    assert KeyNormScorer(views, tokens).submit([2]) is None  # one block: nothing to rank
    assert KeyNormScorer([torch.zeros(nb, 5, 3)], tokens).submit(ids) is None  # a layout it does not know
