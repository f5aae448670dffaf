"""Whole-block copies between an engine's paged KV tensors and flat block payloads.

A block payload is the bytes of one KV block for every layer, concatenated
layer after layer in the order the layers were given; within a layer it is the
block's slice of that layer's tensor, in the tensor's own memory order (on
vLLM's CPU backend `[num_kv_heads, block_size, 2 * head_size]`, K then V per
head). Only whole blocks are copied: a block's slice is the same bytes whatever
tokens it holds, so load(save(b)) restores b exactly.

Device-agnostic: tensors may live on any torch device; `copy_` moves the bytes
between the device and the (host) payload buffer. When every layer tensor is a
same-shaped slice of one allocation at a constant stride (vLLM's usual layout),
a block of all layers is one strided view and one `copy_`; otherwise one
`copy_` per layer.

Only torch here (no vLLM), so other engines' adapters can reuse it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvstore.client import copy_bytes  # tiers.host's, through the client (connectors -> kvstore only)


def block_major(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of `t` whose dim 0 indexes the engine's blocks.

    The block dim is the first of size `num_blocks`, else the first of a
    multiple of it (`k * num_blocks` when the kernel splits each block into `k` sub-blocks;
    those are kept together as one block).
    """
    exact = [d for d, size in enumerate(t.shape) if size == num_blocks]
    multiple = [d for d, size in enumerate(t.shape) if size > num_blocks and size % num_blocks == 0]
    for dim in exact[:1] or multiple[:1]:
        v = t.movedim(dim, 0)
        k = t.shape[dim] // num_blocks
        return v if k == 1 else v.unflatten(0, (num_blocks, k))
    raise ValueError(f"no dimension of KV tensor {tuple(t.shape)} is a multiple of {num_blocks} blocks")


def _stack_uniform(views: list[torch.Tensor]) -> torch.Tensor | None:
    """[num_blocks, num_layers, ...] view over all layers, if they are evenly spaced in one allocation."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(1)
    same = all(
        v.shape == first.shape and v.stride() == first.stride() and v.dtype == first.dtype
        and v.device == first.device
        and v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for v in views
    )
    if not same:
        return None
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(v.storage_offset() - first.storage_offset() != i * step for i, v in enumerate(views)):
        return None
    size = (first.shape[0], len(views), *first.shape[1:])
    stride = (first.stride()[0], step, *first.stride()[1:])
    return torch.as_strided(first, size, stride, first.storage_offset())


class PagedKV:
    """The paged KV tensors of all layers of one engine rank, addressed by block id."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not tensors:
            raise ValueError("no KV tensors")
        self.views = [block_major(t, num_blocks) for t in tensors]
        self.num_blocks = num_blocks
        self.layer_block_bytes = [v[0].numel() * v.element_size() for v in self.views]
        self.block_bytes = sum(self.layer_block_bytes)
        self.layer_offsets = [sum(self.layer_block_bytes[:i]) for i in range(len(self.views))]
        self.device = self.views[0].device
        self._stacked = _stack_uniform(self.views)
        self._rows: list[np.ndarray] | None | bool = None  # layer_rows(), once (False: not this layout)

    # -- one block <-> a flat uint8 buffer of block_bytes --------------------------
    def _layer_slices(self, flat: torch.Tensor):
        pos = 0
        for view, nbytes in zip(self.views, self.layer_block_bytes):
            yield view, flat[pos : pos + nbytes].view(view.dtype).view(view.shape[1:])
            pos += nbytes

    def _stacked_payload(self, flat: torch.Tensor) -> torch.Tensor:
        assert self._stacked is not None
        return flat.view(self._stacked.dtype).view(self._stacked.shape[1:])

    def save_block(self, block_id: int, flat: torch.Tensor) -> None:
        """Copy block `block_id` of every layer into `flat` (uint8, block_bytes, contiguous)."""
        if self._stacked is not None:
            _copy(self._stacked_payload(flat), self._stacked[block_id])
            return
        for view, dst in self._layer_slices(flat):
            _copy(dst, view[block_id])

    def load_block(self, block_id: int, flat: torch.Tensor) -> None:
        """Overwrite block `block_id` of every layer with the payload in `flat`."""
        if self._stacked is not None:
            _copy(self._stacked[block_id], self._stacked_payload(flat))
            return
        for view, src in self._layer_slices(flat):
            _copy(view[block_id], src)

    # -- blocks <-> arena extents ------------------------------------------------
    def save_to_arena(self, arena: torch.Tensor, block_id: int, extents: Sequence[Sequence[int]]) -> None:
        """Copy a block into its extents of `arena` (a uint8 tensor over the shared arena)."""
        if len(extents) == 1 and extents[0][1] == self.block_bytes:
            offset = extents[0][0]
            self.save_block(block_id, arena[offset : offset + self.block_bytes])
            return
        staging = torch.empty(self.block_bytes, dtype=torch.uint8)
        self.save_block(block_id, staging)
        _scatter(arena, extents, staging)

    def load_from_arena(self, arena: torch.Tensor, block_id: int, extents: Sequence[Sequence[int]]) -> None:
        if len(extents) == 1 and extents[0][1] == self.block_bytes:
            offset = extents[0][0]
            self.load_block(block_id, arena[offset : offset + self.block_bytes])
            return
        self.load_block(block_id, _gather(arena, extents, self.block_bytes))

    # -- one layer of a block (layer-wise loads) ----------------------------------------
    def layer_rows(self) -> list[np.ndarray] | None:
        """Per layer, `[num_blocks, layer bytes]` uint8 numpy rows over its KV tensor, or None when a
        block's slice of a layer is not contiguous (vLLM's CPU layout is) or the tensors are off the CPU."""
        if self._rows is None:
            rows = []
            for v in self.views:
                if v.device.type != "cpu" or not v[0].is_contiguous():
                    self._rows = False
                    return None
                rows.append(_as_bytes(torch.as_strided(v, (v.shape[0], v[0].numel()), (v.stride(0), 1))))
            self._rows = rows
        return self._rows or None

    def load_layer_from_arena(self, arena: np.ndarray, layer: int, block_id: int,
                              extents: Sequence[Sequence[int]]) -> None:
        """Overwrite layer `layer` of block `block_id` with that layer's bytes of the block held at
        `extents` of `arena` (a uint8 numpy array). Needs `layer_rows()`."""
        rows = self.layer_rows()
        assert rows is not None, "layer copies need the CPU layout (layer_rows)"
        dst = rows[layer][block_id]
        lo, n = self.layer_offsets[layer], self.layer_block_bytes[layer]
        if len(extents) == 1:
            start = extents[0][0] + lo
            copy_bytes(dst, arena[start : start + n])
            return
        pos = 0  # the payload's bytes [lo, lo + n) over the extents
        for offset, length in extents:
            a, b = max(lo, pos), min(lo + n, pos + length)
            if a < b:
                copy_bytes(dst[a - lo : b - lo], arena[offset + a - pos : offset + b - pos])
            pos += length

    # -- key sampling for the attention estimate --------------------------------------
    def block_keys(self, layer: int, block_ids: Sequence[int], block_tokens: int) -> torch.Tensor | None:
        """Keys `[n * block_tokens, heads, head_dim]` of `layer` for the blocks, or None for an unknown layout.

        Known layout: vLLM CPU `[heads, block_tokens, 2 * head_dim]` per block,
        K[block_tokens, head_dim] then V per head.
        """
        view = self.views[layer]
        if view.dim() != 4 or view.shape[2] != block_tokens or view.shape[3] % 2:
            return None
        heads, head2 = view.shape[1], view.shape[3]
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=view.device)
        blocks = view.index_select(0, idx).reshape(len(block_ids), heads, 2 * block_tokens, head2 // 2)
        keys = blocks[:, :, :block_tokens, :]  # [n, heads, tokens, head_dim]
        return keys.permute(0, 2, 1, 3).reshape(len(block_ids) * block_tokens, heads, head2 // 2)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return (t if t.element_size() == 1 else t.view(torch.uint8)).numpy()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src. On CPU through numpy on the calling thread: torch's copy_ fans out
    to the OpenMP pool, which is several times slower when the cores are busy (measured
    10x on a loaded 2-core box) and competes with the model's threads. Contiguous pairs
    take the arena's copy loop (`tiers.host.copy_bytes`: no slow `rep movsb` on AMD)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        copy_bytes(_as_bytes(dst).reshape(-1), _as_bytes(src).reshape(-1))
    elif dst.device.type == "cpu" and src.device.type == "cpu" and dst.stride(-1) == 1 and src.stride(-1) == 1:
        np.copyto(_as_bytes(dst), _as_bytes(src))
    else:
        dst.copy_(src)


def arena_tensor(arena: np.ndarray) -> torch.Tensor:
    """A uint8 torch tensor sharing the arena's memory (no copy)."""
    return torch.from_numpy(arena)


def _scatter(arena: torch.Tensor, extents: Sequence[Sequence[int]], src: torch.Tensor) -> None:
    pos = 0
    for offset, length in extents:
        arena[offset : offset + length].copy_(src[pos : pos + length])
        pos += length
    if pos != src.numel():
        raise ValueError(f"extents hold {pos} B, the block is {src.numel()} B")


def _gather(arena: torch.Tensor, extents: Sequence[Sequence[int]], nbytes: int) -> torch.Tensor:
    total = sum(length for _, length in extents)
    if total != nbytes:
        raise ValueError(f"extents hold {total} B, the block is {nbytes} B")
    return torch.cat([arena[offset : offset + length] for offset, length in extents])
