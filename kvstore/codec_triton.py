"""The GPU path of the stored-block codec: one Triton launch expands encoded blocks into KV memory.

Encoded blocks (kvstore/codec.py) cross PCIe compressed and are expanded on the
GPU: program i decodes one group (one layer's keys or values of one KV head of
one block: `block_tokens x head_size` elements) from its bytes to its place in
the destination, in the destination's layout and dtype. The host reads each
block's header and bits table (`read_header`, checksum verified: a block that
does not verify is refused before any launch) and builds four int64 tables, one
entry per program: where the group's bytes are, where its first element goes,
its bits, whether its scales are per channel (`decode_tables`).

Per program the kernel does what `kvstore.codec.decode` does, in the same
order of float32 operations, so its output is byte-exact with the CPU decoder
(checked under `TRITON_INTERPRET=1`; compiled without FP fusion, so no multiply
and add become one FMA that rounds once): codes from the bit planes, `code * scale
+ minimum`, the Walsh-Hadamard butterflies in the codec's stage order then one
scaling, and bfloat16 by integer round-to-nearest-even. Exact groups (16 bits)
are copied.

Destinations: `layer_addrs[b, l]` is the address of block b's slice of layer l
(a block's layers follow one another: its pages in the GPU tier, or an engine's
KV tensor for that layer at the block's engine block); inside it an element
sits where the block's `BlockLayout` says. The daemon's GPU tier uses it
(kvstore/gpu_decode.py): a GPU reader's encoded disk blocks are expanded
straight into the tier's pages.

Importing this module imports triton.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import triton
import triton.language as tl

from kvstore.codec import EXACT, FLAG_ROTATE, BlockLayout, channel_groups, group_offsets, read_header

OUT_KINDS = {"bfloat16": 0, "float16": 1, "float32": 2}


@triton.jit
def decode_groups_kernel(src_table, dst_table, bits_table, chan_table, norm,
                         N: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, S_TO: tl.constexpr,
                         S_TI: tl.constexpr, N_IN: tl.constexpr, ROTATE: tl.constexpr, OUT_KIND: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    src = tl.load(src_table + p)
    dst = tl.load(dst_table + p)
    bits = tl.load(bits_table + p).to(tl.int32)
    chan = tl.load(chan_table + p)
    t = tl.arange(0, N)[:, None]
    d = tl.arange(0, D)[None, :]
    elem = t * D + d  # the element's index in the group's canonical [N, D] order
    where = (t // N_IN) * S_TO + (t % N_IN) * S_TI + d  # its offset in the destination, in elements
    if bits == 16:  # exact: the elements as stored
        if OUT_KIND == 2:
            raw = tl.load(src.to(tl.pointer_type(tl.uint32)) + elem)
            tl.store(dst.to(tl.pointer_type(tl.uint32)) + where, raw)
        else:
            raw16 = tl.load(src.to(tl.pointer_type(tl.uint16)) + elem)
            tl.store(dst.to(tl.pointer_type(tl.uint16)) + where, raw16)
    else:
        rows = tl.where(chan != 0, D, N)
        row = tl.where(chan != 0, d + t * 0, t + d * 0)
        meta = src.to(tl.pointer_type(tl.float16))
        scale = tl.load(meta + row).to(tl.float32)
        low = tl.load(meta + rows + row).to(tl.float32)
        planes = src.to(tl.pointer_type(tl.uint8)) + rows * 4
        code = elem * 0  # (not tl.zeros: a jit helper the interpreter cannot run once triton is imported)
        for j in range(0, bits):
            byte = tl.load(planes + j * (N * D // 8) + elem // 8).to(tl.int32)
            code += ((byte >> (elem % 8)) & 1) << j
        y = code.to(tl.float32) * scale + low
        if ROTATE:  # stage h pairs channel i with i + h in runs of 2h: (a + b, a - b), as kvstore.codec.fwht
            for s in tl.static_range(LOG_D):
                pairs = tl.permute(tl.reshape(y, (N, D >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
                a, b = tl.split(pairs)
                y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (N, D))
            y = y * norm
        if OUT_KIND == 0:
            u = y.to(tl.uint32, bitcast=True)
            r = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
            tl.store(dst.to(tl.pointer_type(tl.uint16)) + where, r.to(tl.uint16))
        elif OUT_KIND == 1:
            tl.store(dst.to(tl.pointer_type(tl.float16)) + where, y.to(tl.float16))
        else:
            tl.store(dst.to(tl.pointer_type(tl.float32)) + where, y)


def decode_tables(blobs: Sequence[np.ndarray], blob_addrs: Sequence[int], layer_addrs: np.ndarray,
                  layout: BlockLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """(src, dst, bits, chan) int64 tables, one entry per group of every block, and the blocks' rotation
    flag. `blobs[b]`: block b's encoded bytes as host memory (its header is read and its checksum
    verified here: CorruptBlock refuses the whole launch); `blob_addrs[b]`: where the kernel reads them
    (a device copy, or the same host memory); `layer_addrs`: int64 [blocks, layers]."""
    if layout.order in ("HKTVND", "AMX"):  # a CPU backend's layout (keys transposed, or tiled): no GPU here
        raise ValueError(f"the Triton decoder reads keys laid out like values, not order {layout.order}")
    layer_addrs = np.asarray(layer_addrs, np.int64)
    if layer_addrs.shape != (len(blobs), layout.num_layers) or len(blob_addrs) != len(blobs):
        raise ValueError("one blob address and one address per layer for every block")
    s_kv, s_h, _, _, _ = layout.strides()
    elt = layout.elt_bytes
    H = layout.num_kv_heads
    g = np.arange(layout.num_groups)
    layer, head, kv = g // (2 * H), (g // 2) % H, g % 2
    within = (head * s_h + kv * s_kv) * elt
    src, dst, bits, chan, rotate = [], [], [], [], None
    for blob, addr, layers in zip(blobs, blob_addrs, layer_addrs):
        _, b3, flags = read_header(blob, layout)
        if rotate is not None and rotate != bool(flags & FLAG_ROTATE):
            raise ValueError("blocks of one launch must agree on rotation")
        rotate = bool(flags & FLAG_ROTATE)
        src.append(int(addr) + group_offsets(layout, b3, flags))
        dst.append(layers[layer] + within)
        bits.append(b3.reshape(-1).astype(np.int64))
        chan.append(channel_groups(layout, flags).astype(np.int64))
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)  # noqa: E731
    return cat(src), cat(dst), cat(bits), cat(chan), bool(rotate)


def launch(src, dst, bits, chan, layout: BlockLayout, rotate: bool) -> None:
    """Decode every group of the tables (torch int64 tensors on the kernel's device) on the current stream."""
    _, _, s_to, s_ti, n_in = layout.strides()
    n = int(src.shape[0])
    if n == 0:
        return
    D = layout.head_size
    decode_groups_kernel[(n,)](src, dst, bits, chan, float(np.float32(1.0 / math.sqrt(D))),
                               N=layout.block_tokens, D=D, LOG_D=int(math.log2(D)), S_TO=max(s_to, 1), S_TI=s_ti,
                               N_IN=n_in, ROTATE=rotate, OUT_KIND=OUT_KINDS[layout.dtype],
                               enable_fp_fusion=False)  # an FMA rounds once where the CPU decoder rounds twice


__all__ = ["EXACT", "decode_tables", "launch", "decode_groups_kernel"]
