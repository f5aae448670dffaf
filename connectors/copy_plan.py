"""Copy plans: a step's KV transfer as data, built in NumPy, run by an executor (copy_exec.py).

A plan is three equal-length uint64 arrays — source address, destination
address, bytes — plus the layer of each piece. It says nothing about how the
bytes move: memmove on CPU, one `cuMemcpyBatchAsync` on the copy engines, or
one Triton kernel launch all run the same plan.

The engine side of a plan comes from `KVGeometry`: where one engine block's
payload lives in the engine's KV memory. A block's payload is, layer after
layer in registration order, the bytes of the block's slice of that layer in
the tensor's own memory order (a layout is part of the store's namespace, so
every engine that shares a block stores it the same way). A layer's slice is
cut into as few dense pieces as its strides allow:

- vLLM >= 0.32, layer-outer (`LBHNC`, `LBNHC`, CPU_ATTN's layout): one piece
  per (block, layer); the K and V halves sit together in the last dim.
- Older K/V-plane layouts (`[2, num_blocks, N, H, D]` per layer): two pieces
  per (block, layer), K then V.
- Block-outermost (`BLHNC`, `BLNHC`): a block's layers are adjacent, so its
  pieces merge into one whole-block piece — a load or save is one copy per block.

The store side is a list of extents per block (`[offset, length]` runs of the
arena or a GPU pool, relative to a base address). `build_plan` cuts pieces at
extent boundaries and merges runs that are adjacent on both sides, all in
vectorised NumPy: its Python work does not grow with the number of layers.

Only torch tensors' metadata is read here (shapes, strides, addresses); no
bytes move and no CUDA call is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

LAYERS_MERGED = -1  # a piece that spans several layers (block-outermost layouts)


@dataclass(frozen=True)
class CopyPlan:
    """Pieces to copy: src[i] -> dst[i], size[i] bytes; layer[i] is the engine layer of the piece."""

    src: np.ndarray  # uint64 addresses
    dst: np.ndarray  # uint64 addresses
    size: np.ndarray  # uint64 bytes
    layer: np.ndarray  # int32, LAYERS_MERGED where a piece spans layers

    def __len__(self) -> int:
        return int(self.size.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())

    def reversed(self) -> "CopyPlan":
        """The same pieces the other way (a load's plan as a save's)."""
        return CopyPlan(self.dst, self.src, self.size, self.layer)

    def take(self, mask: np.ndarray) -> "CopyPlan":
        return CopyPlan(self.src[mask], self.dst[mask], self.size[mask], self.layer[mask])

    def by_layer(self, order: Sequence[int]) -> list["CopyPlan"]:
        """One plan per layer, in `order` (layer-wise loads). Needs per-layer pieces."""
        if len(self) and (self.layer == LAYERS_MERGED).any():
            raise ValueError("the plan's pieces span layers (a block-outermost layout): copy whole blocks")
        if not len(self):
            return [self for _ in order]
        idx = np.argsort(self.layer, kind="stable")  # each layer's pieces keep their order
        sorted_layer = self.layer[idx]
        lo = np.searchsorted(sorted_layer, order, side="left")
        hi = np.searchsorted(sorted_layer, order, side="right")
        return [self.take(idx[a:b]) for a, b in zip(lo.tolist(), hi.tolist())]


EMPTY_PLAN = CopyPlan(*(np.zeros(0, np.uint64) for _ in range(3)), np.zeros(0, np.int32))


@dataclass(frozen=True)
class KVGeometry:
    """Where each block's payload lives in an engine's KV memory: P pieces, the same for every block.

    Piece p of block b covers payload bytes [payload[p], payload[p] + size[p]) and sits at
    address `addr0[p] + b * stride[p]`.
    """

    num_blocks: int
    block_bytes: int
    layer_bytes: tuple  # payload bytes of each layer
    payload: np.ndarray  # int64 [P]
    size: np.ndarray  # int64 [P]
    addr0: np.ndarray  # uint64 [P]
    stride: np.ndarray  # int64 [P]
    layer: np.ndarray  # int32 [P]
    device: str  # "cpu", "cuda:0", ...

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def block_outermost(self) -> bool:
        """True when a block's payload is one contiguous run of KV memory (one copy per block)."""
        return self.size.size == 1

    @cached_property
    def tiles_block(self) -> bool:
        """True when the pieces, in order, tile a block's payload from byte 0 with no gap."""
        ends = self.payload + self.size
        return bool(self.payload[0] == 0 and (self.payload[1:] == ends[:-1]).all() and ends[-1] == self.block_bytes)

    @property
    def layer_wise(self) -> bool:
        """True when every piece belongs to one layer, so loads can follow the forward layer by layer."""
        return bool((self.layer != LAYERS_MERGED).all())

    def span(self) -> tuple[int, int]:
        """[lowest, highest) address of KV memory any block of this geometry touches."""
        last = self.addr0.astype(np.int64) + (self.num_blocks - 1) * self.stride
        lo = int(min(self.addr0.min(), last.min()))
        hi = int(max((self.addr0.astype(np.int64) + self.size).max(), (last + self.size).max()))
        return lo, hi


def block_dim(shape: Sequence[int], num_blocks: int) -> tuple[int, int]:
    """(the block dim of a KV tensor, kernel blocks per manager block).

    The block dim is the first of size `num_blocks`, else the first of a multiple of it
    (`k * num_blocks` when the attention kernel splits each block into `k` kernel blocks;
    those stay together as one block).
    """
    exact = [d for d, size in enumerate(shape) if size == num_blocks]
    if exact:
        return exact[0], 1
    multiple = [d for d, size in enumerate(shape) if size > num_blocks and size % num_blocks == 0]
    if multiple:
        return multiple[0], shape[multiple[0]] // num_blocks
    raise ValueError(f"no dimension of KV tensor {tuple(shape)} is a multiple of {num_blocks} blocks")


def _dense_pieces(shape: Sequence[int], strides: Sequence[int]) -> tuple[list[int], int]:
    """Cut an array (element shape and strides) into dense runs: (start of each run in elements, in
    memory order; elements per run). Dims are taken outermost first by stride."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)[::-1]  # by stride, descending
    if any(st <= 0 for st, _ in dims):
        raise ValueError(f"KV strides {tuple(strides)} are not positive")
    run = 1
    while dims and dims[-1][0] == run:  # the dense suffix: each dim's stride is the elements inside it
        run *= dims.pop()[1]
    if run == 1 and dims:
        raise ValueError(f"the innermost dim of a KV tensor (strides {tuple(strides)}) must be dense (stride 1)")
    starts = [0]
    for st, sz in dims[::-1]:  # innermost outer dim first, so the outermost varies slowest
        starts = [s + i * st for s in starts for i in range(sz)]
    return sorted(starts), run


def kv_geometry(tensors: Sequence, num_blocks: int) -> KVGeometry:
    """The geometry of an engine's per-layer KV tensors (vLLM's `register_kv_caches` values, in
    payload order). Tensors may be views into one allocation (vLLM >= 0.32) or separate ones; every
    layer must sit on one device. Raises ValueError for a layout it cannot express."""
    if not tensors:
        raise ValueError("no KV tensors")
    devices = {str(t.device) for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"KV layers on several devices: {sorted(devices)}")
    payload, size, addr0, stride, layer, layer_bytes = [], [], [], [], [], []
    pos = 0
    for index, t in enumerate(tensors):
        dim, k = block_dim(t.shape, num_blocks)
        elt = t.element_size()
        shape = list(t.shape)
        strides = list(t.stride())
        # the block's slice: the block dim dropped (a split block keeps its k kernel blocks as a dim)
        block_stride = strides[dim] * k
        inner_shape = shape[:dim] + ([k] if k > 1 else []) + shape[dim + 1 :]
        inner_strides = strides[:dim] + ([strides[dim]] if k > 1 else []) + strides[dim + 1 :]
        starts, run = _dense_pieces(inner_shape, inner_strides)
        base = t.data_ptr()
        for s in starts:
            payload.append(pos)
            size.append(run * elt)
            addr0.append(base + s * elt)
            stride.append(block_stride * elt)
            layer.append(index)
            pos += run * elt
        layer_bytes.append(len(starts) * run * elt)
    geom = _merged(payload, size, addr0, stride, layer)
    return KVGeometry(num_blocks, pos, tuple(layer_bytes), *geom, device=devices.pop())


def _merged(payload, size, addr0, stride, layer) -> tuple:
    """Merge piece p+1 into p where it follows p in memory for every block (same block stride)."""
    out = [[payload[0], size[0], addr0[0], stride[0], layer[0]]]
    for p in range(1, len(size)):
        last = out[-1]
        if last[2] + last[1] == addr0[p] and last[3] == stride[p]:
            last[1] += size[p]
            if last[4] != layer[p]:
                last[4] = LAYERS_MERGED
        else:
            out.append([payload[p], size[p], addr0[p], stride[p], layer[p]])
    cols = list(zip(*out))
    return (np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.uint64),
            np.array(cols[3], np.int64), np.array(cols[4], np.int32))


def flat_extents(extents: Sequence[Sequence[Sequence[int]]], block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of every extent of every block, in order; each block's must total block_bytes."""
    counts = np.fromiter((len(e) for e in extents), np.int64, len(extents))
    if counts.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if (counts == 0).any():
        raise ValueError("a block with no extents")
    flat = np.array([run for block in extents for run in block], dtype=np.int64).reshape(-1, 2)
    offsets, lengths = flat[:, 0], flat[:, 1]
    if (offsets < 0).any() or (lengths <= 0).any():
        raise ValueError("extents need offsets >= 0 and lengths > 0")
    totals = np.add.reduceat(lengths, np.concatenate(([0], np.cumsum(counts)[:-1])))
    bad = np.nonzero(totals != block_bytes)[0]
    if bad.size:
        raise ValueError(f"block {int(bad[0])}'s extents hold {int(totals[bad[0]])} B, a block is {block_bytes} B")
    return offsets, lengths


def build_plan(geom: KVGeometry, block_ids: Sequence[int], extents: Sequence, base: int, to_kv: bool,
               merge_layers: bool = True) -> CopyPlan:
    """The plan that moves blocks between the store and the engine's KV.

    `block_ids[i]` is the engine block of the store block held at `extents[i]` (offsets relative
    to the address `base`: the arena's or a GPU pool's). `to_kv`: a load (store -> KV), else a save.
    Runs adjacent on both sides are merged; across layers only with `merge_layers` (a whole-step
    copy; layer-wise loads keep layers apart).
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    n = ids.size
    if len(extents) != n:
        raise ValueError(f"{n} blocks but {len(extents)} extent lists")
    if n == 0:
        return EMPTY_PLAN
    if ids.min() < 0 or ids.max() >= geom.num_blocks:
        raise IndexError(f"block ids must be in [0, {geom.num_blocks}), got {int(ids.min())}..{int(ids.max())}")
    if to_kv and np.unique(ids).size != n:
        raise ValueError("a block id appears twice in one load")
    offsets, lengths = flat_extents(extents, geom.block_bytes)
    bb, num_pieces = geom.block_bytes, geom.size.size
    # payload coordinates over the whole step: block i's byte j is i * block_bytes + j
    piece_start = (np.arange(n, dtype=np.int64)[:, None] * bb + geom.payload[None, :]).reshape(-1)
    piece_addr = (geom.addr0.astype(np.int64)[None, :] + ids[:, None] * geom.stride[None, :]).reshape(-1)
    piece_layer = np.broadcast_to(geom.layer, (n, num_pieces)).reshape(-1)
    ext_addr = np.int64(base) + offsets
    if offsets.size == n and geom.tiles_block:  # one run per block (the usual arena page): cut at pieces only
        store_addr = np.repeat(ext_addr, num_pieces) + np.tile(geom.payload, n)
        src, dst = (store_addr, piece_addr) if to_kv else (piece_addr, store_addr)
        return _merge_runs(src, dst, np.tile(geom.size, n), piece_layer, merge_layers)
    ext_start = np.cumsum(lengths) - lengths  # each block's extents total block_bytes (checked above)
    starts = np.union1d(piece_start, ext_start)
    sizes = np.diff(np.append(starts, n * bb))
    pi = np.searchsorted(piece_start, starts, side="right") - 1
    ei = np.searchsorted(ext_start, starts, side="right") - 1
    kv_addr = piece_addr[pi] + (starts - piece_start[pi])
    store_addr = ext_addr[ei] + (starts - ext_start[ei])
    layers = piece_layer[pi]
    src, dst = (store_addr, kv_addr) if to_kv else (kv_addr, store_addr)
    return _merge_runs(src, dst, sizes, layers, merge_layers)


def _merge_runs(src: np.ndarray, dst: np.ndarray, size: np.ndarray, layer: np.ndarray, merge_layers: bool) -> CopyPlan:
    """Merge run k+1 into run k where both its source and destination follow run k's."""
    follows = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    if not merge_layers:
        follows &= layer[1:] == layer[:-1]
    first = np.concatenate(([True], ~follows))
    heads = np.nonzero(first)[0]
    merged_size = np.add.reduceat(size, heads)
    merged_layer = layer[heads].astype(np.int32)
    if merge_layers and heads.size < size.size:  # a run that swallowed another layer's spans layers
        group = np.cumsum(first) - 1
        spans = np.zeros(heads.size, bool)
        np.logical_or.at(spans, group[1:][follows], layer[1:][follows] != layer[:-1][follows])
        merged_layer[spans] = LAYERS_MERGED
    return CopyPlan(src[heads].astype(np.uint64), dst[heads].astype(np.uint64), merged_size.astype(np.uint64),
                    merged_layer)
