"""Encoded blocks expanded on the GPU, straight into the GPU tier's pages.

Where a GPU reader acquires blocks stored encoded on disk or in the remote tier
(kvstore/compression.py) and the daemon has a GPU tier, the promotion
(kvstore/promotion.py) reads each block's stored bytes, verified by their
tier's checksum, and hands them here:
they cross PCIe encoded (one host-to-device copy a batch) and the Triton kernel
(kvstore/codec_triton.py) expands them in the tier's pages, in the block's own
layout, byte-exact with the CPU decoder. The CPU does no decoding and the host
arena holds no copy of the block; its copy below stays.

`GpuExpander(items)` takes (GPU pages, stored bytes) per block and says per
block whether it was expanded: False where the codec's header or checksum does
not verify (a damaged block: the store drops it, as the CPU path does). A fault
of the device or the kernel raises, and the promotion takes those blocks the
CPU way into the host arena instead: a GPU fault costs speed, never a hit.

A block's layers follow one another in its payload; where its pages put every
layer's slice in one run, the kernel writes into them, otherwise into a
scratch buffer copied into the pages after. On the emulated tier (`device =
"cpu"`: shared memory) the kernel runs in Triton's interpreter
(`TRITON_INTERPRET=1`), which is how CI runs this path; without it that tier
decodes on the CPU as before (`expander_for` says why).
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvstore.codec import FLAG_ROTATE, BlockLayout, CorruptBlock, read_header
from kvstore.tiers.gpu import SLOT, GpuPool, GpuTier

if TYPE_CHECKING:
    from kvstore.compression import Compression

CPU_ORDERS = ("HKTVND", "AMX")  # vLLM's CPU kernels' layouts: no GPU engine stores them


def expander_for(gpu: GpuTier | None, compression: "Compression | None") -> tuple["GpuExpander | None", str]:
    """The GPU tier's expander for a store that compresses as `compression` says, or (None, why the CPU
    decodes instead)."""
    if compression is None or not compression.tiers:
        return None, "no tier compresses"
    if not compression.config.gpu_decode:
        return None, "compression.gpu_decode is off"
    if gpu is None:
        return None, "no gpu tier"
    if gpu.host_memory and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "the emulated gpu tier is host memory (TRITON_INTERPRET=1 runs the kernel on it)"
    try:
        return GpuExpander(gpu), ""
    except ImportError as exc:
        return None, f"triton does not import ({exc})"


class GpuExpander:
    def __init__(self, gpu: GpuTier) -> None:
        from kvstore import codec_triton  # imports triton

        self.gpu, self.kernel = gpu, codec_triton
        self._local = threading.local()

    @staticmethod
    def takes(layout: BlockLayout) -> bool:
        """Whether the kernel expands blocks of `layout` (not vLLM's CPU kernels' layouts)."""
        return layout.order not in CPU_ORDERS

    def __call__(self, items: Sequence[tuple[list, np.ndarray]]) -> list[bool]:
        """Expand each (GPU pages, encoded bytes) block into its pages; per block whether it was
        (False: it does not verify, or it is not a block these pages hold). Blocking: a reader thread
        calls it, and it returns once the pages hold the blocks."""
        done = [False] * len(items)
        groups: dict[tuple, list[int]] = {}  # (pool, layout, rotated) -> the blocks of one launch
        for i, (pages, blob) in enumerate(items):
            try:
                layout, _, flags = read_header(blob)
            except CorruptBlock:
                continue
            if not self.takes(layout) or layout.block_bytes != sum(n for _, n in pages):
                continue
            groups.setdefault((pages[0][0] // SLOT, layout, bool(flags & FLAG_ROTATE)), []).append(i)
        for (k, layout, _), idx in groups.items():
            self._launch(self.gpu.pools[k], layout, [items[i] for i in idx])
            for i in idx:
                done[i] = True
        return done

    def _launch(self, pool: GpuPool, layout: BlockLayout, items: Sequence[tuple[list, np.ndarray]]) -> None:
        import torch

        block, layers = layout.block_bytes, layout.num_layers
        layer_bytes = block // layers
        base = pool.buf.data_ptr()
        dsts = [self._layer_addrs(pages, base, layer_bytes, layers) for pages, _ in items]
        scratch_of = [i for i, d in enumerate(dsts) if d is None]  # blocks whose layers cross a page run
        device = pool.buf.device
        cuda = device.type == "cuda"
        with torch.cuda.device(device) if cuda else nullcontext(), \
                torch.cuda.stream(pool.stream) if cuda else nullcontext():
            scratch = torch.empty(len(scratch_of) * block, dtype=torch.uint8, device=device)
            for j, i in enumerate(scratch_of):
                dsts[i] = scratch.data_ptr() + j * block + np.arange(layers, dtype=np.int64) * layer_bytes
            blobs = [blob for _, blob in items]
            if cuda:  # the encoded bytes cross PCIe, one copy from pinned memory for the launch
                offsets = np.cumsum([0] + [b.size for b in blobs[:-1]])
                total = int(offsets[-1]) + blobs[-1].size
                pinned = self._pinned(total)
                np.concatenate(blobs, out=pinned.numpy()[:total])
                staged = pinned[:total].to(device, non_blocking=True)
                addrs = [staged.data_ptr() + int(o) for o in offsets]
            else:
                addrs = [b.ctypes.data for b in blobs]
            tables = self.kernel.decode_tables(blobs, addrs, np.stack(dsts), layout)
            src, dst, bits, chan = (torch.from_numpy(a).to(device) for a in tables[:4])
            self.kernel.launch(src, dst, bits, chan, layout, tables[4])
            for j, i in enumerate(scratch_of):
                pos = j * block
                for o, n in items[i][0]:
                    local = o % SLOT
                    pool.buf[local : local + n].copy_(scratch[pos : pos + n])
                    pos += n
        if cuda:
            pool.stream.synchronize()

    def _pinned(self, nbytes: int):
        """The calling thread's pinned staging buffer (reader threads expand side by side), grown to a
        power of two. A buffer is reused only after its thread's previous launch was synchronized."""
        import torch

        buf = getattr(self._local, "pinned", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.pinned = torch.empty(1 << max(nbytes - 1, 1).bit_length(), dtype=torch.uint8,
                                                   pin_memory=True)
        return buf

    @staticmethod
    def _layer_addrs(pages: list, base: int, layer_bytes: int, layers: int) -> np.ndarray | None:
        """Where each layer's slice of a block starts in the pool, where every slice lies in one of the
        block's page runs; else None."""
        out, pos = [], 0
        for o, n in pages:
            local = o % SLOT
            while len(out) < layers and pos + layer_bytes <= n:
                out.append(base + local + pos)
                pos += layer_bytes
            if len(out) < layers and pos < n:
                return None  # the next layer starts in this run and ends in another
            pos -= n
        return np.array(out, np.int64) if len(out) == layers else None

