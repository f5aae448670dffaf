"""A lossy codec for stored KV blocks: per (layer, KV head, K/V) bit widths, a full block back.

vLLM's paged cache needs every position of a block, so no token is ever dropped:
a group that matters less gets fewer bits instead. A *group* is the block's
`block_tokens x head_size` slice of one layer's keys or values for one KV head.
Each group has its own width (`Budget.bits[layer, head, 0 = K | 1 = V]`):

- 2..8 bits: uniform asymmetric quantization, a float16 scale and minimum per
  token (row) of the group, or per channel (column) for keys with
  `key_mode="channel"` (KIVI's keys-per-channel); codes packed as bit planes
  (plane j holds bit j of every code, little-endian bit order), so every width
  packs the same way and a decoder reads it the same way.
- 16: exact, the group's elements in the block's own dtype.
- `rotate`: each token's vector is multiplied by the normalized Walsh-Hadamard
  matrix before quantizing (and again after, it is its own inverse): channel
  outliers are spread over all channels. The butterflies run in a fixed order
  so that every decoder (this one, the Triton kernel) rounds the same way.

A block's layout (`BlockLayout`) says where each (layer, head, K/V, token,
channel) element sits in the payload: the codec reads and writes the payload in
the engine's own layout, the one its namespace declares.

An encoded block decodes alone: a 32-byte header (magic, version, flags, the
layout, the body's length and xxh3_64) is followed by the bits table and the
groups. Groups are stored sorted by (bits, quantization mode, group index), so
the groups of one kind are contiguous; `group_offsets` gives every decoder the
same offsets. A blob whose header, length, layout or checksum does not match
raises `CorruptBlock` and nothing is written.

The per-token quantized groups' per-element work runs in compiled loops when
numba is installed (kvstore/codec_fast.py), byte-exact with the NumPy code here.

Invariants: keys never get fewer bits than the values of the same head; the
encoded size depends on the layout and the budget only (`encoded_bytes`), never
on the data, so a tier can allocate before it encodes.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvstore import codec_fast

if TYPE_CHECKING:
    from kvstore.keys import Namespace

DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
# a layer's slice of a block, outermost dim first (C = K|V halves of a token's row, KV = K|V planes);
# appended only: a blob's header stores the index
ORDERS = ("HNC", "NHC", "KVNHD", "KVHND", "HKTVND", "AMX")
WIDTHS = (2, 3, 4, 5, 6, 7, 8, 16)  # 16: exact
EXACT = 16
MAGIC, VERSION = b"KVQ1", 1
HEADER = struct.Struct("<4sBBHHHHBBHxxIQ")  # magic version flags L H N D dtype order splits (pad) body_len xxh3
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 32
FLAG_ROTATE, FLAG_KEY_CHANNEL = 1, 2
META_BYTES = 4  # a float16 scale and a float16 minimum per row (or column)


class CorruptBlock(ValueError):
    """An encoded block that is not what its reader expects: torn, foreign, or damaged."""


@dataclass(frozen=True)
class BlockLayout:
    """Where each element of a block sits in its payload.

    Per layer, layer after layer, the block's slice in memory order: `HNC`
    (vLLM >= 0.32 on CUDA: heads, tokens, then K and V halves of the last dim,
    as flash-attn splits it), `NHC`, the older K/V planes `KVNHD` / `KVHND`,
    or `HKTVND` (vLLM's CPU_ATTN with its `vec` and `vec16` kernels: the same
    [H, N, 2D] bytes, which it cuts per head into a key half and a value half;
    the keys are stored transposed, [D, N], channel after channel, the values
    [N, D]), or `AMX` (its AMX kernels, bfloat16: the same halves in VNNI
    tiles, keys as rows of 16 tokens by channel pairs, values as columns of 16
    channels by token pairs; `axes` says where each element is).
    `splits` > 1: the attention kernel cut the block into that many kernel
    blocks, each laid out alone (`HNC` only).
    """

    num_layers: int
    num_kv_heads: int
    block_tokens: int
    head_size: int
    dtype: str = "bfloat16"
    order: str = "HNC"
    splits: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_tokens", "head_size", "splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value >= 1 << 16:
                raise ValueError(f"layout {name} must be an int in [1, 65535], got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"the codec stores {sorted(DTYPES)}, not {self.dtype!r}")
        if self.order not in ORDERS:
            raise ValueError(f"layout order must be one of {ORDERS}, got {self.order!r}")
        if self.splits > 1 and (self.order != "HNC" or self.block_tokens % self.splits):
            raise ValueError("a split block needs the HNC order and block_tokens divisible by splits")
        if self.head_size & (self.head_size - 1) or (self.block_tokens * self.head_size) % 8:
            raise ValueError("head_size must be a power of two and block_tokens * head_size a multiple of 8")
        if self.order == "AMX" and (self.dtype != "bfloat16" or self.block_tokens % 16 or self.head_size % 16):
            raise ValueError("the AMX layout holds bfloat16 blocks of 16 tokens and channels at a time")

    @property
    def elt_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def layer_elems(self) -> int:
        return self.num_kv_heads * self.block_tokens * 2 * self.head_size

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_elems * self.elt_bytes

    @property
    def num_groups(self) -> int:
        return self.num_layers * self.num_kv_heads * 2

    def strides(self) -> tuple[int, int, int, int, int]:
        """Element strides inside a layer: (K/V, head, token outer, token inner, tokens per inner run)."""
        H, N, D = self.num_kv_heads, self.block_tokens, self.head_size
        if self.order == "HNC":
            n_in = N // self.splits
            return D, n_in * 2 * D, H * n_in * 2 * D, 2 * D, n_in
        if self.order == "NHC":
            return D, 2 * D, 0, H * 2 * D, N
        if self.order == "KVNHD":
            return N * H * D, D, 0, H * D, N
        if self.order == "HKTVND":  # the values' strides; the keys': key_strides()
            return N * D, 2 * N * D, 0, D, N
        if self.order == "AMX":  # K/V and head strides; tokens and channels: axes()
            return N * D, 2 * N * D, 0, 0, N
        return H * N * D, N * D, 0, D, N  # KVHND

    def key_strides(self) -> tuple[int, int]:
        """(token inner, channel) element strides of the keys (the values': (strides()[3], 1))."""
        if self.order == "HKTVND":
            return 1, self.block_tokens
        return self.strides()[3], 1

    def axes(self) -> tuple[tuple[int, int, int, int, int, int], tuple[int, int, int, int, int, int]]:
        """Where token t, channel c of a group is, from the group's first element, for the keys and for
        the values: (tn, t_outer, t_inner, cn, c_outer, c_inner) means (t // tn) * t_outer + (t % tn) *
        t_inner + (c // cn) * c_outer + (c % cn) * c_inner."""
        N, D = self.block_tokens, self.head_size
        if self.order == "AMX":
            return (16, 16 * D, 2, 2, 32, 1), (2, 32, 1, 16, 16 * N, 2)
        _, _, s_to, s_ti, n_in = self.strides()
        k_ti, k_c = self.key_strides()
        return (n_in, s_to, k_ti, D, 0, k_c), (n_in, s_to, s_ti, D, 0, 1)

    @classmethod
    def from_namespace(cls, ns: "Namespace") -> "BlockLayout | None":
        """The layout of a namespace's blocks, or None when the codec cannot read them (an MLA or unknown
        layout, a dtype it does not store, a block size that does not match the shape). The device matters:
        CPU_ATTN, vLLM's one CPU backend, keeps a head's keys transposed, then its values (`HKTVND`, as its
        `vec` kernels store them: tests/test_codec.py writes a block through them)."""
        name = ns.layout.split("/")
        kind = name[1] if len(name) > 1 else name[0]
        if "mla" in name[2:] or ns.dtype not in DTYPES:
            return None
        isa = [part[4:] for part in name[2:] if part.startswith("isa-")]  # CPU kernels other than vec's
        if isa and (isa != ["amx"] or name[0] != "cpu"):
            return None
        order = {"default": "HNC", "LBHNC": "HNC", "BLHNC": "HNC", "LHBNC": "HNC", "BHLNC": "HNC",
                 "LBNHC": "NHC", "BLNHC": "NHC", "NHD": "KVNHD", "HND": "KVHND"}.get(kind)
        if name[0] == "cpu" and order == "HNC":
            order = "AMX" if isa else "HKTVND"
        if order is None:
            return None
        try:
            layout = cls(ns.num_layers, ns.num_kv_heads, ns.block_tokens, ns.head_size, ns.dtype, order)
        except ValueError:
            return None
        return layout if layout.block_bytes == ns.block_bytes else None


@dataclass(frozen=True, eq=False)
class Budget:
    """Bits per (layer, KV head, K/V), and how groups are quantized."""

    bits: np.ndarray  # uint8 [layers, kv heads, 2]
    rotate: bool = True
    key_mode: str = "token"  # "token" | "channel"
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        bits = np.asarray(self.bits)
        if bits.ndim != 3 or bits.shape[2] != 2:
            raise ValueError(f"bits must be [layers, kv heads, 2], got shape {bits.shape}")
        if not np.isin(bits, WIDTHS).all():
            raise ValueError(f"bit widths must be in {WIDTHS}")
        if (bits[..., 0] < bits[..., 1]).any():
            raise ValueError("keys must get at least the bits of the values of the same head")
        if self.key_mode not in ("token", "channel"):
            raise ValueError(f"key_mode must be token or channel, got {self.key_mode!r}")
        object.__setattr__(self, "bits", bits.astype(np.uint8))

    @classmethod
    def uniform(cls, layout: BlockLayout, key_bits: int, value_bits: int | None = None, **kw) -> "Budget":
        bits = np.empty((layout.num_layers, layout.num_kv_heads, 2), np.uint8)
        bits[..., 0], bits[..., 1] = key_bits, key_bits if value_bits is None else value_bits
        return cls(bits, **kw)

    @property
    def flags(self) -> int:
        return (FLAG_ROTATE if self.rotate else 0) | (FLAG_KEY_CHANNEL if self.key_mode == "channel" else 0)

    def mean_bits(self) -> float:
        return float(self.bits.mean())

    def check_fits(self, layout: BlockLayout) -> None:
        if self.bits.shape != (layout.num_layers, layout.num_kv_heads, 2):
            raise ValueError(f"budget for {self.bits.shape[:2]} (layers, heads), block has "
                             f"({layout.num_layers}, {layout.num_kv_heads})")


# -- sizes and offsets (every decoder uses these) -----------------------------------------
def channel_groups(layout: BlockLayout, flags: int) -> np.ndarray:
    """bool [groups]: quantized per channel (keys with FLAG_KEY_CHANNEL)."""
    kv = np.tile(np.array([True, False]), layout.num_layers * layout.num_kv_heads)
    return kv & bool(flags & FLAG_KEY_CHANNEL)


def group_sizes(layout: BlockLayout, bits: np.ndarray, flags: int) -> np.ndarray:
    """Stored bytes of each group (index (layer * heads + head) * 2 + kv)."""
    b = bits.reshape(-1).astype(np.int64)
    N, D = layout.block_tokens, layout.head_size
    rows = np.where(channel_groups(layout, flags), D, N)
    return np.where(b == EXACT, N * D * layout.elt_bytes, rows * META_BYTES + b * (N * D // 8))


def group_order(layout: BlockLayout, bits: np.ndarray, flags: int) -> np.ndarray:
    """Group indices in stored order: by (bits, channel mode, index)."""
    g = np.arange(layout.num_groups)
    return np.lexsort((g, channel_groups(layout, flags), bits.reshape(-1)))


def group_offsets(layout: BlockLayout, bits: np.ndarray, flags: int) -> np.ndarray:
    """Byte offset of each group's data from the start of the blob, int64 [groups]."""
    sizes = group_sizes(layout, bits, flags)
    order = group_order(layout, bits, flags)
    offsets = np.empty_like(sizes)
    ordered = sizes[order]
    offsets[order] = np.cumsum(ordered) - ordered
    return offsets + HEADER_BYTES + layout.num_groups


def encoded_bytes(layout: BlockLayout, budget: Budget) -> int:
    budget.check_fits(layout)
    return _plan(layout, budget.bits.tobytes(), budget.flags, False, codec_fast.AVAILABLE).stored_bytes


# -- element conversions --------------------------------------------------------------------
def to_float32(payload: np.ndarray, dtype: str) -> np.ndarray:
    """A payload's elements as float32 (exact for every stored dtype)."""
    if dtype == "bfloat16":
        return (payload.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return payload.view(np.float16 if dtype == "float16" else np.float32).astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 elements in `dtype`, round to nearest even (bfloat16 by integer arithmetic, as the
    Triton kernel does), as raw uint8 bytes."""
    if dtype == "bfloat16":
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        return out.view(np.uint8)
    return np.ascontiguousarray(x, np.float16 if dtype == "float16" else np.float32).view(np.uint8)


def fwht(x: np.ndarray) -> np.ndarray:
    """Normalized Walsh-Hadamard transform of the last axis (a power of two), in float32. Stage h
    pairs element i with i + h inside runs of 2h: (a + b, a - b); then one scaling by 1/sqrt(D)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = np.ascontiguousarray(np.asarray(x, np.float32).reshape(-1, d).T)  # channel-major: long inner runs
    tmp = np.empty(y.size // 2, np.float32)
    h = 1
    while h < d:
        pairs = y.reshape(d // (2 * h), 2, -1)  # [run, a | b, h channels x vectors]
        a, b = pairs[:, 0], pairs[:, 1]
        diff = tmp.reshape(a.shape)
        np.subtract(a, b, out=diff)
        a += b
        b[...] = diff
        h *= 2
    y *= np.float32(1.0 / math.sqrt(d))
    return np.ascontiguousarray(y.T).reshape(*lead, d)


def _kv_views(flat: np.ndarray, layout: BlockLayout) -> tuple[np.ndarray, np.ndarray]:
    """Strided views of a block's keys and values, each [layers, heads, N / tn, tn, D / cn, cn] (`axes`)."""
    s_kv, s_h = layout.strides()[:2]
    L, H, N, D = layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_size
    e = flat.itemsize
    views = []
    for start, (tn, t_out, t_in, cn, c_out, c_in) in zip((0, s_kv), layout.axes()):
        shape = (L, H, N // tn, tn, D // cn, cn)
        strides = (layout.layer_elems * e, s_h * e, t_out * e, t_in * e, c_out * e, c_in * e)
        views.append(np.lib.stride_tricks.as_strided(flat[start:], shape, strides, writeable=flat.flags.writeable))
    return views[0], views[1]


def to_canonical(payload: np.ndarray, layout: BlockLayout) -> np.ndarray:
    """float32 [groups, tokens, channels] of a payload (uint8, block_bytes long)."""
    x = to_float32(np.ascontiguousarray(payload).view(np.uint8), layout.dtype)
    L, H, N, D = layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_size
    keys, values = (v.reshape(L, H, N, D) for v in _kv_views(x, layout))
    return np.stack((keys, values), axis=2).reshape(layout.num_groups, N, D)


def from_canonical(x: np.ndarray, layout: BlockLayout, out: np.ndarray) -> None:
    """Write float32 [groups, tokens, channels] into `out` (uint8, block_bytes) in the block's layout."""
    raw = from_float32(x, layout.dtype).view({2: np.uint16, 4: np.uint32}[layout.elt_bytes])
    keys, values = _kv_views(out.view(raw.dtype), layout)
    raw = raw.reshape(layout.num_layers, layout.num_kv_heads, 2, layout.block_tokens, layout.head_size)
    keys[...] = raw[:, :, 0].reshape(keys.shape)
    values[...] = raw[:, :, 1].reshape(values.shape)


# -- encode / decode -------------------------------------------------------------------------
def encode(payload: np.ndarray, layout: BlockLayout, budget: Budget) -> np.ndarray:
    """The encoded block (uint8) of a payload (uint8, `layout.block_bytes`) under `budget`."""
    budget.check_fits(layout)
    payload = np.asarray(payload).reshape(-1).view(np.uint8)
    if payload.size != layout.block_bytes:
        raise ValueError(f"payload is {payload.size} B, the layout's block is {layout.block_bytes} B")
    flags, bits = budget.flags, budget.bits.reshape(-1)
    plan = _plan(layout, budget.bits.tobytes(), flags, False, codec_fast.AVAILABLE)
    out = np.empty(plan.stored_bytes, np.uint8)
    out[HEADER_BYTES : HEADER_BYTES + layout.num_groups] = bits
    if plan.fast_bases.size:
        bf16 = layout.dtype == "bfloat16"  # read as bits in the loops; the others converted here
        x32 = np.zeros(0, np.float32) if bf16 else to_float32(payload, layout.dtype)
        x16 = payload.view(np.uint16) if bf16 else np.zeros(0, np.uint16)
        codec_fast.encode_groups(x32, x16, plan.fast_bases, plan.fast_bits, plan.fast_offsets, plan.fast_axes,
                                 layout.block_tokens, layout.head_size, budget.rotate, plan.scale, out)
    x = None
    for b, by_channel, idx, start, size in plan.kinds:
        x = to_canonical(payload, layout) if x is None else x
        data = _encode_groups(x[idx], b, by_channel, budget.rotate, layout)
        out[start : start + idx.size * size] = data.reshape(-1)
    body = out[HEADER_BYTES:]
    HEADER.pack_into(out, 0, MAGIC, VERSION, flags, layout.num_layers, layout.num_kv_heads, layout.block_tokens,
                     layout.head_size, DTYPE_CODES[layout.dtype], ORDERS.index(layout.order), layout.splits,
                     body.size, xxhash.xxh3_64_intdigest(body))
    return out


def _fast_groups(bits: np.ndarray, channel: np.ndarray, dtype: str = "") -> np.ndarray:
    """The groups the compiled loops (kvstore/codec_fast.py) take: quantized per token; decoding, bfloat16
    blocks only. Empty without numba."""
    if not codec_fast.AVAILABLE or (dtype and dtype != "bfloat16"):
        return np.zeros(0, np.int64)
    return np.flatnonzero((bits != EXACT) & ~channel)


def _group_bases(layout: BlockLayout) -> np.ndarray:
    """Element index of each group's first element (token 0, channel 0) in the block."""
    s_kv, s_h, _, _, _ = layout.strides()
    g = np.arange(layout.num_groups)
    H = layout.num_kv_heads
    return (g // (2 * H)) * layout.layer_elems + ((g // 2) % H) * s_h + (g % 2) * s_kv


def _group_axes(layout: BlockLayout, groups: np.ndarray) -> np.ndarray:
    """int64 [len(groups), 6]: each group's `BlockLayout.axes` (its keys' or its values')."""
    return np.array(layout.axes(), np.int64)[groups % 2]


def _encode_groups(x: np.ndarray, b: int, by_channel: bool, rotate: bool, layout: BlockLayout) -> np.ndarray:
    """uint8 [n, group bytes]: meta (float16 scales then minimums) and bit planes of n groups."""
    n = x.shape[0]
    if b == EXACT:
        return from_float32(x, layout.dtype).reshape(n, -1)
    y = fwht(x) if rotate else x
    axis = 1 if by_channel else 2
    lo, hi = y.min(axis=axis, keepdims=True), y.max(axis=axis, keepdims=True)
    levels = (1 << b) - 1
    scale = ((hi - lo) / np.float32(levels)).astype(np.float16)
    low = lo.astype(np.float16)
    s32 = scale.astype(np.float32)
    inv = np.divide(np.float32(1), s32, out=np.zeros_like(s32), where=s32 > 0)
    q = np.clip(np.rint((y - low.astype(np.float32)) * inv), 0, levels).astype(np.uint8).reshape(n, -1)
    planes = np.packbits(((q[:, None, :] >> np.arange(b, dtype=np.uint8)[None, :, None]) & 1).astype(bool),
                         axis=-1, bitorder="little").reshape(n, -1)
    meta = np.concatenate((scale.reshape(n, -1), low.reshape(n, -1)), axis=1).view(np.uint8)
    return np.concatenate((meta, planes), axis=1)


def read_header(blob: np.ndarray, layout: BlockLayout | None = None) -> tuple[BlockLayout, np.ndarray, int]:
    """(layout, bits [L, H, 2], flags) of an encoded block, its checksum verified; CorruptBlock when the
    blob is not a whole, intact block (of `layout`, when given)."""
    blob = np.asarray(blob).reshape(-1).view(np.uint8)
    if blob.size < HEADER_BYTES:
        raise CorruptBlock(f"{blob.size} B is shorter than a header")
    magic, version, flags, L, H, N, D, dt, order, splits, body_len, checksum = HEADER.unpack_from(blob, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("not an encoded KV block (magic or version)")
    if body_len != blob.size - HEADER_BYTES or xxhash.xxh3_64_intdigest(blob[HEADER_BYTES:]) != checksum:
        raise CorruptBlock("encoded block's length or checksum does not match")
    dtypes = {v: k for k, v in DTYPE_CODES.items()}
    try:
        got = BlockLayout(L, H, N, D, dtypes[dt], ORDERS[order], splits)
        bits = blob[HEADER_BYTES : HEADER_BYTES + got.num_groups].reshape(L, H, 2).copy()
        Budget(bits, bool(flags & FLAG_ROTATE), "channel" if flags & FLAG_KEY_CHANNEL else "token")
    except (ValueError, KeyError, IndexError) as exc:
        raise CorruptBlock(f"encoded block's header is inconsistent: {exc}") from None
    if layout is not None and got != layout:
        raise CorruptBlock(f"encoded block is laid out as {got}, expected {layout}")
    if _plan(got, bits.tobytes(), flags, True, codec_fast.AVAILABLE).stored_bytes != blob.size:
        raise CorruptBlock("encoded block's size does not match its bits table")
    return got, bits, flags


def decode(blob: np.ndarray, layout: BlockLayout | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The payload (uint8, in the block's layout) of an encoded block, written into `out` when given.
    Raises CorruptBlock (nothing written) when the blob does not verify."""
    blob = np.asarray(blob).reshape(-1).view(np.uint8)
    layout, bits3, flags = read_header(blob, layout)
    if out is None:
        out = np.empty(layout.block_bytes, np.uint8)
    elif out.size != layout.block_bytes:
        raise ValueError(f"output is {out.size} B, a block is {layout.block_bytes} B")
    rotate = bool(flags & FLAG_ROTATE)
    plan = _plan(layout, bits3.tobytes(), flags, True, codec_fast.AVAILABLE)
    fast = plan.fast_bases.size
    if not fast:
        x = np.empty((layout.num_groups, layout.block_tokens, layout.head_size), np.float32)
    for b, by_channel, idx, start, size in plan.kinds:
        data = blob[start : start + idx.size * size].reshape(idx.size, size)
        y = _decode_groups(data, b, by_channel, rotate, layout)
        if not fast:
            x[idx] = y
        else:  # the other groups are the compiled loops': these are written group by group
            _write_groups(y, idx, layout, out)
    if not fast:
        from_canonical(x, layout, out)
        return out
    codec_fast.decode_groups(blob, plan.fast_offsets, plan.fast_bits, plan.fast_bases, plan.fast_axes,
                             layout.block_tokens, layout.head_size, rotate, plan.scale, out.view(np.uint16))
    return out


@dataclass(frozen=True, eq=False)
class _Plan:
    """What encoding or decoding a block of one layout and bits table needs besides its bytes, made once
    per (layout, bits, flags) (`_plan`): a block's Python work is then a few calls around the loops."""

    stored_bytes: int
    scale: np.float32  # the rotation's normalization, 1 / sqrt(head_size)
    # The groups the compiled loops take (`_fast_groups`): element bases, bits, byte offsets, axes.
    fast_bases: np.ndarray
    fast_bits: np.ndarray
    fast_offsets: np.ndarray
    fast_axes: np.ndarray
    # The other groups, by kind: (bits, by channel, group indices, byte offset of the first, bytes each).
    kinds: tuple[tuple[int, bool, np.ndarray, int, int], ...]


@functools.lru_cache(maxsize=256)
def _plan(layout: BlockLayout, bits_table: bytes, flags: int, decoding: bool, compiled: bool) -> _Plan:
    """The `_Plan` of blocks of `layout` under the bits table `bits_table` (uint8 [L, H, 2] as bytes);
    `compiled`: whether the compiled loops run (`codec_fast.AVAILABLE`, a key of the cache)."""
    bits3 = np.frombuffer(bits_table, np.uint8).reshape(layout.num_layers, layout.num_kv_heads, 2)
    bits = bits3.reshape(-1)
    offsets, sizes = group_offsets(layout, bits3, flags), group_sizes(layout, bits3, flags)
    channel = channel_groups(layout, flags)
    fast = _fast_groups(bits, channel, layout.dtype if decoding else "") if compiled else np.zeros(0, np.int64)
    kinds = []
    for b in np.unique(bits):
        for by_channel in (False, True):
            idx = np.flatnonzero((bits == b) & (channel == by_channel))
            if idx.size == 0 or (fast.size and not by_channel and b != EXACT):
                continue
            kinds.append((int(b), by_channel, idx, int(offsets[idx[0]]), int(sizes[idx[0]])))  # (a kind's groups
            # are contiguous, in index order)
    return _Plan(HEADER_BYTES + layout.num_groups + int(sizes.sum()), np.float32(1.0 / math.sqrt(layout.head_size)),
                 _group_bases(layout)[fast], bits[fast].astype(np.int64), offsets[fast], _group_axes(layout, fast),
                 tuple(kinds))


def _write_groups(y: np.ndarray, idx: np.ndarray, layout: BlockLayout, out: np.ndarray) -> None:
    """Write float32 groups y [n, N, D] (group indices idx) into the block `out` in its layout."""
    raw = from_float32(y, layout.dtype).view({2: np.uint16, 4: np.uint32}[layout.elt_bytes])
    views = _kv_views(out.view(raw.dtype), layout)
    H = layout.num_kv_heads
    for i, g in enumerate(idx):
        part = views[g % 2][g // (2 * H), (g // 2) % H]
        part[...] = raw[i].reshape(part.shape)


def _decode_groups(data: np.ndarray, b: int, by_channel: bool, rotate: bool, layout: BlockLayout) -> np.ndarray:
    n, N, D = data.shape[0], layout.block_tokens, layout.head_size
    if b == EXACT:
        return to_float32(np.ascontiguousarray(data), layout.dtype).reshape(n, N, D)
    rows = D if by_channel else N
    meta = np.ascontiguousarray(data[:, : rows * META_BYTES]).view(np.float16).astype(np.float32)
    scale, low = meta[:, :rows], meta[:, rows:]
    planes = data[:, rows * META_BYTES :].reshape(n, b, -1)
    bitsets = np.unpackbits(planes, axis=-1, bitorder="little")  # [n, b, N * D]
    q = (bitsets << np.arange(b, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    q = q.reshape(n, N, D).astype(np.float32)
    shape = (n, 1, D) if by_channel else (n, N, 1)
    y = q * scale.reshape(shape) + low.reshape(shape)
    return fwht(y) if rotate else y
