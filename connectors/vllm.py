"""vLLM KV connector: engines share prefix KV through the kvstore daemon.

Load it with

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/path/kvstore.sock"}}'

or the same dict as `vllm.LLM(kv_transfer_config=...)`. The extra config keys
are `kvstore.connectors.vllm_meta.ConnectorConfig`. "recompute" is the right failure
policy for a cache (a failed load is recomputed, never an error); the
connector sets it when the config says "fail" (vLLM's default), with a log line.

kv_role: "kv_both" saves and loads; "kv_producer" (a prefill engine) saves and
never loads, and announces the blocks it is about to save; "kv_consumer" (a
decode engine) loads and never saves, and waits up to `wait_s` for blocks a
producer has in flight (vllm_scheduler.py; server/pd_proxy.py runs the pair).

This class is thin: it picks the scheduler side (`vllm_scheduler.SchedulerSide`,
in EngineCore) or the worker side (`vllm_worker.WorkerSide`, in each Worker)
and forwards vLLM's hooks to it: the dense sides for a model of one full-attention
(or MLA) KV cache group, the hybrid sides (hybrid_scheduler.py, hybrid_worker.py)
for a model whose layers fall into several groups under vLLM's hybrid KV cache
manager, which stays on (the class is `SupportsHMA`). If the engine's KV is one the store
cannot key (pipeline parallelism, a group kind it does not keep), the connector logs a
warning with the reason and does nothing: the engine runs as if it had no connector.
Written against vLLM 0.32 and 0.33 (3-argument constructor).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from kvstore.connectors.vllm_meta import (
    ConnectorConfig,
    HybridStepMeta,
    StepMeta,
    codec_layout_unknown,
    engine_layout,
    engine_namespaces,
    hybrid_codec_unknown,
    hybrid_namespaces,
    layer_order,
    required_layout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST  # what the base class reports if the split below is unknown
    # vLLM has no member for a remote store: EXTERNAL_UNSPECIFIED is its documented bucket for one
    _SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "gpu": CacheHitSource.HOST,
                "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(cfg.kv_connector_extra_config).for_role(cfg.kv_role)
        self.scheduler = None
        self.worker = None
        self.layout = None  # a hybrid model's (connectors/hybrid.py); None: dense
        try:
            if kv_cache_config is None:
                raise ValueError("vLLM passed no kv_cache_config")
            self.layout = engine_layout(vllm_config, kv_cache_config, self.config.boundary_interval)
            if self.layout is None:
                codec = self.config.compression
                why = codec_layout_unknown(vllm_config, kv_cache_config) if codec else ""
                if why:
                    log.warning("kvstore connector: compression off (%s): blocks are stored exact", why)
                    codec = ""
                namespaces = engine_namespaces(vllm_config, kv_cache_config, self.config.model_id, codec)
            else:
                codec = self.config.compression
                why = hybrid_codec_unknown(vllm_config, kv_cache_config, self.layout, codec) if codec else ""
                if why:
                    log.warning("kvstore connector: compression off (%s): blocks are stored exact", why)
                    codec = ""
                elif codec:
                    log.info("kvstore connector: this hybrid model's spine blocks are stored with %s; its "
                             "attachments (windows, states) exact", codec)
                per_rank = hybrid_namespaces(vllm_config, kv_cache_config, self.layout, self.config.model_id, codec)
        except ValueError as exc:
            log.warning("kvstore connector disabled: %s", exc)
            return
        reason = _no_cached_context(vllm_config)
        if reason and self.config.load:
            log.warning("kvstore connector: this engine takes no hits (its blocks are still saved): %s", reason)
            self.config = dataclasses.replace(self.config, load=False)
        if self.layout is not None:
            self._start_hybrid(role, per_rank, kv_cache_config)
            return
        if role == KVConnectorRole.SCHEDULER:
            from kvstore.connectors.vllm_scheduler import SchedulerSide

            self._prefer_recompute()
            from vllm.platforms import current_platform

            unique = list({ns.id: ns for ns in namespaces}.values())  # (MLA: one for every rank)
            self.scheduler = SchedulerSide(self.config, unique, namespaces[0].block_tokens,
                                           device=current_platform.device_type, num_workers=len(namespaces))
        else:
            from kvstore.connectors.vllm_worker import WorkerSide

            rank = _tp_rank()
            config = self.config
            if rank > 0 and namespaces[rank] is namespaces[0]:  # ranks hold the same KV (MLA): rank 0 writes it
                config = dataclasses.replace(config, save=False)
            self.worker = WorkerSide(config, namespaces[rank], layer_order(kv_cache_config), kv_cache_config.num_blocks)

    def _start_hybrid(self, role: KVConnectorRole, per_rank: list, kv_cache_config: "KVCacheConfig") -> None:
        if self.config.wait_s and self.config.load and role == KVConnectorRole.SCHEDULER:
            log.info("kvstore connector: a hybrid model's loads take what is committed (no waits for blocks in flight)")
        if role == KVConnectorRole.SCHEDULER:
            from kvstore.connectors.hybrid_scheduler import HybridSchedulerSide

            self._prefer_recompute()
            self.scheduler = HybridSchedulerSide(self.config, per_rank, self.layout)
        else:
            from kvstore.connectors.hybrid_worker import HybridWorkerSide

            self.worker = HybridWorkerSide(self.config, per_rank[_tp_rank()], self.layout, kv_cache_config.num_blocks)

    def _prefer_recompute(self) -> None:
        cfg = self._kv_transfer_config
        if getattr(cfg, "kv_load_failure_policy", "recompute") != "recompute":
            try:
                cfg.kv_load_failure_policy = "recompute"
                log.info("kvstore connector: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
            except Exception:  # a frozen config: say what to set
                log.warning('kvstore connector: set "kv_load_failure_policy": "recompute" so failed loads are recomputed')

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Block-outermost (BLHNC) on GPU backends, nothing on CPU (vllm_meta.required_layout)."""
        from vllm.platforms import current_platform

        return required_layout(current_platform.device_type)

    # requires_piecewise_for_cudagraph stays False: on GPUs the connector asks for a block-outermost
    # layout, where loads are whole-step (one copy per block) and full CUDA graphs are safe. Where vLLM
    # keeps a layer-outer layout and a graph skips wait_for_layer_load, the worker sees it (the step's
    # loads count as failed and are recomputed) and copies whole steps from then on.

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, (StepMeta, HybridStepMeta)):
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)  # layer-wise loads (connectors/vllm_worker.py)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # saves happen once per step in wait_for_save, after the draft model too

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, (StepMeta, HybridStepMeta)):
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None or self.layout is not None:
            return None, None
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid model's loads report failures per request (`failed_recving`, also in finished_recving):
        with several KV cache groups vLLM takes no failed block ids."""
        if self.worker is None or self.layout is None:
            return super().get_transfer_results(finished_req_ids)
        finished, failed = self.worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None or self.layout is not None:
            return set()
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker.build_worker_meta() if self.worker is not None else None

    # -- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Hit tokens by the store tier that held them: HOST for the arena, DISK for blocks the
        daemon promoted from NVMe for this load. (The store's GPU tier is another process's
        VRAM reached through the host path, so it counts as HOST, not this engine's DEVICE.)"""
        if num_external_tokens == 0:
            return {}
        split = self.scheduler.hit_tiers(request, num_external_tokens) if self.scheduler is not None else {}
        if not split:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        for tier, tokens in split.items():
            source = self._SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.scheduler is None:
            return StepMeta(step=-1)  # (an empty step for either side)
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.scheduler is None:
            return
        if self.layout is not None:
            self.scheduler.update_connector_output(connector_output)
            return
        stale = self.scheduler.update_connector_output(connector_output)
        manager = getattr(self, "_kv_cache_manager", None)  # bound by vLLM (bind_kv_cache_manager)
        if stale and manager is not None:
            # a failed load's blocks, and those computed on them, must not be prefix-cache hits before their
            # request has recomputed them (vLLM evicts them itself only with the "fail" policy)
            manager.evict_blocks(stale)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call under its hybrid KV cache manager (every KV cache group's blocks): saves are made in
        the steps that complete them, so nothing is left to do with the blocks (they may be freed now)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """The KV cache groups a load writes: every group of a hybrid layout (a window or state group only
        at the positions its hit needs, which are all vLLM allocates for it)."""
        if self.layout is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return tuple(g.group for g in self.layout.groups)

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.shutdown()


def _no_cached_context(vllm_config: "VllmConfig") -> str:
    """Why this engine cannot compute a prompt from a loaded prefix ("" where it can). vLLM's CPU MLA
    backend computes a prompt from its first token only (the CPU platform turns prefix caching and chunked
    prefill off for it): measured, a hit of byte-identical KV gives other tokens than a cold prefill."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    if current_platform.device_type == "cpu" and getattr(model, "use_mla", False) \
            and not vllm_config.cache_config.enable_prefix_caching:
        return "vLLM's CPU MLA backend computes prompts without a cached context (its prefix caching is off)"
    return ""


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process, tests)
        return 0
