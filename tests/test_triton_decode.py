"""The Triton decode kernel (kvstore/codec_triton.py): byte-exact with the CPU decoder under Triton's
interpreter, for every layout and dtype the connector stores, straight into engine KV tensors where a
block's layer slice is one run; and its PTX for sm_90."""

from __future__ import annotations

import importlib
import os
import re

import numpy as np
import pytest
import torch

from kvstore.codec import BlockLayout, Budget, CorruptBlock, decode, encode, from_float32, to_float32
from tests.kv_layouts import KINDS, NB, D, H, L, N, blank_like, make_layers, ref_payload
from tests.test_codec import ORDER

pytest.importorskip("triton", reason="the decode kernel is Triton (the test extra installs it)")

ONE_RUN = {"cpu_separate", "shared_LBHNC", "shared_LBNHC", "shared_BLHNC", "shared_BLNHC", "kernel_split_LBHNC"}
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.fixture(scope="module")
def td():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import kvstore.codec_triton as mod

    mod = importlib.reload(mod)
    yield mod
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(mod)


def budgets(layout: BlockLayout) -> list[Budget]:
    mixed = np.array([[[8, 2], [16, 3]], [[4, 4], [5, 2]], [[3, 2], [16, 16]]], np.uint8)[:L, :H]
    return [Budget(mixed, rotate=True), Budget(mixed, rotate=False, key_mode="channel"),
            Budget.uniform(layout, 4, 2, rotate=True)]


def payloads(kind: str, dtype: str, ids) -> tuple[BlockLayout, list[np.ndarray]]:
    layers = make_layers(kind, seed=7)
    src = "float16" if layers[0].dtype == torch.float16 else "bfloat16"
    order, splits = ORDER[kind]
    layout = BlockLayout(L, H, N, D, dtype, order, splits)
    return layout, [from_float32(to_float32(ref_payload(kind, layers, b).numpy(), src), dtype) for b in ids]


def run(td, layout, blobs, layer_addrs):
    tensors = [torch.from_numpy(b) for b in blobs]
    src, dst, bits, chan, rotate = td.decode_tables(blobs, [t.data_ptr() for t in tensors], layer_addrs, layout)
    td.launch(*(torch.from_numpy(a) for a in (src, dst, bits, chan)), layout, rotate)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kernel_decodes_byte_exact_with_the_cpu_decoder(td, kind, dtype):
    ids = [3, 0, 9]
    layout, blocks = payloads(kind, dtype, ids)
    layer_bytes = layout.block_bytes // L
    for budget in budgets(layout):
        blobs = [encode(p, layout, budget) for p in blocks]
        out = torch.zeros(len(blobs) * layout.block_bytes, dtype=torch.uint8)
        base = out.data_ptr() + np.arange(len(blobs))[:, None] * layout.block_bytes
        run(td, layout, blobs, base + np.arange(L)[None, :] * layer_bytes)
        for i, blob in enumerate(blobs):
            want = decode(blob, layout)
            got = out[i * layout.block_bytes : (i + 1) * layout.block_bytes].numpy()
            assert np.array_equal(got, want), (budget.key_mode, budget.rotate, i)


@pytest.mark.parametrize("kind", sorted(ONE_RUN))
def test_kernel_writes_straight_into_engine_blocks(td, kind):
    """Where a block's slice of a layer is one run of KV memory, the kernel expands into the engine's own
    tensors: every named block gets the CPU decoder's payload, every other block stays untouched."""
    layers = blank_like(kind)
    dtype = "float16" if layers[0].dtype == torch.float16 else "bfloat16"
    src_ids, dst_ids = [1, 4], [7, 2]
    layout, blocks = payloads(kind, dtype, src_ids)
    blobs = [encode(p, layout, Budget.uniform(layout, 4, 3)) for p in blocks]
    k = 2 if kind == "kernel_split_LBHNC" else 1
    addrs = np.array([[t.data_ptr() + e * k * t.stride(0) * t.element_size() for t in layers] for e in dst_ids])
    run(td, layout, blobs, addrs)
    for b in range(NB):
        got = ref_payload(kind, layers, b).numpy()
        if b in dst_ids:
            assert np.array_equal(got, decode(blobs[dst_ids.index(b)], layout)), b
        else:
            assert not got.any(), f"block {b} was not named but changed"


def test_a_damaged_block_refuses_the_launch(td):
    layout, blocks = payloads("shared_LBHNC", "bfloat16", [0])
    blob = encode(blocks[0], layout, Budget.uniform(layout, 4, 2))
    blob[-3] ^= 1
    with pytest.raises(CorruptBlock):
        td.decode_tables([blob], [0], np.zeros((1, L), np.int64), layout)


def test_kernel_ptx_for_sm90(monkeypatch):
    """Compiled for an H100 without a GPU (ptxas ships with Triton)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kvstore.codec_triton as mod

    sig = {"src_table": "*i64", "dst_table": "*i64", "bits_table": "*i64", "chan_table": "*i64", "norm": "fp32",
           **{k: "constexpr" for k in ("N", "D", "LOG_D", "S_TO", "S_TI", "N_IN", "ROTATE", "OUT_KIND")}}
    consts = {"N": 16, "D": 64, "LOG_D": 6, "S_TO": 1, "S_TI": 128, "N_IN": 16, "ROTATE": True, "OUT_KIND": 0}
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        importlib.reload(mod)
        try:
            source = ASTSource(fn=mod.decode_groups_kernel, signature=sig, constexprs=consts)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4, "enable_fp_fusion": False})
        finally:
            m.undo()
            importlib.reload(mod)
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx
    assert re.search(r"\bst\.global(\.[a-z0-9]+)*\.b16\b", ptx) or re.search(r"\bst\.global(\.v\d)?\.b16", ptx), \
        "bfloat16 results are stored as 16-bit words"
    assert "ld.global" in ptx
    assert "fma.rn.f32" not in ptx, "a fused multiply-add would round differently from the CPU decoder"
