"""Worker side of the vLLM connector (lives in each Worker): moves whole blocks, batched per step.

* Loads (`start_load_kv`): one `acquire(prefix=False)` RPC on this worker's own
  connection pins every block of the step's LoadJobs and returns their arena
  extents, the blocks are copied arena -> paged KV (all layers, draft layers
  included), one `release` RPC unpins them. A block that is missing, a daemon
  that is away, or a copy that fails marks that block and the rest of its job
  as load errors (`get_block_ids_with_load_errors`): vLLM recomputes them
  (kv_load_failure_policy="recompute").
* Layer by layer (`layer_loads`, on by default, CPU layouts): a step's loads that
  feed its forward are copied by a helper thread one layer at a time, in the
  order the forward reaches the layers, while the forward runs; vLLM calls
  `wait_for_layer_load` before each attention layer, which waits for that layer
  only, so the copy hides behind the compute of the earlier layers (the whole
  copy before the forward was ~3 % of an 8k-token hit's TTFT). The step's end
  (`wait_for_save`, `get_finished`) waits for the rest, reports failed blocks
  and releases the pins. A forward that did not wait (no layer awaited, or
  fewer than in earlier steps) may have read blocks not yet copied: that step's
  loads are reported as errors (vLLM recomputes them) and later steps copy
  whole blocks before the forward.
* Saves (`wait_for_save`, after the target and draft forwards): one `reserve`
  RPC for the step's SaveBatch, copies paged KV -> arena, one `commit` RPC
  (with a key-norm attention estimate per block when available, and the
  blocks' token ids when the scheduler side sent them, for KV events). A failed copy
  aborts the step's reservations; a save that cannot happen is a future miss.
* Copies of a step that move >= 16 MiB are split over the engine thread and
  `COPY_THREADS` - 1 helpers (`_split_copy`).

* Waiting loads (a LoadJob with blocks in flight: a producer engine is still
  computing them): handed to a small thread pool, each thread with its own
  daemon connection (a `wait` holds its connection), so the engine's loop never
  waits. The thread waits for the blocks to commit (bounded by the job's
  `wait_s`) and acquires what committed; the engine thread copies those blocks
  at its next `get_finished` (a copy from the wait thread would pay a GIL
  hand-over per block and layer while the engine loop steps: seconds at 8k
  tokens), then the wait thread releases them. The request is
  reported through `get_finished` and any block that did not arrive (timeout,
  abort, a producer that died) through `get_block_ids_with_load_errors` in the
  same step, so vLLM recomputes it. The request's blocks are vLLM's alone
  meanwhile (WAITING_FOR_REMOTE_KVS), so the copy does not race the forward.

Nothing else is per block per RPC, and nothing else outlives the step: saves are
synchronous, so vLLM may free or reuse the blocks as soon as the step ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from connectors.kv_copy import PagedKV, arena_tensor
from connectors.store_link import StoreLink
from connectors.vllm_meta import ConnectorConfig, LoadJob, SaveBatch, StepMeta, WorkerReport
from kvstore.keys import Namespace
from kvstore.protocol import metadata_frame_bytes

log = logging.getLogger(__name__)

SCORE_LAYERS = 2  # layers sampled for the attention estimate
WAIT_THREADS = 4  # concurrent waiting loads (one daemon connection each)
# A step's block copies are split over this many threads (the engine thread and helpers) when they move
# at least SPLIT_BYTES: the engine's own compute threads are idle while it copies, and one thread moves
# 4-6 GB/s here where the memory moves more. Copies release the GIL (numpy loops), so the threads overlap.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
SPLIT_BYTES = 16 << 20


@dataclass(eq=False)
class _WaitedCopy:
    """A waited load whose blocks committed and are pinned by its wait thread; the engine thread copies them."""

    job: LoadJob
    extents: list
    arena: torch.Tensor
    answered: float  # monotonic time the daemon's wait answered
    acquired: float  # ... and the acquire
    done: threading.Event = field(default_factory=threading.Event)


class _LayerLoads:
    """One step's sync loads, copied one layer at a time on a helper thread while the forward runs.

    `work`: (job index, position in the job, block id, extents) for every block to copy; `order`:
    the layers in the order they are copied (the forward's). `wait(layer)` returns once that layer
    of every block is in place. A block whose copy fails stops its job there (later layers skip it
    and the blocks after it); the error is in `failed`.
    """

    def __init__(self, kv: PagedKV, arena, work: list, order: list[int], jobs: list[LoadJob], held: list[bytes],
                 generation: int) -> None:
        self.kv, self.arena, self.work, self.order = kv, arena, work, order
        self.jobs, self.held, self.generation = jobs, held, generation  # what the step's end reports and unpins
        self.started = time.monotonic()
        self.position = {layer: k for k, layer in enumerate(order)}
        self.copied = 0  # leading layers of `order` done (read without the lock: one int)
        self.cond = threading.Condition()
        self.failed: dict[int, tuple[int, Exception]] = {}  # job index -> (first failed position, why)
        self.awaited: list[int] = []  # layers the forward waited for, in its order
        self.future = None

    def run(self) -> None:
        kv, arena, work, failed = self.kv, self.arena, self.work, self.failed
        try:
            for k, layer in enumerate(self.order):
                for job, pos, block_id, extents in work:
                    stop = failed.get(job)
                    if stop is not None and stop[0] <= pos:
                        continue
                    try:
                        kv.load_layer_from_arena(arena, layer, block_id, extents)
                    except Exception as exc:
                        failed[job] = (pos, exc)
                with self.cond:
                    self.copied = k + 1
                    self.cond.notify_all()
        except BaseException as exc:  # never leave the forward waiting: everything counts as failed
            for job, pos, _, _ in work:
                if pos == 0:
                    failed[job] = (0, exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            raise
        finally:
            with self.cond:
                self.copied = len(self.order)
                self.cond.notify_all()

    def wait(self, layer: int) -> None:
        self.awaited.append(layer)
        k = self.position[layer]
        if self.copied > k:
            return
        with self.cond:
            self.cond.wait_for(lambda: self.copied > k)


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
        self._lock = threading.Lock()  # guards the two below, written by the wait threads
        self._waited_done: dict[str, set[int]] = {}  # req id -> its blocks that failed, for get_finished
        self._wait_pool: ThreadPoolExecutor | None = None
        self._wait_local = threading.local()  # per wait thread: its StoreLink
        self._wait_links: list[StoreLink] = []
        self._to_copy: list[_WaitedCopy] = []  # waited loads whose blocks committed: copied by the engine thread
        self._copy_pool: ThreadPoolExecutor | None = None  # helpers of the engine thread's copies (_split_copy)
        self._layer_of = {name: i for i, name in enumerate(layer_names)}
        self._layer_order = list(range(len(layer_names)))  # the forward's order once a step has shown it
        self._layer_wise = config.layer_loads  # off after a forward that did not wait for its layers
        self._hooked: set[int] = set()  # layers the forward waited for in earlier layer-wise steps
        self._layer_loads: _LayerLoads | None = None  # this step's, until the step's end
        self._layer_pool: ThreadPoolExecutor | None = None
        self._closing = False
        self.wait_stats: dict[str, float] = {"jobs": 0, "blocks_waited": 0, "blocks_failed": 0, "wait_s": 0.0}

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
        self._finish_layer_loads()  # a step whose end this worker did not see (never expected)
        if not meta.loads:
            return
        self._failed_reqs = (meta.step, set())
        waiting = [job for job in meta.loads if job.needs_wait and self.kv is not None]
        now = [job for job in meta.loads if not (job.needs_wait and self.kv is not None)]
        if now and self.kv is None:
            self._fail_all(now)
        elif now:
            rest = now
            sync = [job for job in now if not job.is_async]  # they feed this step's forward
            if sync and self._layer_wise and self.kv.layer_rows() is not None:
                self._start_layer_loads(sync)
                rest = [job for job in now if job.is_async]
            if rest:
                self._load(rest)
        for job in now:
            if job.is_async:
                self._finished_recving.add(job.req_id)
        for job in waiting:
            self._wait_executor().submit(self._wait_and_load, job)
        self._loads_done[meta.step] = 1

    # -- waiting loads (wait threads) -------------------------------------------------------
    def _wait_executor(self) -> ThreadPoolExecutor:
        if self._wait_pool is None:
            self._wait_pool = ThreadPoolExecutor(WAIT_THREADS, thread_name_prefix="kvstore-wait")
        return self._wait_pool

    def _thread_link(self) -> StoreLink:
        link = getattr(self._wait_local, "link", None)
        if link is None:
            link = StoreLink(self.config.socket_path, [self.namespace], self.config.timeout_s, self.config.retry_s,
                             "vllm-worker-wait")
            self._wait_local.link = link
            with self._lock:
                self._wait_links.append(link)
        return link

    def _wait_and_load(self, job: LoadJob) -> None:
        failed: set[int] | None = set(job.block_ids)
        t0 = time.monotonic()
        with self._lock:  # counted before the request can be reported
            self.wait_stats["jobs"] += 1
            self.wait_stats["blocks_waited"] += len(job.hashes) - max(job.num_ready, 0)
        try:
            failed = self._wait_and_copy(job)
        except Exception as exc:  # never let a wait thread die silently: the request must finish
            log.warning("kvstore: waiting load of %s failed (%r); vLLM recomputes", job.req_id, exc)
        with self._lock:
            if failed is not None:  # None: the engine thread copied the blocks and reported the request
                self._report_waited(job.req_id, failed)
            self.wait_stats["wait_s"] += time.monotonic() - t0

    def _report_waited(self, req_id: str, failed: set[int]) -> None:
        """(Under the lock.) The request goes out at the next get_finished, its failed blocks with it."""
        self._waited_done[req_id] = failed
        self.wait_stats["blocks_failed"] += len(failed)

    def _wait_and_copy(self, job: LoadJob) -> set[int] | None:
        """Wait for the job's blocks and acquire those that committed; the engine thread copies them.

        Returns the block ids that did not load when this thread reports the request itself, None
        when the engine thread copied and reported it (`_copy_waited`, from `get_finished`). The copy
        is not done here: one copy call per block and layer from a second thread, while the engine
        loop keeps stepping, pays a GIL hand-over (up to the 5 ms switch interval) per call: seconds
        at 8k tokens.
        """
        assert self.kv is not None
        link = self._thread_link()
        ns = lambda: link.ns_ids[0]  # noqa: E731  (the id of the connection the call runs on)
        res = link.run("wait", lambda c: c.wait_committed(ns(), job.hashes, job.wait_s, appear=job.appear))
        answered = time.monotonic()
        ready = res.ready if res is not None else 0
        if res is not None and res.reason != "done":
            log.info("kvstore: %s: %d/%d blocks arrived (%s); vLLM recomputes the rest",
                     job.req_id, ready, len(job.hashes), res.reason)
        hashes = job.hashes[:ready]
        extents = link.run("acquire", lambda c: c.acquire(ns(), hashes, prefix=True)) if hashes else []
        arena = arena_tensor(link.arena) if link.arena is not None and extents else None
        generation = link.generation
        held = [h for h, e in zip(hashes, extents or []) if e is not None]
        if not held or arena is None:
            if held and link.generation == generation:
                link.run("release", lambda c: c.release(ns(), held))
            return set(job.block_ids)
        item = _WaitedCopy(job, extents, arena, answered, time.monotonic())
        try:
            with self._lock:
                self._to_copy.append(item)
            while not item.done.wait(0.5):  # the engine thread copies at its next get_finished
                if self._closing:
                    with self._lock:
                        if item in self._to_copy:  # not taken: nobody copies it now
                            self._to_copy.remove(item)
                            return set(job.block_ids)
            return None
        finally:
            if link.generation == generation:
                link.run("release", lambda c: c.release(ns(), held))

    def _copy_waited(self) -> None:
        """Engine thread: copy the blocks of waited loads that committed, and report those requests."""
        with self._lock:
            items, self._to_copy = self._to_copy, []
        for item in items:
            start = time.monotonic()
            loaded, exc = self._copy_blocks(item.job, item.extents, item.arena)
            if exc is not None:
                log.warning("kvstore: copy of a waited block of %s failed (%r)", item.job.req_id, exc)
            if log.isEnabledFor(logging.DEBUG):
                trace = {"req": item.job.req_id, "blocks": loaded, "answered": item.answered,
                         "acquired": item.acquired, "copy_start": start, "copy_end": time.monotonic()}
                log.debug("kvstore: waited load %s", trace, extra={"kvstore_trace": trace})
            with self._lock:
                self._report_waited(item.job.req_id, set(item.job.block_ids[loaded:]))
            item.done.set()

    # -- layer-wise loads ----------------------------------------------------------------------
    def _start_layer_loads(self, jobs: list[LoadJob]) -> None:
        """Pin the jobs' blocks and start copying them layer by layer (`_LayerLoads`); the forward's
        `wait_for_layer_load` waits per layer, the step's end in `_finish_layer_loads`."""
        assert self.kv is not None
        hashes = [h for job in jobs for h in job.hashes]
        extents = self.link.run("acquire", lambda c: c.acquire(self.link.ns_ids[0], hashes, prefix=False))
        arena = self.link.arena
        if extents is None or arena is None:
            self._fail_all(jobs)
            return
        work, pos = [], 0
        for index, job in enumerate(jobs):
            mine = extents[pos : pos + len(job.hashes)]
            pos += len(job.hashes)
            present = next((i for i, ext in enumerate(mine) if ext is None), len(mine))
            for i in range(present):
                if sum(length for _, length in mine[i]) != self.kv.block_bytes:
                    self._fail(job, i, f"extents of {sum(n for _, n in mine[i])} B for a {self.kv.block_bytes} B block")
                    break
                work.append((index, i, job.block_ids[i], mine[i]))
            else:
                if present < len(mine):
                    self._fail(job, present, "block no longer stored")
        held = [h for h, e in zip(hashes, extents) if e is not None]
        loads = _LayerLoads(self.kv, arena, work, self._layer_order, jobs, held, self.link.generation)
        if self._layer_pool is None:
            self._layer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-layer-load")
        loads.future = self._layer_pool.submit(loads.run)
        self._layer_loads = loads

    def wait_for_layer_load(self, layer_name: str) -> None:
        loads = self._layer_loads
        layer = self._layer_of.get(layer_name)
        if loads is not None and layer is not None:
            loads.wait(layer)

    def _finish_layer_loads(self) -> None:
        """The step's end: wait for the rest of its layer-wise copies, report what failed, unpin."""
        loads, self._layer_loads = self._layer_loads, None
        if loads is None:
            return
        copy_start = time.monotonic()
        try:
            loads.future.result()
        except Exception as exc:  # run() already marked every job failed
            log.warning("kvstore: layer-wise load failed (%r)", exc)
        ended = time.monotonic()
        awaited = set(loads.awaited)
        if loads.work and (not awaited or not self._hooked <= awaited):
            # the forward may have attended to blocks before they were copied: recompute them
            log.warning("kvstore: the forward waited for %d of %d layers of a layer-wise load; its blocks are "
                        "reported as load errors and later loads are copied before the forward",
                        len(awaited), len(self.layer_names))
            self._layer_wise = False
            for job in loads.jobs:
                self._fail(job, 0, "the forward did not wait for its layers")
        else:
            for index, (first, exc) in loads.failed.items():
                self._fail(loads.jobs[index], first, f"copy failed: {exc!r}")
            self._hooked |= awaited
            seen = list(dict.fromkeys(loads.awaited))
            if seen and seen != self._layer_order[: len(seen)]:  # copy in the forward's order from now on
                self._layer_order = seen + [i for i in self._layer_order if i not in awaited]
        if loads.held and self.link.generation == loads.generation:
            self.link.run("release", lambda c: c.release(self.link.ns_ids[0], loads.held))
        if log.isEnabledFor(logging.DEBUG):
            trace = {"loaded": len(loads.held), "layers": len(loads.order), "awaited": len(awaited),
                     "since_start": copy_start - loads.started, "end_wait": ended - copy_start}
            log.debug("kvstore: layer-wise load %s", trace, extra={"kvstore_trace": trace})

    def _load(self, jobs: list[LoadJob]) -> None:
        hashes = [h for job in jobs for h in job.hashes]
        t0 = time.monotonic()
        extents = self.link.run("acquire", lambda c: c.acquire(self.link.ns_ids[0], hashes, prefix=False))
        arena = self._arena_view()
        if extents is None or arena is None:
            self._fail_all(jobs)
            return
        generation = self.link.generation
        pos = 0
        t1 = time.monotonic()
        try:
            for job in jobs:
                self._load_job(job, extents[pos : pos + len(job.hashes)], arena)
                pos += len(job.hashes)
        finally:
            t2 = time.monotonic()
            held = [h for h, e in zip(hashes, extents) if e is not None]
            if held and self.link.generation == generation:
                self.link.run("release", lambda c: c.release(self.link.ns_ids[0], held))
            if log.isEnabledFor(logging.DEBUG):
                trace = {"loaded": len(held), "acquire": t1 - t0, "copy": t2 - t1, "release": time.monotonic() - t2}
                log.debug("kvstore: step load %s", trace, extra={"kvstore_trace": trace})

    def _load_job(self, job: LoadJob, extents: Sequence, arena: torch.Tensor) -> None:
        loaded, exc = self._copy_blocks(job, extents, arena)
        if exc is not None:
            self._fail(job, loaded, f"copy failed: {exc!r}")
        elif loaded < len(extents):
            self._fail(job, loaded, "block no longer stored")

    def _copy_blocks(self, job: LoadJob, extents: Sequence, arena: torch.Tensor) -> tuple[int, Exception | None]:
        """Copy the job's blocks from the arena, up to the first absent extent or failed copy: (blocks
        copied, the copy's exception or None). Never raises: the engine must not crash on a load."""
        assert self.kv is not None
        kv = self.kv
        pairs = list(zip(job.block_ids, extents))
        present = next((i for i, (_, ext) in enumerate(pairs) if ext is None), len(pairs))
        return self._split_copy(lambda b, ext: kv.load_from_arena(arena, b, ext), pairs[:present])

    def _split_copy(self, copy: Callable, pairs: list) -> tuple[int, Exception | None]:
        """copy(block_id, extents) for each pair, the pairs split in contiguous runs over the copy threads
        when they are large enough: (leading pairs copied before the first failure, its exception)."""

        def run(lo: int, hi: int) -> tuple[int, Exception | None]:
            for i in range(lo, hi):
                try:
                    copy(*pairs[i])
                except Exception as exc:
                    return i, exc
            return hi, None

        n = len(pairs)
        assert self.kv is not None
        parts = min(COPY_THREADS, n)
        if parts < 2 or self.kv.device.type != "cpu" or n * self.kv.block_bytes < SPLIT_BYTES:
            return run(0, n)
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvstore-copy")
        bounds = [n * k // parts for k in range(parts + 1)]
        futures = [self._copy_pool.submit(run, bounds[k], bounds[k + 1]) for k in range(1, parts)]
        results = [run(bounds[0], bounds[1])] + [f.result() for f in futures]
        for (done, exc), hi in zip(results, bounds[1:]):
            if done < hi:  # the first run that stopped short: what came before it is loaded
                return done, exc
        return n, None

    def _fail(self, job: LoadJob, first: int, why: str) -> None:
        log.warning("kvstore: load of %s failed at block %d/%d (%s); vLLM recomputes", job.req_id, first, len(job.block_ids), why)
        self._failed_blocks.update(job.block_ids[first:])
        self._failed_reqs[1].add(job.req_id)

    def _fail_all(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._fail(job, 0, "store unavailable")

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: StepMeta) -> None:
        self._finish_layer_loads()  # before the filter below: a failed layer copy is a failed load
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
        kv = self.kv
        _, exc = self._split_copy(lambda b, ext: kv.save_to_arena(arena, b, ext),
                                  [(saves.block_ids[i], slots[i]) for i in reserved])
        if exc is not None:
            log.warning("kvstore: save copy failed (%r); aborting %d reserved blocks", exc, len(hashes))
            if self.link.generation == generation:
                self.link.run("abort", lambda c: c.abort(ns_id, hashes))
            return
        attention = self._attention([saves.block_ids[i] for i in reserved])
        tokens = [saves.tokens[i] for i in reserved] if any(saves.tokens) else None
        if self.link.generation == generation:
            self.link.run("commit",
                          lambda c: c.commit(ns_id, hashes, attention=attention, tokens=_fitting(c, tokens)))
            if log.isEnabledFor(logging.DEBUG):
                trace = {"committed": len(hashes), "at": time.monotonic()}
                log.debug("kvstore: commit %s", trace, extra={"kvstore_trace": trace})

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
        self._finish_layer_loads()
        if self._to_copy:
            self._copy_waited()
        done, self._finished_recving = self._finished_recving, set()
        with self._lock:  # a waited request and its failed blocks are reported in the same step
            waited, self._waited_done = self._waited_done, {}
        for req_id, failed in waited.items():
            done.add(req_id)
            self._failed_blocks.update(failed)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_worker_meta(self) -> WorkerReport | None:
        if not self._loads_done:
            return None
        report, self._loads_done = WorkerReport(self._loads_done), {}
        return report

    def shutdown(self) -> None:
        self._closing = True
        self._finish_layer_loads()
        if self._layer_pool is not None:
            self._layer_pool.shutdown(wait=False)
        if self._wait_pool is not None:
            self._wait_pool.shutdown(wait=False, cancel_futures=True)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False)
        with self._lock:
            links, self._wait_links = self._wait_links, []
        for link in links:
            link.close()
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
