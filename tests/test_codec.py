"""The stored-block codec (kvstore/codec.py): every layout and dtype the connector stores, budgets,
blocks that decode alone, and damaged blocks refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codec import (EXACT, HEADER_BYTES, BlockLayout, Budget, CorruptBlock, decode, encode, encoded_bytes,
                           from_canonical, from_float32, fwht, group_offsets, group_sizes, read_header, to_canonical, to_float32)
from kvstore.keys import Namespace
from tests.kv_layouts import KINDS, D, H, L, N, make_layers, ref_payload

ORDER = {  # kv_layouts kind -> (the codec's order, kernel blocks per block)
    "cpu_separate": ("HNC", 1), "cuda_legacy_nhd": ("KVNHD", 1), "flashinfer_legacy": ("KVNHD", 1),
    "shared_LBHNC": ("HNC", 1), "shared_LBNHC": ("NHC", 1), "shared_BLHNC": ("HNC", 1),
    "shared_BLNHC": ("NHC", 1), "kernel_split_LBHNC": ("HNC", 2),
}
DTYPES = ("bfloat16", "float16", "float32")


def logical_block(kind: str, t: torch.Tensor, b: int) -> torch.Tensor:
    """Block b of one layer tensor as [heads, K/V, tokens, channels], read through torch's own views."""
    if kind in ("cuda_legacy_nhd", "flashinfer_legacy"):
        planes = t[:, b] if kind == "cuda_legacy_nhd" else t[b]  # [2, N, H, D]
        return planes.permute(2, 0, 1, 3)
    if kind == "kernel_split_LBHNC":
        halves = t[2 * b : 2 * b + 2]  # [2, H, N/2, 2D]
        hnc = halves.permute(1, 0, 2, 3).reshape(H, N, 2 * D)
    else:
        hnc = t[b]  # [H, N, 2D], whatever the physical order
    return torch.stack((hnc[..., :D], hnc[..., D:]), dim=1)


def block_payload(kind: str, dtype: str, b: int = 5, seed: int = 0) -> tuple[BlockLayout, np.ndarray, np.ndarray]:
    """(layout, payload bytes in `dtype`, expected canonical float32 [groups, N, D]) of block b."""
    layers = make_layers(kind, seed)
    raw = ref_payload(kind, layers, b).numpy()
    src = "float16" if layers[0].dtype == torch.float16 else "bfloat16"
    values = to_float32(raw, src)
    payload = from_float32(values, dtype)
    canonical = torch.stack([logical_block(kind, t, b) for t in layers]).float().numpy()
    order, splits = ORDER[kind]
    return BlockLayout(L, H, N, D, dtype, order, splits), payload, canonical.reshape(L * H * 2, N, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layout_reads_every_element_where_the_engine_put_it(kind, dtype):
    layout, payload, canonical = block_payload(kind, dtype)
    assert payload.size == layout.block_bytes
    got = to_canonical(payload, layout)
    want = to_float32(from_float32(canonical, dtype), dtype).reshape(canonical.shape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_exact_budget_round_trips_byte_for_byte(kind, dtype):
    layout, payload, _ = block_payload(kind, dtype)
    blob = encode(payload, layout, Budget.uniform(layout, EXACT))
    assert np.array_equal(decode(blob, layout), payload)


def quant_step(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    return (x.max(axis=axis, keepdims=True) - x.min(axis=axis, keepdims=True)) / ((1 << bits) - 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("key_mode", ["token", "channel"])
def test_lossy_round_trip_stays_within_half_a_step_in_place(kind, dtype, key_mode):
    """Unrotated: every element within half a quantization step (+ float16 scales and the dtype's
    rounding) of its own value; a misplaced element would be off by whole steps."""
    layout, payload, _ = block_payload(kind, dtype)
    x = to_canonical(payload, layout)
    x += np.arange(layout.num_groups, dtype=np.float32)[:, None, None] * 4  # groups far apart
    payload = np.empty(layout.block_bytes, np.uint8)
    from_canonical(x, layout, payload)
    x = to_canonical(payload, layout)
    budget = Budget.uniform(layout, 4, 3, rotate=False, key_mode=key_mode)
    y = to_canonical(decode(encode(payload, layout, budget), layout), layout)
    for g in range(layout.num_groups):
        kv, bits = g % 2, (4, 3)[g % 2]
        axis = 1 if (kv == 0 and key_mode == "channel") else 2
        step = quant_step(x[g][None], bits, axis)[0]
        tol = step * 0.5 * 1.01 + np.abs(x[g]) * (2.0 ** -7) + 1e-3
        assert (np.abs(y[g] - x[g]) <= tol).all(), (g, float(np.abs(y[g] - x[g]).max()))


def test_rotated_error_is_bounded_per_token_and_beats_unrotated_on_an_outlier_channel():
    layout = BlockLayout(2, 2, 16, 64, "float32")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((layout.num_groups, 16, 64)).astype(np.float32)
    x[:, :, 7] *= 40  # one outlier channel, as keys have
    payload = np.empty(layout.block_bytes, np.uint8)
    from_canonical(x, layout, payload)
    err = {}
    for rotate in (False, True):
        y = to_canonical(decode(encode(payload, layout, Budget.uniform(layout, 3, rotate=rotate)), layout), layout)
        rows = np.linalg.norm(y - x, axis=2)
        if rotate:  # the rotation keeps norms: a token's error is at most its rotated step's half, times sqrt(D)
            step = quant_step(fwht(x), 3, 2)[..., 0]
            assert (rows <= step * 0.5 * 8 * 1.01 + 1e-3).all()
        err[rotate] = float(np.mean(rows ** 2))
    assert err[True] < err[False] / 4


def test_fwht_is_orthonormal_and_its_own_inverse():
    x = np.random.default_rng(2).standard_normal((5, 3, 64)).astype(np.float32)
    y = fwht(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(fwht(y), x, atol=1e-5)
    h = fwht(np.eye(8, dtype=np.float32)) * np.sqrt(8)
    assert set(np.round(h).reshape(-1).tolist()) == {-1.0, 1.0} and np.allclose(h @ h.T, 8 * np.eye(8))


def test_per_head_budget_is_honoured_group_by_group():
    layout = BlockLayout(3, 2, 16, 64, "bfloat16")
    bits = np.array([[[8, 8], [2, 2]], [[4, 2], [16, 3]], [[3, 3], [5, 4]]], np.uint8)
    budget = Budget(bits, rotate=True)
    rng = np.random.default_rng(3)
    payload = from_float32(rng.standard_normal(layout.block_bytes // 2).astype(np.float32), "bfloat16")
    blob = encode(payload, layout, budget)
    assert blob.size == encoded_bytes(layout, budget)
    got_layout, got_bits, _ = read_header(blob, layout)
    assert got_layout == layout and np.array_equal(got_bits, bits)
    sizes = group_sizes(layout, bits, budget.flags)
    assert sizes.tolist() == [16 * 4 + b * 128 if b != EXACT else 2048 for b in bits.reshape(-1).tolist()]
    offsets = group_offsets(layout, bits, budget.flags)
    assert sorted(offsets.tolist())[0] == HEADER_BYTES + layout.num_groups
    assert max((offsets + sizes).tolist()) == blob.size
    x, y = to_canonical(payload, layout), to_canonical(decode(blob, layout), layout)
    mse = ((y - x) ** 2).mean(axis=(1, 2))
    flat = bits.reshape(-1)
    assert mse[flat == EXACT].max() == 0
    by_bits = {int(b): float(mse[flat == b].mean()) for b in np.unique(flat) if b != EXACT}
    widths = sorted(by_bits)
    assert all(by_bits[a] > 2.5 * by_bits[b] for a, b in zip(widths, widths[1:])), by_bits


def test_a_block_decodes_alone_from_its_own_header():
    layout = BlockLayout(2, 2, 16, 64, "float16", "NHC")
    budget = Budget.uniform(layout, 4, 2)
    rng = np.random.default_rng(4)
    payloads = [from_float32(rng.standard_normal(layout.block_bytes // 2).astype(np.float32), "float16")
                for _ in range(2)]
    blobs = [encode(p, layout, budget) for p in payloads]
    alone = [decode(b.copy()) for b in reversed(blobs)][::-1]  # no layout given, no state shared
    for blob, out in zip(blobs, alone):
        assert np.array_equal(out, decode(blob, layout))
    assert not np.array_equal(alone[0], alone[1])


@pytest.mark.parametrize("where", ["magic", "layout", "bits", "meta", "planes", "last"])
def test_a_damaged_block_is_refused_and_nothing_is_written(where):
    layout = BlockLayout(2, 2, 16, 64, "bfloat16")
    budget = Budget.uniform(layout, 4, 2)
    payload = from_float32(np.random.default_rng(5).standard_normal(layout.block_bytes // 2).astype(np.float32),
                           "bfloat16")
    blob = encode(payload, layout, budget)
    pos = {"magic": 0, "layout": 8, "bits": HEADER_BYTES + 1, "meta": HEADER_BYTES + layout.num_groups + 3,
           "planes": blob.size // 2, "last": blob.size - 1}[where]
    bad = blob.copy()
    bad[pos] ^= 0x10
    out = np.full(layout.block_bytes, 0xAB, np.uint8)
    with pytest.raises(CorruptBlock):
        decode(bad, layout, out)
    assert (out == 0xAB).all()


def test_truncated_foreign_or_mislabelled_blocks_are_refused():
    layout = BlockLayout(2, 2, 16, 64, "bfloat16")
    blob = encode(np.zeros(layout.block_bytes, np.uint8), layout, Budget.uniform(layout, 3))
    for bad in (blob[:-1], blob[:10], np.zeros_like(blob), np.concatenate((blob, blob[:1]))):
        with pytest.raises(CorruptBlock):
            decode(bad, layout)
    other = BlockLayout(2, 2, 16, 64, "float16")
    with pytest.raises(CorruptBlock, match="laid out"):
        decode(blob, other)


def test_budgets_and_layouts_refuse_bad_values():
    layout = BlockLayout(2, 2, 16, 64)
    with pytest.raises(ValueError, match="at least the bits"):
        Budget.uniform(layout, 2, 4)
    with pytest.raises(ValueError, match="bit widths"):
        Budget.uniform(layout, 1)
    with pytest.raises(ValueError, match="key_mode"):
        Budget.uniform(layout, 4, key_mode="row")
    with pytest.raises(ValueError, match="budget for"):
        encode(np.zeros(layout.block_bytes, np.uint8), layout, Budget.uniform(BlockLayout(3, 2, 16, 64), 4))
    with pytest.raises(ValueError, match="payload is"):
        encode(np.zeros(10, np.uint8), layout, Budget.uniform(layout, 4))
    for bad in (dict(dtype="float8"), dict(order="XYZ"), dict(head_size=48), dict(order="NHC", splits=2)):
        with pytest.raises(ValueError):
            BlockLayout(**{**dict(num_layers=2, num_kv_heads=2, block_tokens=16, head_size=64), **bad})


@pytest.mark.parametrize("layout,order", [("cpu/default", "HKTVND"), ("cpu/LBHNC", "HKTVND"), ("cuda/LBHNC", "HNC"),
                                          ("cpu/LBHNC/isa-amx", "AMX"), ("cpu/LBHNC/isa-neon", None),
                                          ("cuda/default", "HNC"), ("cuda/BLHNC", "HNC"),
                                          ("cuda/BLNHC", "NHC"), ("cuda/NHD", "KVNHD"), ("cuda/BLHNC/mla", None),
                                          ("boundary", None)])
def test_namespace_layouts_map_to_codec_orders(layout, order):
    ns = Namespace("m", "bfloat16", 2, 2, 64, 16, 2 * 2 * 16 * 2 * 64 * 2, layout=layout)
    got = BlockLayout.from_namespace(ns)
    assert (got.order if got else None) == order


def kernel_block(isa: str, dtype: str, n: int, D: int = 64, H: int = 2, L: int = 2):
    """A block of L layers written by vLLM's CPU_ATTN kernels of kind `isa` (`cpu_attn_reshape_and_cache`,
    as vllm/v1/attention/backends/cpu_attn.py calls it) into its [B, H, N, 2D] caches: (payload, the
    keys and values written, [L * H * 2, N, D] float32)."""
    ops = pytest.importorskip("vllm._custom_ops", reason="vllm is not installed")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(0)
    layers, want = [], []
    for _ in range(L):
        cache = torch.zeros(3, H, n, 2 * D, dtype=torch_dtype)
        key_cache, value_cache = cache.view(3, H, 2 * n, D).chunk(2, dim=2)
        key, value = (torch.randn(n, H, D, generator=gen).to(torch_dtype) for _ in range(2))
        try:
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n, 2 * n), isa)  # block 1
        except RuntimeError as exc:  # (a host whose vLLM build has no kernel of this kind: an AVX2-only one)
            if "Unsupported CPU attention configuration" not in str(exc):
                raise
            pytest.skip(f"vLLM's CPU kernels on this host do not write {isa} blocks: {exc}")
        layers.append(cache[1].contiguous())
        want.append(torch.stack((key.transpose(0, 1), value.transpose(0, 1)), dim=1))  # [H, K/V, N, D]
    payload = np.concatenate([t.view(torch.uint8).numpy().reshape(-1) for t in layers])
    return payload, torch.stack(want).float().numpy().reshape(L * H * 2, n, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa,n", [("vec", 32), ("vec16", 16), ("vec16", 32)])
def test_cpu_attn_layout_reads_keys_and_values_where_its_kernel_writes_them(dtype, isa, n):
    """A block written by vLLM's `vec` kernels (blocks of 32 tokens and more) or `vec16` ones (what vLLM
    runs for other block sizes) reads back, through the codec's layout for a cpu namespace, as the keys
    and values written."""
    payload, want = kernel_block(isa, dtype, n)
    layout = BlockLayout.from_namespace(Namespace("m", dtype, 2, 2, 64, n, payload.size, layout="cpu/LBHNC"))
    got = to_canonical(payload, layout)
    np.testing.assert_array_equal(got, want)
    back = np.zeros_like(payload)
    from_canonical(got, layout, back)
    np.testing.assert_array_equal(back, payload)


@pytest.mark.parametrize("n,D", [(32, 64), (64, 128), (128, 64)])
def test_amx_kernels_blocks_read_back_through_their_own_layout(n, D):
    """vLLM's AMX kernels (bfloat16, blocks of 32 tokens and more, on hosts with AMX; their cache writes ran
    on every CI host so far; where this host's vLLM build refuses them, the test skips) put the same bytes elsewhere in a block: read as a `vec` block they are wrong, read through
    the AMX layout (a namespace `cpu/.../isa-amx`, as connectors/vllm_meta.py names it) they are the keys
    and values written, and a compressed block decodes back into the kernel's layout."""
    payload, want = kernel_block("amx", "bfloat16", n, D)
    vec = Namespace("m", "bfloat16", 2, 2, D, n, payload.size, layout="cpu/LBHNC")
    assert not np.array_equal(to_canonical(payload, BlockLayout.from_namespace(vec)), want)
    amx = Namespace("m", "bfloat16", 2, 2, D, n, payload.size, layout="cpu/LBHNC/isa-amx")
    layout = BlockLayout.from_namespace(amx)
    assert amx.id != vec.id and layout.order == "AMX"
    np.testing.assert_array_equal(to_canonical(payload, layout), want)
    back = np.zeros_like(payload)
    from_canonical(want, layout, back)
    np.testing.assert_array_equal(back, payload)
    budget = Budget.uniform(layout, 8, 8)  # nearly exact: every element lands where the kernel had it
    got = to_canonical(decode(encode(payload, layout, budget), layout), layout)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_namespace_whose_block_size_does_not_match_its_shape_is_not_compressed():
    assert BlockLayout.from_namespace(Namespace("m", "bfloat16", 2, 2, 64, 16, 64 * 1024, layout="cpu/LBHNC")) is None
    assert BlockLayout.from_namespace(Namespace("m", "int8", 2, 2, 64, 16, 8192, layout="cpu/LBHNC")) is None
