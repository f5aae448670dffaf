"""Batched gather/scatter between vLLM's paged KV cache and flat block payloads.

Device-agnostic torch: the same code runs on CPU (tests, CPU engines) and on
CUDA. A step moves all its blocks with one `index_select` / `index_copy_` per
layer (or one for all layers, see "fused" below) plus one copy per run of
adjacent bytes between the staging buffer and the arena or GPU pool; never one
copy per block. `kv_copy` (the CPU connector's block-at-a-time path) defines
the same payload; this module is its batched, streamed counterpart.

Per-layer KV layouts tested (the tensors vLLM passes to `register_kv_caches`)
----------------------------------------------------------------------------
- `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, K and V concatenated
  in the last dim: vLLM >= 0.32 (RFC #42082) for every backend. The CPU backend
  uses physical LBHNC (contiguous); flash-attn on CUDA reads it as
  `kv.transpose(1, 2).split(head_size, -1)` and is usually physical LBNHC, so
  the view is strided. All layers are views into one allocation.
- `[2, num_blocks, block_size, num_kv_heads, head_size]`: the older flash-attn
  "NHD" layout (a K plane and a V plane per layer).
- `[num_blocks, 2, block_size, num_kv_heads, head_size]`: the older FlashInfer NHD layout.
Any stride order works as long as the innermost dim is dense.

Block payload (shared with kv_copy)
-----------------------------------
The block dim is the first dim of size `num_blocks` (`kv_copy.block_major`).
Block b's payload is, for each layer in registration order, the layer's block
slice in *logical* row-major order (new layout: H, N, 2D; old flash-attn: the K
block then the V block). For physically contiguous layouts that is a plain byte
copy; for strided ones (LBNHC) the gather kernel does the permutation. When a
manager block is split into k kernel blocks the tensor has k * num_blocks
blocks and a payload layer holds the k kernel blocks in order. Layers that
alias one tensor (vLLM cross-layer KV sharing) are passed once (`unique_layers`).

Fused path: when all layers are views into one allocation at a constant layer
stride with dense blocks (vLLM >= 0.32 with LBHNC or BLHNC), `PagedKV.fused` is
a `[num_blocks, L, layer_bytes]` byte view and a step's gather or scatter is a
single kernel.

`StreamedCopier` runs a save or load on a side CUDA stream (tiers.gpu owns the
stream and events) and returns a `Ticket`; on CPU it runs synchronously and
the ticket is done at once. Nothing here synchronizes the device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from connectors.kv_copy import block_major
from tiers import gpu


@dataclass(frozen=True)
class PagedKV:
    """Byte views of one worker's KV layers, in payload order."""

    layers: tuple  # per layer: uint8 view [num_blocks, ...], dim 0 = block
    num_blocks: int
    layer_bytes: int
    fused: torch.Tensor | None  # uint8 [num_blocks, L, layer_bytes], or None

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def unique_layers(kv_caches: dict) -> list:
    """The KV tensors of `register_kv_caches`, minus layers that alias an earlier one."""
    seen: set = set()
    out = []
    for name, t in kv_caches.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def paged_kv(layers: Sequence[torch.Tensor], num_blocks: int) -> PagedKV:
    """Byte views of a worker's KV tensors (same shape, dtype, device), block dim first.

    The block dim is found as `kv_copy.block_major` finds it, so a payload is
    byte-identical to the CPU connector's. Kernel blocks that split a manager
    block stay together: ids are always manager block ids.
    """
    if not layers:
        raise ValueError("no KV layers")
    views = []
    for kv in layers:
        v = block_major(kv, num_blocks)
        if v.stride(-1) != 1:
            raise ValueError(f"the innermost dim of KV tensor {tuple(kv.shape)} must be dense (stride 1)")
        views.append(v.view(torch.uint8))
    first = views[0]
    if any(v.shape != first.shape or v.device != first.device for v in views):
        raise ValueError("all KV layers must have one shape, dtype and device")
    layer_bytes = first[0].numel()
    return PagedKV(tuple(views), num_blocks, layer_bytes, _fused_view(tuple(views), layer_bytes))


def _fused_view(views: tuple, layer_bytes: int) -> torch.Tensor | None:
    first = views[0]
    if any(not v[0].is_contiguous() or v.stride(0) != first.stride(0) for v in views):
        return None
    if len({v.untyped_storage().data_ptr() for v in views}) != 1:
        return None
    offsets = [v.storage_offset() for v in views]
    layer_stride = offsets[1] - offsets[0] if len(views) > 1 else layer_bytes
    if layer_stride < layer_bytes or any(o != offsets[0] + i * layer_stride for i, o in enumerate(offsets)):
        return None  # overlapping or irregular layers: go layer by layer
    size = (first.shape[0], len(views), layer_bytes)
    return torch.as_strided(first, size, (first.stride(0), layer_stride, 1), offsets[0])


def _check_ids(block_ids: Sequence[int], num_blocks: int, unique: bool) -> list[int]:
    ids = [int(b) for b in block_ids]
    if not ids:
        raise ValueError("no block ids")
    if min(ids) < 0 or max(ids) >= num_blocks:
        raise IndexError(f"block ids must be in [0, {num_blocks}), got {min(ids)}..{max(ids)}")
    if unique and len(set(ids)) != len(ids):
        raise ValueError("a block id appears twice in one scatter")
    return ids


# -- the kernels: ids is an int64 tensor on kv's device, checked by the caller --
def gather(kv: PagedKV, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = payload of block ids[i]; out is contiguous uint8 [n, block_bytes]."""
    n, num_layers = ids.numel(), len(kv.layers)
    out3 = out.view(n, num_layers, kv.layer_bytes)
    if kv.fused is not None:
        torch.index_select(kv.fused, 0, ids, out=out3)
        return
    for i, v in enumerate(kv.layers):
        out3[:, i].copy_(v.index_select(0, ids).view(n, kv.layer_bytes))


def scatter_layer(kv: PagedKV, layer: int, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write layer `layer` of payloads src[i] into block ids[i]; ids must be unique."""
    v = kv.layers[layer]
    rows = src.view(ids.numel(), len(kv.layers), kv.layer_bytes)[:, layer]
    v.index_copy_(0, ids, rows.view(ids.numel(), *v.shape[1:]))


def scatter(kv: PagedKV, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write payloads src[i] (uint8 [n, block_bytes]) into block ids[i], all layers."""
    if kv.fused is not None:
        kv.fused.index_copy_(0, ids, src.view(ids.numel(), len(kv.layers), kv.layer_bytes))
        return
    for layer in range(len(kv.layers)):
        scatter_layer(kv, layer, ids, src)


# -- staged transfers with events ---------------------------------------------
@dataclass
class Ticket:
    """One submitted save or load. Events are None on CPU, where all is done at once."""

    stream: object  # gpu.TransferStream, or None on CPU
    done_event: object = None
    layer_events: list = field(default_factory=list)  # loads: one per layer, in order
    gathered_event: object = None  # saves: the KV blocks have been read into staging
    keep: tuple = ()  # buffers the copies still use

    def ready(self) -> bool:
        """Polls without blocking (for get_finished / commit / release)."""
        return self.done_event is None or self.stream.is_done(self.done_event)

    def wait_layer(self, layer: int) -> None:
        """Compute waits (on the GPU) until this layer's blocks are in place: wait_for_layer_load."""
        self._current_waits(self.layer_events[layer] if self.layer_events else self.done_event)

    def wait_all(self) -> None:
        """Compute waits (on the GPU) for the whole transfer: a non-layerwise load."""
        self._current_waits(self.done_event)

    def fence_source(self) -> None:
        """Compute waits (on the GPU) until a save has read its KV blocks: call before a
        step whose forward may overwrite them (vLLM can free and reuse a saved block)."""
        self._current_waits(self.gathered_event)

    def synchronize(self) -> None:
        """The host blocks until done; never on the forward path."""
        if self.done_event is not None:
            self.stream.synchronize(self.done_event)

    def _current_waits(self, event) -> None:
        if event is not None:
            self.stream.make_current_wait(event)


class StreamedCopier:
    """Saves and loads of whole steps: paged KV <-> staging <-> extents of a flat byte tensor.

    `flat` is the arena (a `pin_host` tensor) or a GPU pool opened by IPC;
    `extents[i]` are block i's extents in it. On CUDA everything runs on a side
    stream that first waits for the current stream; on CPU it runs inline.
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.stream = gpu.TransferStream(self.device) if self.device.type == "cuda" else None

    def save(self, kv: PagedKV, block_ids: Sequence[int], flat: torch.Tensor, extents: Sequence) -> Ticket:
        ids = _check_ids(block_ids, kv.num_blocks, unique=False)
        runs = self._runs(kv, extents, len(ids), to_staging=False)
        with self._submit():
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            gather(kv, self._index(ids), staging)
            gathered = self._record()
            gpu.copy_runs(flat, staging.view(-1), runs)
            return Ticket(self.stream, self._record(), gathered_event=gathered, keep=(staging,))

    def load(self, kv: PagedKV, block_ids: Sequence[int], flat: torch.Tensor, extents: Sequence,
             layerwise: bool = True) -> Ticket:  # fmt: skip
        """Copy blocks in; with `layerwise`, one event per layer for wait_for_layer_load."""
        ids = _check_ids(block_ids, kv.num_blocks, unique=True)
        runs = self._runs(kv, extents, len(ids), to_staging=True)
        with self._submit():
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            ids_t = self._index(ids)
            gpu.copy_runs(staging.view(-1), flat, runs)
            events = []
            if layerwise:
                for layer in range(len(kv.layers)):
                    scatter_layer(kv, layer, ids_t, staging)
                    events.append(self._record())
            else:
                scatter(kv, ids_t, staging)
            done = events[-1] if events else self._record()
            return Ticket(self.stream, done, events if self.stream else [], keep=(staging,))

    def _submit(self):
        return self.stream.submit() if self.stream is not None else contextlib.nullcontext()

    def _record(self):
        return self.stream.record() if self.stream is not None else None

    def _index(self, ids: list[int]) -> torch.Tensor:
        if self.stream is not None:
            return self.stream.to_device(ids)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    @staticmethod
    def _runs(kv: PagedKV, extents: Sequence, n: int, to_staging: bool) -> list:
        if len(extents) != n:
            raise ValueError(f"{n} blocks but {len(extents)} extent lists")
        for block in extents:
            if sum(length for _, length in block) != kv.block_bytes:
                raise ValueError(f"a block's extents hold {sum(n for _, n in block)} B, not {kv.block_bytes} B")
        flat_ext = [list(e) for block in extents for e in block]
        staging_ext = [[0, n * kv.block_bytes]]
        if to_staging:
            return gpu.plan_runs(staging_ext, flat_ext)
        return gpu.plan_runs(flat_ext, staging_ext)
