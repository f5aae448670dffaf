"""One Triton kernel launch for a copy plan of many small pieces (both directions).

Program i copies piece i: it reads the piece's source and destination addresses
and size from the plan's tables (int64, on the device), casts them to pointers
and moves the bytes in 16-byte words (`tl.multiple_of` hints; the PTX shows
`ld.global.v4.b32` / `st.global.v4.b32`). Host memory takes part through
unified addressing: the arena, registered with `cudaHostRegister` (portable and
mapped), is read or written by the kernel directly over PCIe, with no staging
pass.

Pieces are cut to at most `CHUNK_BYTES` before the launch so that programs get
equal work. Every address and size must be a multiple of 16 bytes: the kernel
does not check (a misaligned vector access faults the context), so
`check_alignment` does on the host, and executors fall back to another path for
a plan that fails it.

Importing this module imports triton; copy_exec.py imports it only when the
kernel executor is chosen.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kvstore.connectors.copy_plan import CopyPlan

ALIGN = 16
CHUNK_BYTES = 64 << 10  # the most one program copies
WORDS = 1024  # int32 words per loop step of one program (a power of two)


@triton.jit
def copy_pieces_kernel(src_table, dst_table, words_table, WORDS_PER_STEP: tl.constexpr):
    piece = tl.program_id(0).to(tl.int64)
    src = tl.load(src_table + piece).to(tl.pointer_type(tl.int32))
    dst = tl.load(dst_table + piece).to(tl.pointer_type(tl.int32))
    n = tl.load(words_table + piece)
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    n = tl.multiple_of(n, 4)
    offsets = tl.arange(0, WORDS_PER_STEP)
    for start in range(0, n, WORDS_PER_STEP):
        index = start + offsets
        mask = index < n
        tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)


def check_alignment(plan: CopyPlan) -> str:
    """'' when the kernel may run the plan, else why not."""
    if not len(plan):
        return ""
    for name, values in (("source address", plan.src), ("destination address", plan.dst), ("size", plan.size)):
        bad = np.nonzero(values % ALIGN)[0]
        if bad.size:
            return f"piece {int(bad[0])}'s {name} {int(values[bad[0]])} is not a multiple of {ALIGN} bytes"
    return ""


def chunked(plan: CopyPlan, chunk_bytes: int = CHUNK_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, int32 words) int64 tables with every piece cut to at most chunk_bytes."""
    size = plan.size.astype(np.int64)
    parts = np.maximum(1, -(-size // chunk_bytes))
    first = np.repeat(np.cumsum(parts) - parts, parts)
    k = np.arange(int(parts.sum()), dtype=np.int64) - first  # index of the chunk within its piece
    piece = np.repeat(np.arange(size.size), parts)
    offset = k * chunk_bytes
    words = np.minimum(chunk_bytes, size[piece] - offset) // 4
    src = plan.src.astype(np.int64)[piece] + offset
    dst = plan.dst.astype(np.int64)[piece] + offset
    return src, dst, words


def launch(src_table, dst_table, words_table, num_pieces: int) -> None:
    """Launch on the current stream (torch's for CUDA tensors; the interpreter's for CPU tensors)."""
    copy_pieces_kernel[(num_pieces,)](src_table, dst_table, words_table, WORDS_PER_STEP=WORDS)
