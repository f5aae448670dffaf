"""A hybrid model's layout (connectors/hybrid.py) on vLLM 0.32's own KV cache specs and managers: which
kind each group is, what a hit at N needs of it (checked against vLLM's `get_num_skipped_tokens`), the
segments of stored blocks, and copy plans that move composite blocks byte-exactly between real KV tensors
and a store buffer. Plus the namespaces the connector derives (MLA's real page size, one namespace for
TP ranks that hold the same KV)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    ChunkedLocalAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from kvstore.connectors import hybrid  # noqa: E402
from kvstore.connectors.copy_plan import kv_geometry  # noqa: E402
from kvstore.connectors.vllm_meta import (  # noqa: E402
    codec_layout_unknown,
    engine_namespaces,
    hybrid_codec_unknown,
    hybrid_namespaces,
)
from tests.test_copy_plan import STORE_BYTES, executor_for, read_payload, scattered_extents  # noqa: E402

B = 32
ATT = dict(block_size=B, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
PAGE = 2 * B * 2 * 64 * 2  # K and V, 2 heads of 64, bf16


def gemma_like():
    """5 sliding-window groups of one layer (window 64) and one full-attention group, as vLLM makes them."""
    specs = [(g, SlidingWindowSpec(**ATT, sliding_window=64), [f"l{g}"]) for g in range(5)]
    return specs + [(5, FullAttentionSpec(**ATT), ["l5"])]


def test_kinds_and_segments_of_a_sliding_and_full_model():
    layout = hybrid.layout_from_groups(gemma_like())
    assert [g.kind for g in layout.groups] == ["window"] * 5 + ["full"]
    assert layout.spine == (hybrid.Segment(5, 0, 0, PAGE),)  # the full group's page at every position
    # each window group's last cdiv(63, 32) = 2 pages before a boundary, group by group
    assert [(s.group, s.rel) for s in layout.attachment] == [(g, r) for g in range(5) for r in (-2, -1)]
    assert layout.attachment_bytes == 10 * PAGE and layout.window_spine == 0
    assert layout.boundary_interval == 16 * B  # four windows of 2 blocks, at least 16 blocks


def test_a_model_with_a_window_on_every_layer_keeps_its_window_in_the_spine():
    layout = hybrid.layout_from_groups([(0, SlidingWindowSpec(**ATT, sliding_window=100), ["a", "b"])])
    assert layout.spine_kind == "window" and layout.attachment == () and layout.spine_bytes == 2 * PAGE
    assert layout.window_spine == 4  # cdiv(99, 32)


def test_recurrent_state_is_kept_at_the_boundary_block():
    mamba = MambaSpec(block_size=B, shapes=((3, 384), (1, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                      mamba_cache_mode="align")
    layout = hybrid.layout_from_groups([(0, mamba, ["m0"]), (1, mamba, ["m1"]), (2, FullAttentionSpec(**ATT), ["a"])])
    state = 3 * 384 * 2 + 128 * 128 * 4
    assert [(s.group, s.rel, s.nbytes) for s in layout.attachment] == [(0, -1, state), (1, -1, state)]
    assert layout.has_state and layout.groups[0].first_needed(5 * B, B) == 4


@pytest.mark.parametrize("specs, match", [
    ([(0, MambaSpec(block_size=B, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="none"), ["m"]),
      (1, FullAttentionSpec(**ATT), ["a"])], "Mamba cache mode 'none'"),
    ([(0, RSWASpec(**ATT, rswa_window=64), ["r"])], "RSWASpec"),
    ([(0, FullAttentionSpec(**ATT), ["a"]), (1, SlidingWindowSpec(**{**ATT, "block_size": 64}, sliding_window=64), ["s"])],
     "different block sizes"),
])
def test_what_the_store_does_not_keep_is_refused_with_its_reason(specs, match):
    with pytest.raises(ValueError, match=match):
        hybrid.layout_from_groups(specs)


@pytest.mark.parametrize("window, retained", [(64, 0), (100, 0), (33, 3), (4096, 0)])
def test_a_window_group_needs_what_vllm_keeps_for_it(window, retained):
    """Over many hit lengths, the first block kept is the one vLLM's SlidingWindowManager does not skip."""
    spec = SlidingWindowSpec(**ATT, sliding_window=window, extra_retained_tokens=retained)
    (group,) = hybrid.layout_from_groups([(0, spec, ["s"])]).groups
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=retained)
    for n in range(B, 200 * B, B):
        assert group.first_needed(n, B) == SlidingWindowManager.get_num_skipped_tokens(manager, n) // B
        assert n // B - group.first_needed(n, B) <= group.window_blocks(B)


def test_a_chunked_local_group_needs_its_chunk():
    spec = ChunkedLocalAttentionSpec(**ATT, attention_chunk_size=4 * B)
    layout = hybrid.layout_from_groups([(0, spec, ["c"]), (1, FullAttentionSpec(**ATT), ["a"])])
    group = layout.groups[0]
    manager = SimpleNamespace(attention_chunk_size=4 * B)
    for n in range(B, 40 * B, B):
        assert group.first_needed(n, B) == ChunkedLocalAttentionManager.get_num_skipped_tokens(manager, n) // B
    assert group.window_blocks(B) == 4


def test_engine_blocks_of_a_boundary():
    layout = hybrid.layout_from_groups(gemma_like())
    ids = [[0, 0, 10 + g, 20 + g, 30 + g] for g in range(5)] + [[1, 2, 3, 4, 5]]
    assert hybrid.spine_ids(layout, ids, 4) == [5]
    assert hybrid.spine_ids(layout, [[0]] * 5 + [[0]], 0) is None  # vLLM's null block is never a page
    # a hit at 5 blocks: window pages at positions 3 and 4; below `first` (a local hit) nothing is copied
    assert hybrid.attachment_ids(layout, ids, 5) == [x for g in range(5) for x in (20 + g, 30 + g)]
    assert hybrid.attachment_ids(layout, ids, 5, first=4) == [x for g in range(5) for x in (-1, 30 + g)]
    assert hybrid.attachment_ids(layout, ids, 2) is None  # position 1 of the windows is a null block


def test_boundaries_kept_without_state_groups():
    layout = hybrid.layout_from_groups(gemma_like(), boundary_interval=8 * B)
    assert layout.kept_boundaries(0, 20, 20 * B + 5) == [8, 16, 20]  # every 8 blocks, and the prompt's end
    assert layout.kept_boundaries(0, 20, 20 * B) == [8, 16, 19, 20]  # (an identical prompt can hit 19)
    assert layout.kept_boundaries(16, 23, 30 * B) == [] and layout.kept_boundaries(16, 24, 30 * B) == [24]


def test_slice_extents():
    runs = [[100, 10], [500, 30], [900, 5]]
    assert hybrid.slice_extents(runs, 0, 45) == runs
    assert hybrid.slice_extents(runs, 8, 10) == [[108, 2], [500, 8]]
    assert hybrid.slice_extents(runs, 40, 5) == [[900, 5]]
    with pytest.raises(ValueError):
        hybrid.slice_extents(runs, 40, 6)


def test_composite_blocks_round_trip_between_kv_tensors_and_the_store():
    """Two groups on their own tensors (one sliding, one full; vLLM's CPU layout [blocks, 2, B, H*D]):
    attachments are saved from several groups' blocks into scattered store pages and loaded back into
    other blocks of zeroed tensors: every page lands where its segment says, and a -1 page moves nothing."""
    layout = hybrid.layout_from_groups([(0, SlidingWindowSpec(**ATT, sliding_window=64), ["s"]),
                                        (1, FullAttentionSpec(**ATT), ["f"])])
    nb = 16
    kv = [torch.randint(-100, 100, (nb, 2, B, 128), dtype=torch.int16).view(torch.bfloat16) for _ in range(2)]
    geoms = [kv_geometry([kv[0]], nb), kv_geometry([kv[1]], nb)]
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(2, layout.attachment_bytes, 4096, seed=3)
    ex = executor_for(store, kv)
    absolute = [[[store.data_ptr() + o, n] for o, n in runs] for runs in extents]
    ex.run(hybrid.composite_plan(geoms, layout.attachment, [[3, 4], [7, 8]], absolute, to_kv=False))
    assert torch.equal(read_payload(store, extents[1]).view(-1)[:PAGE], kv[0][7].contiguous().view(torch.uint8).view(-1))
    blank = [torch.zeros_like(t) for t in kv]
    ex = executor_for(store, blank)
    ex.run(hybrid.composite_plan([kv_geometry([blank[0]], nb), kv_geometry([blank[1]], nb)], layout.attachment,
                                 [[-1, 10], [11, 12]], absolute, to_kv=True))
    bits = lambda t: t.view(torch.int16)  # noqa: E731  (random bits include NaNs, which compare unequal)
    assert [torch.equal(bits(blank[0][b]), bits(kv[0][a])) for a, b in ((4, 10), (7, 11), (8, 12))] == [True] * 3
    assert not bits(blank[0][9]).any() and not bits(blank[1]).any()  # the -1 page, and the other group, untouched


def vllm_config(tp: int = 1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, decode_context_parallel_size=1),
        model_config=SimpleNamespace(model="m", quantization=None, revision=None, use_mla=True),
        speculative_config=None)


def test_mla_namespaces_count_one_latent_per_token_and_one_copy_for_all_ranks():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a", "b"], mla)])
    (ns,) = engine_namespaces(vllm_config(), cfg)
    assert ns.block_bytes == 2 * 18432  # two layers of a 16 x 576 bf16 page: no V counted
    cfg.kv_tp_replicas = 2
    ranks = engine_namespaces(vllm_config(tp=2), cfg)
    assert len(ranks) == 2 and ranks[0] is ranks[1] and ranks[0].tp_size == 1 and "replicated" in ranks[0].layout


def test_hybrid_namespaces_anchor_the_attachment_to_the_spine_per_rank():
    groups = gemma_like()
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, s) for _, s, layers in groups])
    engine = vllm_config(tp=2)
    engine.model_config.use_mla = False
    per_rank = hybrid_namespaces(engine, cfg, hybrid.layout_from_groups(groups))
    assert [len(r) for r in per_rank] == [2, 2]
    for rank, (spine, attachment) in enumerate(per_rank):
        assert attachment.anchor == spine.id and spine.tp_rank == rank and attachment.block_bytes == 10 * PAGE
    # which boundaries are kept is no part of the bytes: engines that keep others share the blocks
    other = hybrid_namespaces(engine, cfg, hybrid.layout_from_groups(groups, boundary_interval=64 * B))
    assert [ns.id for r in other for ns in r] == [ns.id for r in per_rank for ns in r]
    windows = [(g, SlidingWindowSpec(**ATT, sliding_window=128), layers) for g, _, layers in groups[:5]] + groups[5:]
    assert hybrid_namespaces(engine, cfg, hybrid.layout_from_groups(windows))[0][0].id != per_rank[0][0].id


def test_an_engine_that_opts_in_to_compression_has_namespaces_of_its_own():
    from kvstore.connectors.vllm_meta import ConnectorConfig

    spec = FullAttentionSpec(**ATT)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec)])
    engine = vllm_config(tp=2)
    engine.model_config.use_mla = False
    exact, lossy = engine_namespaces(engine, cfg), engine_namespaces(engine, cfg, codec="k4v3")
    assert [ns.codec for ns in lossy] == ["k4v3", "k4v3"] and {ns.id for ns in exact}.isdisjoint(ns.id for ns in lossy)
    assert ConnectorConfig.from_extra({"compression": "smollm2-135m-3b"}).compression == "smollm2-135m-3b"
    with pytest.raises(ValueError, match="codec profile"):
        ConnectorConfig.from_extra({"compression": "../etc/passwd"})


def test_a_hybrid_engine_that_opts_in_stores_its_spine_encoded_and_its_attachments_exact():
    """The spine (here the full-attention layer) is read by the codec as a dense block of its layers; the
    attachments (windows) stay exact. Its namespaces are apart from the exact engine's, attachments
    included (anchored to the lossy spine). What cannot be compressed says why: a calibrated profile (bits
    per layer of the whole model), an MLA spine."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvstore.codec import BlockLayout

    if _get_attn_isa(torch.bfloat16, B, 64) not in ("vec", "vec16"):
        pytest.skip("this host's CPU attention runs other kernels (AMX) at this size")
    groups = gemma_like()
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, s) for _, s, layers in groups])
    engine = vllm_config(tp=1)
    engine.model_config.use_mla = False
    layout = hybrid.layout_from_groups(groups)
    assert hybrid_codec_unknown(engine, cfg, layout, "k4v2") == ""
    ((spine, attachment),) = hybrid_namespaces(engine, cfg, layout, codec="k4v2")
    ((exact_spine, exact_attachment),) = hybrid_namespaces(engine, cfg, layout)
    assert spine.codec == "k4v2" and attachment.codec == "" and attachment.anchor == spine.id
    assert {spine.id, attachment.id}.isdisjoint({exact_spine.id, exact_attachment.id})
    shape = BlockLayout.from_namespace(spine)
    assert shape is not None and shape.num_layers == 1 and shape.block_bytes == spine.block_bytes == PAGE
    assert BlockLayout.from_namespace(attachment) is None  # (never asked: it has no codec)
    assert "not a built-in uniform" in hybrid_codec_unknown(engine, cfg, layout, "smollm2-135m-3b")
    mla = [(0, SlidingWindowSpec(**ATT, sliding_window=64), ["l0"]),
           (1, MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=576, dtype=torch.bfloat16), ["l1"])]
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, s) for _, s, layers in mla])
    assert "MLA" in hybrid_codec_unknown(engine, cfg, hybrid.layout_from_groups(mla), "k4v2")


@pytest.mark.parametrize("block_size,head_size,known", [(32, 64, True), (16, 64, True), (32, 48, False)])
def test_compression_only_where_the_codec_knows_the_cpu_kernels_block_layout(block_size, head_size, known):
    """vLLM's CPU attention picks its kernels by block and head size (and AMX): the codec reads the `vec`
    and `vec16` kernels' blocks, of power-of-two heads; the connector stores exact blocks for the others
    (vllm.py logs why)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], spec)])
    engine = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    if known and _get_attn_isa(torch.bfloat16, block_size, head_size) not in ("vec", "vec16"):
        pytest.skip("this host's CPU attention runs other kernels (AMX) at this size")
    why = codec_layout_unknown(engine, cfg)
    assert (why == "") == known, why
    if not known:
        assert "power of two" in why


def test_an_engine_on_other_cpu_kernels_gets_namespaces_of_its_own(monkeypatch):
    """An engine whose CPU attention runs AMX kernels (a host with AMX; simulated by vLLM's own choice
    function answering "amx") lays its blocks out otherwise: its namespaces name the kernels, so it never
    shares blocks with a `vec` engine of the same model; the codec reads them. Kernels it does not know
    (NEON) get namespaces of their own too, and no compression."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec)])
    engine = vllm_config(tp=1)
    engine.model_config.use_mla = False
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "vec")
    vec = engine_namespaces(engine, cfg)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "amx")
    amx = engine_namespaces(engine, cfg)
    assert amx[0].layout == vec[0].layout + "/isa-amx" and amx[0].id != vec[0].id
    assert codec_layout_unknown(engine, cfg) == ""  # the codec reads AMX blocks (tests/test_codec.py)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "neon")
    assert engine_namespaces(engine, cfg)[0].layout == vec[0].layout + "/isa-neon"
    assert "'neon' kernels" in codec_layout_unknown(engine, cfg)
