"""Worker side of the vLLM connector (lives in each Worker): moves whole blocks, batched per step.

* Loads (`start_load_kv`): one `acquire(prefix=False)` RPC on this worker's own
  connection pins every block of the step's LoadJobs and returns their arena
  extents, the blocks are copied arena -> paged KV (all layers, draft layers
  included), one `release` RPC unpins them. A block that is missing, a daemon
  that is away, or a copy that fails marks that block and the rest of its job
  as load errors (`get_block_ids_with_load_errors`): vLLM recomputes them
  (kv_load_failure_policy="recompute").
* Saves (`wait_for_save`, after the target and draft forwards): one `reserve`
  RPC for the step's SaveBatch, copies paged KV -> arena, one `commit` RPC
  (with a key-norm attention estimate per block when available, and the
  blocks' token ids when the scheduler side sent them, for KV events). A failed copy
  aborts the step's reservations; a save that cannot happen is a future miss.

Nothing here is per block per RPC, and nothing outlives the step: saves are
synchronous, so vLLM may free or reuse the blocks as soon as the step ends.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from connectors.kv_copy import PagedKV, arena_tensor
from connectors.store_link import StoreLink
from connectors.vllm_meta import ConnectorConfig, LoadJob, SaveBatch, StepMeta, WorkerReport
from kvstore.keys import Namespace
from kvstore.protocol import metadata_frame_bytes

log = logging.getLogger(__name__)

SCORE_LAYERS = 2  # layers sampled for the attention estimate


def _default_scorer() -> Callable | None:
    try:
        from eviction.attention import block_key_norm_score
    except ImportError:
        return None
    return block_key_norm_score


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, layer_names: list[str], num_blocks: int) -> None:
        self.config = config
        self.namespace = namespace
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.link = StoreLink(config.socket_path, [namespace], config.timeout_s, config.retry_s, "vllm-worker")
        self.kv: PagedKV | None = None
        self.scorer = _default_scorer() if config.attention_scores else None
        self._arena_src = None
        self._arena: torch.Tensor | None = None
        self._failed_blocks: set[int] = set()
        self._finished_recving: set[str] = set()
        self._loads_done: dict[int, int] = {}
        self._failed_reqs: tuple[int, set[str]] = (-1, set())  # (step, requests whose load failed in it)

    # -- setup ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            log.warning("kvstore connector disabled: KV tensors missing for layers %s", missing[:3])
            return
        kv = PagedKV([kv_caches[n] for n in self.layer_names], self.num_blocks)
        if kv.block_bytes != self.namespace.block_bytes:
            log.warning(
                "kvstore connector disabled: a block is %d B in the KV tensors but %d B by the config",
                kv.block_bytes, self.namespace.block_bytes,
            )
            return
        self.kv = kv
        self.link.client()  # connect now: mapping the arena costs ~0.1 s per GiB, not a first request's TTFT

    def _arena_view(self) -> torch.Tensor | None:
        src = self.link.arena
        if src is None:
            return None
        if src is not self._arena_src:  # a new connection maps a new arena
            self._arena_src, self._arena = src, arena_tensor(src)
        return self._arena

    # -- loads --------------------------------------------------------------------
    def start_load_kv(self, meta: StepMeta) -> None:
        if not meta.loads:
            return
        self._failed_reqs = (meta.step, set())
        if self.kv is None:
            self._fail_all(meta.loads)
        else:
            self._load(meta.loads)
        for job in meta.loads:
            if job.is_async:
                self._finished_recving.add(job.req_id)
        self._loads_done[meta.step] = 1

    def _load(self, jobs: list[LoadJob]) -> None:
        hashes = [h for job in jobs for h in job.hashes]
        extents = self.link.run("acquire", lambda c: c.acquire(self.link.ns_ids[0], hashes, prefix=False))
        arena = self._arena_view()
        if extents is None or arena is None:
            self._fail_all(jobs)
            return
        generation = self.link.generation
        pos = 0
        try:
            for job in jobs:
                self._load_job(job, extents[pos : pos + len(job.hashes)], arena)
                pos += len(job.hashes)
        finally:
            held = [h for h, e in zip(hashes, extents) if e is not None]
            if held and self.link.generation == generation:
                self.link.run("release", lambda c: c.release(self.link.ns_ids[0], held))

    def _load_job(self, job: LoadJob, extents: Sequence, arena: torch.Tensor) -> None:
        assert self.kv is not None
        for i, (block_id, ext) in enumerate(zip(job.block_ids, extents)):
            if ext is None:
                self._fail(job, i, "block no longer stored")
                return
            try:
                self.kv.load_from_arena(arena, block_id, ext)
            except Exception as exc:  # never let the engine crash on a load
                self._fail(job, i, f"copy failed: {exc!r}")
                return

    def _fail(self, job: LoadJob, first: int, why: str) -> None:
        log.warning("kvstore: load of %s failed at block %d/%d (%s); vLLM recomputes", job.req_id, first, len(job.block_ids), why)
        self._failed_blocks.update(job.block_ids[first:])
        self._failed_reqs[1].add(job.req_id)

    def _fail_all(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._fail(job, 0, "store unavailable")

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: StepMeta) -> None:
        saves = meta.saves
        if not len(saves) or self.kv is None:
            return
        step, failed = self._failed_reqs
        if step == meta.step and failed:
            # a failed load left garbage in the request's blocks, and this step's forward
            # attended to it: save none of that request's blocks (vLLM recomputes them)
            saves = _without_requests(saves, failed)
        slots = self.link.run("reserve", lambda c: c.reserve(self.link.ns_ids[0], list(zip(saves.hashes, saves.parents))))
        arena = self._arena_view()
        if slots is None or arena is None:
            return
        generation = self.link.generation
        reserved = [i for i, ext in enumerate(slots) if ext is not None]
        if not reserved:
            return
        hashes = [saves.hashes[i] for i in reserved]
        ns_id = self.link.ns_ids[0]
        try:
            for i in reserved:
                self.kv.save_to_arena(arena, saves.block_ids[i], slots[i])
        except Exception as exc:
            log.warning("kvstore: save copy failed (%r); aborting %d reserved blocks", exc, len(hashes))
            if self.link.generation == generation:
                self.link.run("abort", lambda c: c.abort(ns_id, hashes))
            return
        attention = self._attention([saves.block_ids[i] for i in reserved])
        tokens = [saves.tokens[i] for i in reserved] if any(saves.tokens) else None
        if self.link.generation == generation:
            self.link.run("commit",
                          lambda c: c.commit(ns_id, hashes, attention=attention, tokens=_fitting(c, tokens)))

    def _attention(self, block_ids: list[int]) -> list[float] | None:
        """The attention estimate of each block from the keys of a few sampled layers (None if unavailable)."""
        if self.scorer is None or self.kv is None or len(block_ids) < 2:
            return None
        try:
            num_layers = len(self.kv.views)
            layers = sorted({num_layers // 2, num_layers - 1})[:SCORE_LAYERS]
            keys = [self.kv.block_keys(layer, block_ids, self.namespace.block_tokens) for layer in layers]
            if any(k is None for k in keys):
                return None
            scores = self.scorer(torch.stack(keys), self.namespace.block_tokens)
            return [float(s) for s in scores]
        except Exception as exc:  # the estimate is advisory
            log.debug("attention estimate failed: %r", exc)
            return None

    # -- per-step reports ---------------------------------------------------------------
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_worker_meta(self) -> WorkerReport | None:
        if not self._loads_done:
            return None
        report, self._loads_done = WorkerReport(self._loads_done), {}
        return report

    def shutdown(self) -> None:
        self.link.close()


def _without_requests(saves: SaveBatch, req_ids: set[str]) -> SaveBatch:
    kept = SaveBatch()
    for r, b, h, p, t in zip(saves.req_ids, saves.block_ids, saves.hashes, saves.parents, saves.tokens):
        if r not in req_ids:
            kept.add(r, b, h, p, t)
    return kept


def _fitting(client, tokens: list | None) -> list | None:
    """The token ids, unless they would push the commit over the daemon's frame limit (then the
    blocks are committed without them: KV events carry no token ids for them)."""
    if tokens is None:
        return None
    size = metadata_frame_bytes(len(tokens)) + sum(len(t) + 8 for t in tokens if t is not None)
    return tokens if size <= client.server_info.get("max_frame_bytes", 0) else None
