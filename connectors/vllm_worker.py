"""Worker side of the vLLM connector (lives in each Worker): vLLM's worker hooks, dispatched to one
small handler per transfer kind over one plan executor.

- `EngineKV` (engine_kv.py): the engine's KV geometry, the store memory this
  process maps, and the transfers that run copy plans on the KV's device —
  host copies (cpu_copy.py) or, on CUDA, the copy engines or one Triton kernel
  on a side stream ordered by events (cuda_copy.py). The handlers do not know
  which.
- `StepLoads` / `WaitedLoads` (worker_loads.py): a step's loads, whole-step or
  layer by layer beside the forward, and loads that wait for blocks a producer
  engine is still computing.
- `Saves` (worker_saves.py): a step's new full blocks out to the store.
- `KeyNormScorer` (attention_score.py): the attention estimate sent with commits.

Hook order in a step: `start_load_kv` (loads start) -> the forward, which calls
`wait_for_layer_load` before each attention layer -> `wait_for_save` (the
step's loads end: failures reported, pins released once copies are done; then
saves) -> `get_finished` / `get_block_ids_with_load_errors` /
`build_worker_meta` (reports to the scheduler side). A failed or missing load
is reported and recomputed, never served: a request whose load failed in a
step saves none of its blocks in that step (its forward attended to whatever
the failed blocks held), and neither does a request admitted in that step whose
blocks include a failed one (vLLM caches a synchronous load's blocks when it
allocates them, so a request admitted after it in the same step shares them).

Every RPC is batched per step (acquire, release, reserve, commit), and nothing
outlives the step on the host path; on the GPU path, pins and commits wait for
their copies' events, polled at the next hooks.
"""

from __future__ import annotations

import logging

import torch

from kvstore.connectors.attention_score import KeyNormScorer
from kvstore.connectors.engine_kv import EngineKV, FaultInjector
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm_meta import ConnectorConfig, StepMeta, WorkerReport
from kvstore.connectors.worker_loads import LoadReport, StepLoads, WaitedLoads, run_guarded
from kvstore.connectors.worker_saves import Saves, without_requests
from kvstore.keys import Namespace

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, layer_names: list[str], num_blocks: int) -> None:
        self.config = config
        self.namespace = namespace
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.link = StoreLink.of(config, [namespace], "vllm-worker")
        self.engine: EngineKV | None = None
        self.report = LoadReport()
        self.faults = FaultInjector(config.fail_loads, config.fault_seed, config.fail_saves)
        if config.fail_loads or config.fail_saves:
            log.warning("kvstore: fault injection is on (fail_loads=%s, fail_saves=%s, fault_seed=%s): for tests only",
                        config.fail_loads, config.fail_saves, config.fault_seed)
        self.loads = StepLoads(config, self.link, self.report, self.faults, layer_names)
        self.waited = WaitedLoads(config, namespace, self.report, self.faults)
        self.saves = Saves(self.link, None, self.faults)
        self._loads_done: dict[int, int] = {}
        self._registered = False

    @property
    def wait_stats(self) -> dict:
        return self.report.stats

    # -- setup ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._registered = True  # from now on, no engine means a disabled worker side
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            log.warning("kvstore connector disabled: KV tensors missing for layers %s", missing[:3])
            return
        tensors = [kv_caches[n] for n in self.layer_names]
        try:
            engine = EngineKV(tensors, self.num_blocks, self.config.copy_executor, self.config.kernel_piece_bytes)
        except (ValueError, RuntimeError, ImportError) as exc:
            log.warning("kvstore connector disabled: %s", exc)
            return
        if engine.block_bytes != self.namespace.block_bytes:
            log.warning("kvstore connector disabled: a block is %d B in the KV tensors but %d B by the config",
                        engine.block_bytes, self.namespace.block_bytes)
            engine.close()
            return
        self.engine = engine
        geom = engine.geometry
        shape = ("block-outermost: one copy per block" if geom.block_outermost
                 else f"{geom.size.size} pieces per block (layer-outer)")
        log.info("kvstore connector: KV on %s, %s, %d B per block", engine.device, shape, engine.block_bytes)
        if engine.device != "cpu" and not geom.block_outermost:
            log.warning("kvstore connector: vLLM kept a layer-outer KV layout (the attention backend refused %s?): "
                        "a load copies %d pieces per block", "BLHNC", geom.size.size)
        if self.config.attention_scores:
            self.saves.scorer = KeyNormScorer(tensors, self.namespace.block_tokens)
        self.link.client()  # connect now: mapping the arena costs ~0.1 s per GiB, not a first request's TTFT
        engine.memory(self.link)

    # -- loads --------------------------------------------------------------------
    def start_load_kv(self, meta: StepMeta) -> None:
        self.loads.finish()  # a step whose end this worker did not see (never expected)
        self.report.begin_step(meta.step)
        if not meta.loads:
            return
        if self.engine is None:
            self.report.fail_all(meta.loads, "the connector's worker side is disabled")
            # vLLM holds a request with an asynchronous (or waited) load until it is reported finished
            self.report.finished.update(job.req_id for job in meta.loads if job.is_async)
        else:
            waiting = [job for job in meta.loads if job.needs_wait]
            now = [job for job in meta.loads if not job.needs_wait]
            if now:
                self.loads.start(self.engine, now)
            if waiting:
                self.waited.start(self.engine, waiting)
        self._loads_done[meta.step] = 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.wait_layer(layer_name)

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: StepMeta) -> None:
        self.loads.finish()  # before the filter below: a failed copy is a failed load
        saves = meta.saves
        if self.engine is None:
            return
        self.saves.commit_done()
        if not len(saves):
            return
        self.report.acknowledged(meta.invalid_seen, meta.step)
        failed, bad = self.report.tainted()
        if failed:
            # A failed load left garbage in the request's blocks, and this step's forward attended to it:
            # save none of that request's blocks (vLLM recomputes them), nor of a request admitted this step
            # whose blocks include a failed one (vLLM's prefix cache shared them with it). Until the
            # scheduler side has read the failure (StepMeta.invalid_seen), not in later steps either: with
            # asynchronous scheduling vLLM plans the next step before it reads this one's output.
            sharing = {r for r, ids in saves.admitted.items() if bad.intersection(ids)}
            saves = without_requests(saves, failed | sharing)
        if len(saves):
            self.saves.save(self.engine, saves)

    # -- per-step reports ---------------------------------------------------------------
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self.loads.finish()
        if self.engine is not None:
            self.waited.submit_ready(self.engine)
            self.saves.commit_done()
            self.loads.release_done()
        done = self.report.take_finished()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.loads.finish()
        return self.report.take_failed_blocks()

    def build_worker_meta(self) -> WorkerReport | None:
        disabled = self.engine is None and self._registered  # the scheduler side stops offering hits
        if not self._loads_done and not disabled:
            return None
        report, self._loads_done = WorkerReport(self._loads_done, disabled), {}
        return report

    def shutdown(self) -> None:
        run_guarded("the last step's loads", self.loads.finish)
        run_guarded("releasing loads", lambda: self.loads.release_done(block=True))
        run_guarded("the last saves", lambda: self.saves.commit_done(block=True))
        self.waited.close()
        if self.engine is not None:
            self.engine.close()
        self.link.close()
