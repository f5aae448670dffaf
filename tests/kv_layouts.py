"""KV tensors the way vLLM hands them to a connector, in every layout the copy plans handle, and the
reference payload of a block built from them with plain torch indexing (independent of copy_plan.py).

Shared by tests/test_copy_plan.py (CPU, Triton interpreter) and tests/test_gpu.py (CUDA).
"""

from __future__ import annotations

import random

import torch

NB, H, N, D, L = 12, 2, 4, 8, 3  # blocks, kv heads, block tokens, head size, layers

# kind -> how a block's slice of one layer tensor is taken (the block dim and kernel-block split)
KINDS = {
    "cpu_separate": lambda t, b: t[b],  # [B, H, N, 2D] per layer, one tensor each
    "cuda_legacy_nhd": lambda t, b: t[:, b],  # flash-attn [2, B, N, H, D]: a K plane and a V plane
    "flashinfer_legacy": lambda t, b: t[b],  # [B, 2, N, H, D]
    "shared_LBHNC": lambda t, b: t[b],  # vLLM >= 0.32, one allocation, layer-outer (CPU_ATTN's)
    "shared_LBNHC": lambda t, b: t[b],  # flash-attn's physical order behind the logical [B, H, N, C] view
    "shared_BLHNC": lambda t, b: t[b],  # block-outermost: a block's layers are adjacent
    "shared_BLNHC": lambda t, b: t[b],  # block-outermost, token-major inside a layer's page
    "kernel_split_LBHNC": lambda t, b: t[2 * b : 2 * b + 2],  # the kernel splits each block in two
}
BLOCK_OUTERMOST = {"shared_BLHNC", "shared_BLNHC"}


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def make_layers(kind: str, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer tensors as vLLM passes them to `register_kv_caches`. Values are drawn on the CPU and
    then moved, so a seed gives the same bytes on any device."""
    bf16, f16 = torch.bfloat16, torch.float16
    if kind == "cpu_separate":
        return [_random((NB, H, N, 2 * D), bf16, seed + i).to(device) for i in range(L)]
    if kind == "cuda_legacy_nhd":
        return [_random((2, NB, N, H, D), f16, seed + i).to(device) for i in range(L)]
    if kind == "flashinfer_legacy":
        return [_random((NB, 2, N, H, D), f16, seed + i).to(device) for i in range(L)]
    if kind == "shared_LBHNC":
        raw = _random((L, NB, H, N, 2 * D), bf16, seed).to(device)
        return [raw[i] for i in range(L)]
    if kind == "shared_LBNHC":
        raw = _random((L, NB, N, H, 2 * D), bf16, seed).to(device)
        return [raw[i].permute(0, 2, 1, 3) for i in range(L)]
    if kind == "shared_BLHNC":
        raw = _random((NB, L, H, N, 2 * D), bf16, seed).to(device)
        return [raw[:, i] for i in range(L)]
    if kind == "shared_BLNHC":
        raw = _random((NB, L, N, H, 2 * D), bf16, seed).to(device)
        return [raw[:, i].permute(0, 2, 1, 3) for i in range(L)]
    if kind == "kernel_split_LBHNC":
        raw = _random((L, 2 * NB, H, N // 2, 2 * D), bf16, seed).to(device)
        return [raw[i] for i in range(L)]
    raise AssertionError(kind)


def blank_like(kind: str, device: str = "cpu") -> list[torch.Tensor]:
    layers = make_layers(kind, device=device)
    for t in layers:
        t.zero_()
    return layers


def physical_bytes(t: torch.Tensor) -> torch.Tensor:
    """A view's elements in memory order (dims sorted by stride, outermost first), as bytes."""
    dims = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(*dims).contiguous().view(-1).view(torch.uint8).cpu()


def ref_payload(kind: str, layers, b: int) -> torch.Tensor:
    """Block b's payload: each layer's slice of the block in memory order, layer after layer."""
    return torch.cat([physical_bytes(KINDS[kind](t, b)) for t in layers])


def random_ids(n: int, seed: int, num_blocks: int = NB) -> list[int]:
    ids = random.Random(seed).sample(range(num_blocks), n)
    assert ids != sorted(ids) or n < 2  # non-contiguous and out of order
    return ids
