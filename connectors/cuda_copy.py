"""Batched gather/scatter between vLLM's paged KV cache and flat block payloads.

Device-agnostic torch: the same code runs on CPU (tests, CPU engines) and on
CUDA. A step moves all its blocks with one `index_select` / `index_copy_` per
layer (or one for all layers, see "fused" below) plus one copy per run of
adjacent bytes between the staging buffer and the arena or GPU pool; never one
copy per block.

Per-layer KV layouts (the tensor vLLM passes to `register_kv_caches`)
---------------------------------------------------------------------
- "BHNC": logical `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, K and
  V concatenated in the last dim. This is vLLM >= 0.32 (RFC #42082) for every
  backend: the CPU backend (physical LBHNC: contiguous) and flash-attn on CUDA
  (which reads `kv.transpose(1, 2).split(head_size, -1)`; physical LBNHC makes
  the view strided). Any stride order works as long as the last dim is dense.
- "2BNHD": `[2, num_blocks, block_size, num_kv_heads, head_size]`, the older
  flash-attn "NHD" layout (K plane, V plane).
- "B2NHD": `[num_blocks, 2, block_size, num_kv_heads, head_size]`, the older
  FlashInfer NHD layout.

Block payload
-------------
Block b's payload is, for each layer in registration order, the bytes of the
layer's block view `[b]` in *logical* row-major order (BHNC: H, N, 2D; 2BNHD:
K block then V block). For physically contiguous layouts that is a plain byte
copy; for strided ones (LBNHC) the gather kernel does the permutation, so the
payload does not depend on the physical layout. Layers that alias one tensor
(vLLM cross-layer KV sharing) must be passed once (`unique_layers`).

Block ids index dim 0 of the block view: vLLM *kernel* blocks. When the kernel
block is smaller than the manager block, expand ids with `kernel_block_ids`.

Fused path: when all layers are views into one allocation at a constant
layer stride with dense blocks (vLLM >= 0.32 allocates one buffer; LBHNC
qualifies), `PagedKV.fused` is a `[num_blocks, L, layer_bytes]` byte view and a
whole step's gather or scatter is a single kernel.

`StreamedCopier` runs a save or load on a side CUDA stream (tiers.gpu owns the
stream and events) and returns a `Ticket`; on CPU it runs synchronously and
the ticket is done at once. Nothing here synchronizes the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tiers import gpu

LAYOUTS = ("BHNC", "2BNHD", "B2NHD")


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


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """Manager block ids -> kernel block ids when one manager block is `ratio` kernel blocks."""
    return [b * ratio + j for b in block_ids for j in range(ratio)]


def block_view(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """A uint8 view with the block as dim 0; raises ValueError for an unknown layout."""
    dims = {"BHNC": 4, "2BNHD": 5, "B2NHD": 5}
    if layout not in dims:
        raise ValueError(f"unknown KV layout {layout!r}; supported: {LAYOUTS}")
    if kv.dim() != dims[layout]:
        raise ValueError(f"layout {layout} wants a {dims[layout]}-d tensor, got shape {tuple(kv.shape)}")
    if layout == "2BNHD":
        if kv.shape[0] != 2:
            raise ValueError(f"layout 2BNHD wants dim 0 == 2 (K, V), got shape {tuple(kv.shape)}")
        kv = kv.transpose(0, 1)
    elif layout == "B2NHD" and kv.shape[1] != 2:
        raise ValueError(f"layout B2NHD wants dim 1 == 2 (K, V), got shape {tuple(kv.shape)}")
    if kv.stride(-1) != 1:
        raise ValueError("the innermost KV dim must be dense (stride 1)")
    return kv.view(torch.uint8)


def paged_kv(layers: Sequence[torch.Tensor], layout: str) -> PagedKV:
    """Validate a worker's KV tensors (same shape, dtype, device) and build their byte views."""
    if not layers:
        raise ValueError("no KV layers")
    views = tuple(block_view(kv, layout) for kv in layers)
    first = views[0]
    for v in views[1:]:
        if v.shape != first.shape or v.device != first.device:
            raise ValueError("all KV layers must have one shape, dtype and device")
    layer_bytes = first[0].numel()
    return PagedKV(views, first.shape[0], layer_bytes, _fused_view(views, layer_bytes))


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
    """One submitted save or load. Holds its buffers alive until it is done."""

    copier: "StreamedCopier"
    done_event: object = None  # torch.cuda.Event, None on CPU
    layer_events: list = field(default_factory=list)  # loads: one per layer, in order
    keep: tuple = ()

    def ready(self) -> bool:
        """Polls without blocking (for get_finished / commit)."""
        return self.done_event is None or self.copier.stream.is_done(self.done_event)

    def wait_layer(self, layer: int) -> None:
        """Compute waits (on the GPU) until this layer's blocks are in place: wait_for_layer_load."""
        if self.layer_events:
            self.copier.stream.make_current_wait(self.layer_events[layer])

    def wait_all(self) -> None:
        """Compute waits (on the GPU) for the whole transfer: a non-layerwise load."""
        if self.done_event is not None:
            self.copier.stream.make_current_wait(self.done_event)

    def synchronize(self) -> None:
        """The host blocks until done; never on the forward path."""
        if self.done_event is not None:
            self.copier.stream.synchronize(self.done_event)


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
        if self.stream is None:
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            gather(kv, torch.tensor(ids, dtype=torch.int64), staging)
            gpu.copy_runs(flat, staging.view(-1), runs)
            return Ticket(self)
        with self.stream.submit():
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            gather(kv, self.stream.to_device(ids), staging)
            gpu.copy_runs(flat, staging.view(-1), runs)
            return Ticket(self, self.stream.record(), keep=(staging,))

    def load(self, kv: PagedKV, block_ids: Sequence[int], flat: torch.Tensor, extents: Sequence,
             layerwise: bool = True) -> Ticket:  # fmt: skip
        """Copy blocks in; with `layerwise`, one event per layer for wait_for_layer_load."""
        ids = _check_ids(block_ids, kv.num_blocks, unique=True)
        runs = self._runs(kv, extents, len(ids), to_staging=True)
        if self.stream is None:
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            gpu.copy_runs(staging.view(-1), flat, runs)
            scatter(kv, torch.tensor(ids, dtype=torch.int64), staging)
            return Ticket(self)
        with self.stream.submit():
            staging = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8, device=self.device)
            ids_t = self.stream.to_device(ids)
            gpu.copy_runs(staging.view(-1), flat, runs)
            events = []
            if layerwise:
                for layer in range(len(kv.layers)):
                    scatter_layer(kv, layer, ids_t, staging)
                    events.append(self.stream.record())
            else:
                scatter(kv, ids_t, staging)
            done = events[-1] if events else self.stream.record()
            return Ticket(self, done, events, keep=(staging,))

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
