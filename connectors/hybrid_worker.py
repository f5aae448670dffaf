"""Worker side of the vLLM connector for hybrid models (lives in each Worker).

One KV geometry per KV cache group of the layout (connectors/hybrid.py), over that group's layers (a
Mamba layer's state tensors count as its layers), checked against the layout's page bytes; one
`EngineKV` over every KV tensor runs the plans. A stored block is cut into its segments' pages
(`hybrid.composite_plan`).

- Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS, its blocks are vLLM's alone): a
  job's spine blocks and attachment are pinned with this worker's own connection, copied whole, and the
  request is reported through `transfer_results` once the copy is done — in `failed` as well when
  anything of it did not load (a miss, a broken plan, a copy error), so that vLLM recomputes the request
  (`failed_recving`: with several groups it takes failures per request only). Pins are released when
  the copy is done.
- Saves, after the step's forward (`wait_for_save`): one reserve per namespace kind (spine, then
  attachments, anchored to the spine), one copy plan, then commits in the same order — a spine block
  is committed before the attachment that hangs under it.

A worker whose KV does not match the layout disables itself (its loads are reported failed, the
scheduler side offers no more hits).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstore.connectors.copy_plan import EMPTY_PLAN, CopyPlan, KVGeometry, kv_geometry
from kvstore.connectors.engine_kv import EngineKV, FaultInjector
from kvstore.connectors.hybrid import ATTACHMENT, SPINE, HybridLayout, composite_plan
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm_meta import ConnectorConfig, HybridLoad, HybridSave, HybridStepMeta, WorkerReport
from kvstore.connectors.worker_loads import run_guarded
from kvstore.keys import Namespace

log = logging.getLogger(__name__)


def _concat(plans: list[CopyPlan]) -> CopyPlan:
    import numpy as np

    plans = [p for p in plans if len(p)]
    if not plans:
        return EMPTY_PLAN
    if len(plans) == 1:
        return plans[0]
    return CopyPlan(*(np.concatenate([getattr(p, f) for p in plans]) for f in ("src", "dst", "size", "layer")))


@dataclass
class _Loading:
    jobs: list[HybridLoad]
    held: dict[int, list[bytes]]  # slot -> hashes pinned by this worker
    generation: int
    ticket: object
    failed: set[str] = field(default_factory=set)


@dataclass
class _Saving:
    ticket: object
    hashes: dict[int, list[bytes]]  # slot -> hashes reserved (spine first)
    generation: int


class HybridWorkerSide:
    def __init__(self, config: ConnectorConfig, namespaces: list[Namespace], layout: HybridLayout,
                 num_blocks: int) -> None:
        self.config, self.layout, self.num_blocks = config, layout, num_blocks
        self.link = StoreLink.of(config, namespaces, "vllm-worker")
        self.engine: EngineKV | None = None
        self.geometries: list[KVGeometry] = []
        self.faults = FaultInjector(config.fail_loads, config.fault_seed, config.fail_saves)
        if config.fail_loads or config.fail_saves:
            log.warning("kvstore: fault injection is on (fail_loads=%s, fail_saves=%s, fault_seed=%s): for tests only",
                        config.fail_loads, config.fail_saves, config.fault_seed)
        self._loading: list[_Loading] = []
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._loads_done: dict[int, int] = {}
        self._saving: list[_Saving] = []
        self._registered = False
        self.stats = {"jobs": 0, "loaded_blocks": 0, "failed_jobs": 0, "saved_blocks": 0, "saved_attachments": 0}

    # -- setup ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._registered = True
        try:
            tensors: list = []
            for g in self.layout.groups:
                mine = [t for name in g.layers for t in _tensors(kv_caches[name])]
                geom = kv_geometry(mine, self.num_blocks)
                if geom.block_bytes != g.page_bytes:
                    raise ValueError(f"KV cache group {g.group}: a block is {geom.block_bytes} B in the KV tensors "
                                     f"but {g.page_bytes} B by the config")
                self.geometries.append(geom)
                tensors += mine
            engine = EngineKV(tensors, self.num_blocks, self.config.copy_executor, self.config.kernel_piece_bytes,
                              geometry=self.geometries[0])
        except (KeyError, ValueError, RuntimeError, ImportError) as exc:
            log.warning("kvstore connector disabled: %r", exc)
            self.geometries = []
            return
        self.engine = engine
        log.info("kvstore connector: hybrid KV on %s, %d groups, %d B spine blocks, %d B attachments",
                 engine.device, len(self.layout.groups), self.layout.spine_bytes, self.layout.attachment_bytes)
        self.link.client()
        engine.memory(self.link)

    # -- loads ----------------------------------------------------------------------------------------
    def start_load_kv(self, meta: HybridStepMeta) -> None:
        if not meta.loads:
            return
        self._loads_done[meta.step] = 1
        self.stats["jobs"] += len(meta.loads)
        if self.engine is None:
            self._fail(meta.loads, "the connector's worker side is disabled")
            return
        run_guarded("a hybrid load", lambda: self._load(meta.loads))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous and whole: done before the request's forward runs

    def _fail(self, jobs, why: str) -> None:
        for job in jobs:
            log.warning("kvstore: load of %s failed (%s); vLLM recomputes it", job.req_id, why)
            self._failed.add(job.req_id)
            self._finished.add(job.req_id)
        self.stats["failed_jobs"] += len(jobs)

    def _load(self, jobs: list[HybridLoad]) -> None:
        engine, link = self.engine, self.link
        broken = [job for job in jobs if job.broken]
        self._fail(broken, broken[0].broken if broken else "")
        jobs = [job for job in jobs if not job.broken]
        mem = engine.memory(link) if jobs else None
        if not jobs or mem is None:
            self._fail(jobs, "store unavailable")
            return
        wanted = {SPINE: [h for job in jobs for h, _ in job.spine],
                  ATTACHMENT: [job.attachment[0] for job in jobs if job.attachment is not None]}
        got = link.run("acquire", lambda c: {slot: c.acquire(link.ns_ids[slot], hs, prefix=False) if hs else []
                                             for slot, hs in wanted.items()})
        if got is None:
            self._fail(jobs, "store unavailable")
            return
        held = {slot: [h for h, e in zip(wanted[slot], got[slot]) if e is not None] for slot in wanted}
        loading = _Loading(jobs, held, link.generation, None)
        plans, pos = [], {SPINE: 0, ATTACHMENT: 0}
        for job in jobs:
            spine = got[SPINE][pos[SPINE] : pos[SPINE] + len(job.spine)]
            pos[SPINE] += len(job.spine)
            att = None
            if job.attachment is not None:
                att = got[ATTACHMENT][pos[ATTACHMENT]]
                pos[ATTACHMENT] += 1
            if any(e is None for e in spine) or (job.attachment is not None and att is None):
                loading.failed.add(job.req_id)  # evicted since the lookup
                continue
            if self.faults.first_failed(len(job.spine)) is not None:
                loading.failed.add(job.req_id)
                continue
            try:
                plans.append(composite_plan(self.geometries, self.layout.spine, [ids for _, ids in job.spine],
                                            [mem.absolute(e, "host") for e in spine], to_kv=True))
                if att is not None:
                    plans.append(composite_plan(self.geometries, self.layout.attachment, [job.attachment[1]],
                                                [mem.absolute(att, "host")], to_kv=True))
            except (ValueError, IndexError) as exc:
                log.warning("kvstore: no copy plan for %s (%r)", job.req_id, exc)
                loading.failed.add(job.req_id)
        loading.ticket = engine.transfers.load(_concat(plans))
        self._loading.append(loading)
        self.stats["loaded_blocks"] += sum(len(job.spine) for job in jobs if job.req_id not in loading.failed)

    def _finish_loads(self, block: bool = False) -> None:
        keep = []
        for item in self._loading:
            if not block and not item.ticket.done():
                keep.append(item)
                continue
            error = item.ticket.finish()
            failed = {job.req_id for job in item.jobs} if error is not None else item.failed
            if error is not None:
                log.warning("kvstore: a hybrid load's copy failed (%r); vLLM recomputes its requests", error)
            for job in item.jobs:
                self._finished.add(job.req_id)
            self._failed |= failed
            self.stats["failed_jobs"] += len(failed)
            if self.link.generation == item.generation:
                for slot, hs in item.held.items():
                    if hs:
                        self.link.post("release", "release", ns=self.link.ns_ids[slot], hashes=hs)
        self._loading = keep

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(requests whose load ended, those of them that failed): vLLM's finished_recving and failed_recving."""
        self._finish_loads()
        self._commit_done()
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    # -- saves ------------------------------------------------------------------------------------------
    def wait_for_save(self, meta: HybridStepMeta) -> None:
        self._finish_loads()
        if self.engine is None or not meta.saves:
            return
        run_guarded("hybrid saves", lambda: self._save(meta.saves))

    def _save(self, saves: list[HybridSave]) -> None:
        engine, link = self.engine, self.link
        mem = engine.memory(link)
        if mem is None:
            return
        blocks = {SPINE: [(h, p) for s in saves for h, p, _ in s.spine],
                  ATTACHMENT: [(h, h) for s in saves for h, _ in s.attachments]}  # an attachment hangs under its spine block
        ids = {SPINE: [i for s in saves for _, _, i in s.spine], ATTACHMENT: [i for s in saves for _, i in s.attachments]}
        answer = link.run("reserve", lambda c: {slot: c.reserve(link.ns_ids[slot], bs) if bs else []
                                                for slot, bs in blocks.items()})
        if answer is None:
            return
        reserved = {slot: [k for k, e in enumerate(answer[slot]) if e is not None] for slot in blocks}
        hashes = {slot: [blocks[slot][k][0] for k in reserved[slot]] for slot in blocks}
        generation = link.generation
        if not any(hashes.values()):
            return
        segments = {SPINE: self.layout.spine, ATTACHMENT: self.layout.attachment}
        try:
            plan = _concat([composite_plan(self.geometries, segments[slot], [ids[slot][k] for k in reserved[slot]],
                                           [mem.absolute(answer[slot][k], "host") for k in reserved[slot]], to_kv=False)
                            for slot in blocks if reserved[slot]])
            if self.faults.save_fails():
                raise RuntimeError("injected save failure (fail_saves)")
        except (ValueError, IndexError, RuntimeError) as exc:
            self._abort(hashes, generation, exc)
            return
        ticket = engine.transfers.save(plan)
        if ticket.error is not None:
            self._abort(hashes, generation, ticket.error)
            return
        self._saving.append(_Saving(ticket, hashes, generation))
        self._commit_done()

    def _abort(self, hashes: dict[int, list[bytes]], generation: int, exc: BaseException | None) -> None:
        """Give back reservations: the attachments first (the daemon aborts no block while one is reserved
        under it)."""
        if exc is not None:
            log.warning("kvstore: save copy failed (%r); aborting its reservations", exc)
        if self.link.generation == generation:
            self.link.run("abort", lambda c: [c.abort(self.link.ns_ids[slot], hashes[slot])
                                              for slot in (ATTACHMENT, SPINE) if hashes.get(slot)])

    def _commit_done(self, block: bool = False) -> None:
        keep = []
        for item in self._saving:
            if not block and not item.ticket.done():
                keep.append(item)
                continue
            error = item.ticket.finish()
            if error is not None:
                self._abort(item.hashes, item.generation, error)
            elif self.link.generation == item.generation:
                self._commit(item)
        self._saving = keep

    def _commit(self, item: _Saving) -> None:
        """Spine first (an attachment's parent is committed before it); what a failed commit leaves
        reserved is aborted, so that nothing stays reserved under this connection."""
        link, spine, attachments = self.link, item.hashes.get(SPINE), item.hashes.get(ATTACHMENT)
        if spine and link.run("commit", lambda c: c.commit(link.ns_ids[SPINE], spine)) is None:
            self._abort(item.hashes, item.generation, None)
            return
        self.stats["saved_blocks"] += len(spine or ())
        if attachments and link.run("commit", lambda c: c.commit(link.ns_ids[ATTACHMENT], attachments)) is None:
            self._abort({ATTACHMENT: attachments}, item.generation, None)
            return
        self.stats["saved_attachments"] += len(attachments or ())

    # -- reports ----------------------------------------------------------------------------------------
    def build_worker_meta(self) -> WorkerReport | None:
        disabled = self.engine is None and self._registered
        if not self._loads_done and not disabled:
            return None
        report, self._loads_done = WorkerReport(self._loads_done, disabled), {}
        return report

    def shutdown(self) -> None:
        run_guarded("the last loads", lambda: self._finish_loads(block=True))
        run_guarded("the last saves", lambda: self._commit_done(block=True))
        if self.engine is not None:
            self.engine.close()
        self.link.close()


def _tensors(value) -> list:
    """A layer's KV tensors: one, or a Mamba layer's state tensors (a list on some platforms)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
