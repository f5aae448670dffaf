"""What both sides of the vLLM connector share: its config, the namespace, the per-step metadata.

The namespace is derived from the engine config alone, identically in the
scheduler (EngineCore) and the workers: model (plus quantization and draft
model), KV dtype, layer count including draft layers, KV heads, head size,
block size, payload layout, TP rank/size. Engines whose KV bytes differ in any
of these never share a block. The worker checks the derived block size
against its real KV tensors and disables itself on a mismatch.

Metadata crosses process boundaries (EngineCore -> Worker by pickle) and holds
only plain values: block ids, hashes, step numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvstore.client import SPIN_US, check_spin_us
from kvstore.config import default_socket_path
from kvstore.keys import Namespace

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # the connector's two sides also run without vLLM (the GPU machines' checks carry no vLLM)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class ConnectorConfig:
    """`kv_connector_extra_config` keys (all optional)."""

    socket: str = ""  # daemon socket; default: $KVSTORE_SOCKET or the per-user default
    timeout_s: float = 5.0  # per RPC; past it the daemon counts as unavailable
    retry_s: float = 2.0  # how often to try reconnecting while the daemon is away
    spin_us: float = SPIN_US  # how long a call polls for its reply before it sleeps (0: it sleeps at once)
    load_async: bool = False  # report hits as asynchronous loads (completion through get_finished)
    save: bool = True  # store newly computed blocks
    load: bool = True  # look up and load hits
    model_id: str = ""  # namespace model name; default: the engine's model path/name
    boundary_interval: int = 0  # hybrid models: tokens between kept attachments (0: four windows, >= 16 blocks)
    # opt in to lossy storage: the codec profile (a built-in such as "k4v3", or one in the daemon's profile_dir)
    # whose compressed blocks this engine accepts; its blocks live in a namespace of their own (Namespace.codec)
    compression: str = ""
    attention_scores: bool = True  # send a key-norm attention estimate with each commit
    layer_loads: bool = True  # copy a step's loads layer by layer beside the forward (layer-outer layouts)
    copy_executor: str = "auto"  # CUDA: "auto" | "dma" (copy engines) | "kernel" (one Triton launch); host KV: copies
    kernel_piece_bytes: int = 28 << 10  # "auto" copies a load whose largest piece is smaller with the kernel (vLLM's bound)
    # fault injection, off by default and for tests only (the worker warns when it is on): this fraction
    # of load jobs fails at a random block (seeded), as if its copy had failed; vLLM recomputes from there
    fail_loads: float = 0.0
    fail_saves: float = 0.0  # this fraction of steps' saves fails after its reserve (reservations aborted)
    fault_seed: int = 0
    # prefill/decode disaggregation (connectors/vllm_scheduler.py):
    wait_s: float = 10.0  # a loader waits this long for blocks in flight (reserved/announced); 0 = never wait
    announce: bool | None = None  # announce prompt blocks before computing them; None = only as kv_producer

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys for the kvstore connector: {unknown}")
        cfg = cls(**extra)
        if cfg.timeout_s <= 0 or cfg.retry_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_s >= 0")
        check_spin_us(cfg.spin_us)
        if not 0 <= cfg.wait_s <= 600:
            raise ValueError("wait_s must be in 0..600 seconds")
        if cfg.copy_executor not in ("auto", "dma", "kernel"):
            raise ValueError(f"copy_executor must be auto, dma or kernel, got {cfg.copy_executor!r}")
        if cfg.compression and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", cfg.compression):
            raise ValueError(f"compression must name a codec profile, got {cfg.compression!r}")
        if cfg.boundary_interval < 0:
            raise ValueError("boundary_interval must be >= 0 tokens")
        if cfg.kernel_piece_bytes < 0:
            raise ValueError("kernel_piece_bytes must be >= 0")
        if not (0 <= cfg.fail_loads <= 1 and 0 <= cfg.fail_saves <= 1):
            raise ValueError("fail_loads and fail_saves must be fractions in 0..1")
        return cfg

    def for_role(self, kv_role: str | None) -> "ConnectorConfig":
        """Apply vLLM's kv_role the way its own connectors do (KVTransferConfig.is_kv_producer /
        is_kv_consumer): a kv_producer saves and never loads, a kv_consumer loads and never saves,
        kv_both (or no role) does both as configured. Only a kv_producer announces by default."""
        role = kv_role or "kv_both"
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"unknown kv_role {kv_role!r}; use kv_producer, kv_consumer or kv_both")
        announce = (role == "kv_producer") if self.announce is None else self.announce
        return replace(
            self,
            save=self.save and role != "kv_consumer",
            load=self.load and role != "kv_producer",
            announce=announce and role != "kv_consumer",
        )

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_name(vllm_config: "VllmConfig", model_id: str = "") -> str:
    """The namespaces' model name: the config's model_id or the engine's model, with what changes its KV
    for the same weights (quantization; a draft model, whose layers are in the engine's KV too)."""
    model = vllm_config.model_config
    name = model_id or str(model.model)
    if getattr(model, "quantization", None):
        name += f"|quant={model.quantization}"
    spec_cfg = vllm_config.speculative_config
    draft = getattr(getattr(spec_cfg, "draft_model_config", None), "model", None) if spec_cfg else None
    if draft and spec_cfg.method not in ("ngram", "suffix"):
        name += f"|draft={spec_cfg.method}:{draft}"
    return name


VEC_LAYOUT = ("vec", "vec16")  # vLLM's CPU kernels that lay a block out alike (tests/test_codec.py writes through both)


def cpu_attn_kernels(kv_cache_config: "KVCacheConfig") -> str:
    """The kind of kernels vLLM's CPU attention runs for this engine's KV ("vec", "vec16", "amx", "neon",
    ...; "" without an attention group). They decide how a block is laid out in memory."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if hasattr(spec, "head_size") and hasattr(spec, "dtype"):
            try:
                return _get_attn_isa(spec.dtype, spec.block_size, spec.head_size)
            except NotImplementedError:  # an fp8 cache the host cannot run: the engine fails on its own
                return ""
    return ""


def _base_layout(kv_cache_config: "KVCacheConfig") -> str:
    """`<device>/<vLLM's KV layout>`; on CPU with kernels that lay a block out otherwise than the `vec`
    ones (AMX, NEON, ...), `/isa-<kind>` too: an AMX host and an AVX-512 one have the same model and KV
    layout name but different bytes in a block, so they must not share blocks (through the remote tier)."""
    from vllm.platforms import current_platform

    base = f"{current_platform.device_type}/{kv_cache_config.kv_cache_layout or 'default'}"
    if current_platform.device_type == "cpu":
        isa = cpu_attn_kernels(kv_cache_config)
        if isa and isa not in VEC_LAYOUT:
            base += f"/isa-{isa}"
    return base


def codec_layout_unknown(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", spec=None) -> str:
    """Why the codec cannot read this engine's blocks ("" where it can): a shape it does not store (a head
    size that is not a power of two), or, on CPU, kernels whose block layout it does not know (it knows
    the `vec` and `vec16` kernels', kvstore/codec.py HKTVND, and the AMX ones', AMX); a block decoded in
    the wrong layout would be served wrong. `spec`: the KV cache spec of the layers stored (default: the
    first group's)."""
    from vllm.platforms import current_platform

    from kvstore.codec import BlockLayout

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if spec is None else spec
    isa = cpu_attn_kernels(kv_cache_config) if current_platform.device_type == "cpu" else ""
    if isa and isa not in VEC_LAYOUT + ("amx",):
        return f"vLLM's CPU attention runs its {isa!r} kernels here, whose block layout the codec does not know"
    try:
        BlockLayout(1, spec.num_kv_heads, spec.block_size, spec.head_size, _dtype_name(spec.dtype),
                    "AMX" if isa == "amx" else "HNC")
    except ValueError as exc:
        return f"the codec cannot store this KV shape ({exc})"
    return ""


def engine_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", boundary_interval: int = 0):
    """None for a dense model (one full-attention or MLA group: the connector's dense path), else the
    hybrid layout of its KV cache groups (connectors/hybrid.py). Raises ValueError, with the reason, for
    an engine whose KV the store cannot key (then the connector offers no hits and stores nothing)."""
    from kvstore.connectors.hybrid import FULL, layout_from_groups

    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("pipeline parallelism is not supported")
    groups = kv_cache_config.kv_cache_groups
    drafters = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    if drafters:
        raise ValueError(f"KV cache groups {drafters} hold a drafter's (EAGLE/MTP) layers, whose last block is "
                         f"volatile: not kept yet")
    not_kept = [i for i, g in enumerate(groups) if not getattr(g, "enable_kv_transfer", True)]
    layout = layout_from_groups([(i, g.kv_cache_spec, g.layer_names) for i, g in enumerate(groups) if i not in not_kept],
                                boundary_interval)
    if len(groups) == 1 and layout.groups[0].kind == FULL:
        return None
    return layout


def _replicated(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> bool:
    """Every TP rank holds the same KV (MLA: one latent per token, not split across heads): one namespace,
    written by rank 0 and read by all. Not with decode context parallelism, which splits tokens."""
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    return (tp > 1 and getattr(kv_cache_config, "kv_tp_replicas", 1) == tp
            and getattr(parallel, "decode_context_parallel_size", 1) == 1)


def engine_namespaces(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", model_id: str = "",
                      codec: str = "") -> list[Namespace]:
    """A dense engine's namespace per TP rank (index = rank): one for all ranks where they hold the same KV
    (MLA at TP > 1, see `_replicated`). `codec`: the engine's opt-in to lossy storage (`Namespace.codec`)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV cache groups: a hybrid model (connectors/hybrid.py)")
    spec = groups[0].kv_cache_spec
    num_layers = len(groups[0].layer_names)
    layout = _base_layout(kv_cache_config)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec):
        layout += "/mla"
    replicated = _replicated(vllm_config, kv_cache_config)
    tp_size = 1 if replicated else vllm_config.parallel_config.tensor_parallel_size
    names = [
        Namespace(
            model=model_name(vllm_config, model_id),
            dtype=_dtype_name(spec.dtype),
            num_layers=num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            block_tokens=spec.block_size,
            block_bytes=num_layers * spec.real_page_size_bytes,  # (MLA: one latent row per token, no V)
            layout=layout + ("/replicated" if replicated else ""),
            tp_rank=rank,
            tp_size=tp_size,
            revision=str(vllm_config.model_config.revision or ""),
            codec=codec,
        )
        for rank in range(tp_size)
    ]
    return names * vllm_config.parallel_config.tensor_parallel_size if replicated else names


def hybrid_codec_unknown(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", layout, codec: str) -> str:
    """Why a hybrid engine's spine blocks cannot be stored with `codec` ("" where they can). The spine holds
    the attention KV of its groups' layers, one layer's page after another as in a dense block, so the
    codec reads it as a dense block of those layers where every spine group has the same KV shape and no
    latent (MLA) layers. A calibrated profile gives bits per layer of the whole model, not of the spine:
    only the built-in uniform profiles (k4v2, k4v3, kivi-k4v2, ...) apply. The attachments (windows,
    recurrent state) are always stored exact."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstore.codec import BlockLayout
    from kvstore.codec_profile import uniform_profile

    groups = kv_cache_config.kv_cache_groups
    specs = [groups[layout.groups[s.group].group].kv_cache_spec for s in layout.spine]
    if any(isinstance(spec, MLAAttentionSpec) for spec in specs):
        return "the spine holds latent (MLA) KV, which the codec does not store"
    shapes = {(spec.num_kv_heads, spec.head_size, spec.dtype) for spec in specs}
    if len(shapes) != 1:
        return f"the spine's groups differ in KV shape {sorted(map(str, shapes))}"
    why = codec_layout_unknown(vllm_config, kv_cache_config, specs[0])
    if why:
        return why
    (spine, *_), *_ = hybrid_namespaces(vllm_config, kv_cache_config, layout, codec=codec)
    shape = BlockLayout.from_namespace(spine)
    if shape is None:
        return f"the codec cannot read the spine's {spine.block_bytes} B blocks as {spine.num_layers} layers of KV"
    if uniform_profile(codec, shape) is None:
        return (f"profile {codec!r} is not a built-in uniform one; a calibrated profile's bits are per layer of "
                f"the whole model, the spine holds {spine.num_layers} of its layers")
    return ""


def hybrid_namespaces(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", layout, model_id: str = "",
                      codec: str = "") -> list[list[Namespace]]:
    """A hybrid engine's namespaces per TP rank: [spine] or [spine, attachment] (anchored to the spine);
    their layout string carries a digest of `layout.describe()`, so engines share only identical layouts.
    `codec`: the spine's opt-in to lossy storage (see `hybrid_codec_unknown`); attachments stay exact."""
    import dataclasses

    import xxhash

    groups = kv_cache_config.kv_cache_groups
    first = groups[layout.groups[layout.spine[0].group].group].kv_cache_spec
    digest = xxhash.xxh3_64_hexdigest(layout.describe().encode())
    base = _base_layout(kv_cache_config) + f"/hybrid-{digest}"
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    out = []
    for rank in range(tp_size):
        spine = Namespace(
            model=model_name(vllm_config, model_id),
            dtype=_dtype_name(first.dtype),
            num_layers=sum(len(layout.groups[s.group].layers) for s in layout.spine),
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            block_tokens=layout.block_tokens,
            block_bytes=layout.spine_bytes,
            layout=base + f"/spine-{layout.spine_kind}",
            tp_rank=rank,
            tp_size=tp_size,
            revision=str(vllm_config.model_config.revision or ""),
            codec=codec,
        )
        names = [spine]
        if layout.attachment:
            names.append(dataclasses.replace(spine, block_bytes=layout.attachment_bytes, layout=base + "/attachment",
                                             num_layers=len({layout.groups[s.group].group for s in layout.attachment}),
                                             anchor=spine.id, codec=""))
        out.append(names)
    return out


# On GPU backends the connector asks vLLM for a block-outermost KV layout: one engine block then holds all
# layers contiguously, exactly a stored block's payload, so a load or save is one copy per block. CPU_ATTN
# accepts only LBHNC: there the connector asks for nothing. vLLM may still choose another layout (it logs a
# warning); the worker sees what it got from the tensors' strides (copy_plan.kv_geometry).
BLOCK_OUTERMOST_LAYOUT = "BLHNC"


def required_layout(device_type: str) -> str | None:
    return None if device_type == "cpu" else BLOCK_OUTERMOST_LAYOUT


def layer_order(kv_cache_config: "KVCacheConfig") -> list[str]:
    """Layer names in payload order (the group's order: the same in every engine of a namespace)."""
    return list(kv_cache_config.kv_cache_groups[0].layer_names)


# -- per-step metadata -----------------------------------------------------------------
@dataclass
class LoadJob:
    """Copy stored blocks into a request's newly allocated blocks."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    is_async: bool
    num_ready: int = -1  # leading blocks committed at lookup; the rest are in flight (-1: all ready)
    wait_s: float = 0.0  # how long the worker waits for the in-flight ones
    appear: bool = False  # also wait for blocks not yet reserved/announced (the proxy said they will come)

    @property
    def needs_wait(self) -> bool:
        return 0 <= self.num_ready < len(self.hashes)


@dataclass
class SaveBatch:
    """Newly completed full blocks of verified tokens, in chain order (a parent before its child)."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    parents: list[bytes | None] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    tokens: list[bytes | None] = field(default_factory=list)  # <u4 token ids, for the daemon's KV events
    # req id -> the block ids of a request admitted (or resumed) this step: vLLM's prefix cache may have
    # given it blocks that a synchronous load fills this step, and its forward attends to them
    admitted: dict[str, list[int]] = field(default_factory=dict)

    def add(self, req_id: str, block_id: int, block_hash: bytes, parent: bytes | None,
            tokens: bytes | None = None) -> None:
        self.req_ids.append(req_id)
        self.block_ids.append(block_id)
        self.hashes.append(block_hash)
        self.parents.append(parent)
        self.tokens.append(tokens)

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass
class StepMeta(KVConnectorMetadata):
    step: int
    loads: list[LoadJob] = field(default_factory=list)
    saves: SaveBatch = field(default_factory=SaveBatch)
    # engine blocks whose failed load the scheduler side read since the previous step's metadata: vLLM
    # recomputes them from this step on, so the workers' saves need not leave them out any more
    invalid_seen: set[int] = field(default_factory=set)


@dataclass
class HybridLoad:
    """Copy one hit of a hybrid model into a request's blocks (connectors/hybrid.py): spine blocks and the
    attachment at the hit's end, each with the engine block of each of its segments (-1: not copied)."""

    req_id: str
    spine: list[tuple[bytes, list[int] | None]]
    attachment: tuple[bytes, list[int] | None] | None
    broken: str = ""  # why the plan cannot be loaded (vLLM's allocation lacks a page): reported as failed


@dataclass
class HybridSave:
    """A request's spine blocks (hash, parent, engine block per segment) and attachments (hash, engine
    block per segment, -1: a page not saved) completed by a step."""

    req_id: str
    spine: list[tuple[bytes, bytes | None, list[int]]] = field(default_factory=list)
    attachments: list[tuple[bytes, list[int]]] = field(default_factory=list)


@dataclass
class HybridStepMeta(KVConnectorMetadata):
    step: int
    loads: list[HybridLoad] = field(default_factory=list)
    saves: list[HybridSave] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler each step: how many workers finished the loads of each step, and whether a
    worker disabled its side (its KV could not be mapped: every load it is given fails)."""

    loads_done: dict[int, int] = field(default_factory=dict)
    disabled: bool = False

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "WorkerReport":
        assert isinstance(other, WorkerReport)
        merged = dict(self.loads_done)
        for step, n in other.loads_done.items():
            merged[step] = merged.get(step, 0) + n
        return WorkerReport(merged, self.disabled or other.disabled)
