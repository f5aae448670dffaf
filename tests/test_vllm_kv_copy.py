"""connectors/kv_copy.py: whole-block copies between paged KV tensors and arena payloads (torch only)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from connectors.kv_copy import PagedKV, arena_tensor, block_major  # noqa: E402

NB, H, N, D = 6, 2, 32, 8  # blocks, kv heads, block tokens, head size


def cpu_layers(num_layers: int, shared: bool, dtype=torch.bfloat16) -> list:
    """vLLM CPU layout: [num_blocks, heads, block_tokens, 2*head]; optionally slices of one allocation."""
    g = torch.Generator().manual_seed(0)
    if shared:
        base = torch.randn(num_layers, NB, H, N, 2 * D, generator=g).to(dtype)
        return [base[i] for i in range(num_layers)]
    return [torch.randn(NB, H, N, 2 * D, generator=g).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("shared", [True, False])
def test_save_load_round_trip_restores_every_layer(shared):
    layers = cpu_layers(3, shared)
    kv = PagedKV(layers, NB)
    assert (kv._stacked is not None) == shared
    assert kv.block_bytes == 3 * H * N * 2 * D * 2
    arena = arena_tensor(np.zeros(4 * kv.block_bytes, dtype=np.uint8))
    kv.save_to_arena(arena, 2, [[kv.block_bytes, kv.block_bytes]])
    payload = arena[kv.block_bytes : 2 * kv.block_bytes].clone()
    expected = torch.cat([t[2].reshape(-1).view(torch.uint8) for t in layers])
    assert torch.equal(payload, expected)  # layer after layer, each block slice contiguous
    before = [t.clone() for t in layers]
    kv.load_from_arena(arena, 4, [[kv.block_bytes, kv.block_bytes]])
    for t, old in zip(layers, before):
        assert torch.equal(t[4], old[2])
        for b in (0, 1, 2, 3, 5):
            assert torch.equal(t[b], old[b])  # no other block touched


def test_fragmented_extents_round_trip():
    layers = cpu_layers(2, shared=True, dtype=torch.float32)
    kv = PagedKV(layers, NB)
    half = kv.block_bytes // 2
    arena = arena_tensor(np.zeros(4 * kv.block_bytes, dtype=np.uint8))
    extents = [[3 * kv.block_bytes, half], [0, kv.block_bytes - half]]
    kv.save_to_arena(arena, 1, extents)
    before = [t.clone() for t in layers]
    kv.load_from_arena(arena, 5, extents)
    for t, old in zip(layers, before):
        assert torch.equal(t[5], old[1])


def test_block_dim_found_in_non_leading_position():
    t = torch.arange(2 * NB * 4, dtype=torch.float32).reshape(2, NB, 4)  # e.g. [K/V, blocks, ...]
    v = block_major(t, NB)
    assert v.shape == (NB, 2, 4)
    assert torch.equal(v[3], t[:, 3])
    kv = PagedKV([t], NB)
    flat = torch.zeros(kv.block_bytes, dtype=torch.uint8)
    kv.save_block(3, flat)
    kv.load_block(0, flat)
    assert torch.equal(t[:, 0], t[:, 3])


def test_block_keys_reads_the_k_half_of_each_head():
    layers = cpu_layers(1, shared=False, dtype=torch.float32)
    kv = PagedKV(layers, NB)
    keys = kv.block_keys(0, [1, 3], N)
    assert keys.shape == (2 * N, H, D)
    # CPU layout: per (block, head) the memory is K[N, D] then V[N, D]
    k_block3 = layers[0][3].reshape(H, 2 * N, D)[:, :N, :].permute(1, 0, 2)
    assert torch.equal(keys[N:], k_block3)


def test_mismatched_block_count_is_rejected():
    with pytest.raises(ValueError):
        block_major(torch.zeros(5, 3), 4)
