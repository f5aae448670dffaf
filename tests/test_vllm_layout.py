"""The connector's KV layout opt-in, against vLLM 0.32's own layout resolver and KV view builder.

On GPU backends the connector asks for a block-outermost layout; vLLM's resolver
keeps it where every backend accepts it and otherwise warns and picks another.
Whatever vLLM chose, the worker reads the layout from the tensors' strides: the
views here are built by vLLM's `create_kv_cache_views`, for every layout, and the
copy plans over them move the bytes of each block exactly.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import CacheConfig, KVTransferConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvstore.connectors import copy_plan as cp  # noqa: E402
from tests.kv_layouts import physical_bytes, random_ids  # noqa: E402
from tests.test_copy_plan import STORE_BYTES, executor_for, read_payload, scattered_extents, write_payloads  # noqa: E402

GPU_BACKEND = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]  # FlashAttention: any layout


def config():
    kvt = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connectors.vllm",
                           kv_role="kv_both")
    return SimpleNamespace(cache_config=CacheConfig(), kv_transfer_config=kvt)


def test_gpu_engines_get_a_block_outermost_layout(monkeypatch):
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    assert resolve_kv_cache_layout(config(), GPU_BACKEND) == KVCacheLayout.BLHNC
    assert KVCacheLayout.BLHNC.is_block_outermost


def test_a_backend_that_refuses_it_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    with caplog.at_level(logging.WARNING):
        layout = resolve_kv_cache_layout(config(), [["LBNHC"]])  # FlexAttention's only layout
    assert layout == KVCacheLayout.LBNHC
    assert "BLHNC" in caplog.text


def test_cpu_engines_ask_for_nothing(caplog):
    assert current_platform.device_type == "cpu"
    with caplog.at_level(logging.WARNING):
        assert resolve_kv_cache_layout(config(), [["LBHNC"]]) == KVCacheLayout.LBHNC  # CPU_ATTN's
    assert "does not satisfy" not in caplog.text


NB, L, H, N, D = 10, 3, 2, 16, 8


def vllm_views(layout: KVCacheLayout, kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """Per-layer KV views exactly as vLLM's worker builds them for `layout`."""
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    size = L * NB * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(L)], layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NB, layout, tensor, kernel_block_size)
    g = torch.Generator().manual_seed(7)
    raw.copy_(torch.randint(-128, 127, (size,), generator=g, dtype=torch.int8))
    return views


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_stride_detection_and_plans_on_vllms_own_views(layout):
    views = vllm_views(layout)
    geom = cp.kv_geometry(views, NB)
    # one copy per block where a block's pages of all layers are adjacent (BLHNC, BLNHC); BHLNC interleaves
    # the layers inside a block, so its pieces are (block, layer, head)
    assert geom.block_outermost == (layout.is_block_outermost and layout.is_block_compact)
    assert geom.layer_wise == (not geom.block_outermost)
    ids = random_ids(4, seed=3, num_blocks=NB)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(4, geom.block_bytes, 256, seed=4)
    executor_for(store, views).run(cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=False))
    for b, runs in zip(ids, extents):
        want = torch.cat([physical_bytes(v[b]) for v in views])
        assert torch.equal(read_payload(store, runs), want), f"block {b}"
    # ... and back into other blocks of a blank cache of the same layout
    blank = vllm_views(layout)
    for v in blank:
        v.zero_()
    dst = random_ids(4, seed=5, num_blocks=NB)
    executor_for(store, blank).run(cp.build_plan(geom_of(blank), dst, extents, store.data_ptr(), to_kv=True))
    for b_src, b_dst in zip(ids, dst):
        assert all(torch.equal(physical_bytes(x[b_dst]), physical_bytes(y[b_src])) for x, y in zip(blank, views))


def geom_of(views):
    return cp.kv_geometry(views, NB)


def test_kernel_block_split_keeps_a_manager_block_together():
    views = vllm_views(KVCacheLayout.LBHNC, kernel_block_size=N // 2)
    assert views[0].shape[0] == 2 * NB
    geom = cp.kv_geometry(views, NB)
    assert geom.size.size == L and geom.block_bytes == L * H * N * 2 * D * 2
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(2, geom.block_bytes, 256, seed=6)
    executor_for(store, views).run(cp.build_plan(geom, [4, 7], extents, store.data_ptr(), to_kv=False))
    for b, runs in zip([4, 7], extents):
        want = torch.cat([physical_bytes(v[2 * b : 2 * b + 2]) for v in views])
        assert torch.equal(read_payload(store, runs), want)
