"""The worker side's loads: a step's loads (whole-step or layer by layer) and waited loads.

Both handlers pin blocks with one `acquire` RPC, build one copy plan for them
(engine_kv.py) and hand it to the engine's transfers; the pins are released
once the copy is done. What did not load is reported to the step's `LoadReport`
and vLLM recomputes it (kv_load_failure_policy="recompute").

`StepLoads` — loads that feed this step's forward (and async ones reported at
once): with `layer_loads` on and a layer-wise geometry, the plan is split by
layer and copied in the order the forward reaches the layers, beside it; vLLM
calls `wait_for_layer_load` before each attention layer, which waits for that
layer only. A forward that did not wait (no layer awaited, or fewer than in
earlier steps) may have read blocks not yet copied: that step's loads are
reported as errors and later steps copy whole steps before the forward.

`WaitedLoads` — a LoadJob with blocks in flight (a producer engine is still
computing them): a small thread pool, each thread with its own daemon
connection (a `wait` holds its connection), waits for the blocks to commit
(bounded by the job's `wait_s`) and acquires what committed; the engine thread
submits the copy at its next `get_finished` (a copy from the wait thread would
pay a GIL hand-over per piece while the engine loop steps), then the wait
thread waits for it and releases the pins. The request's blocks are vLLM's
alone meanwhile (WAITING_FOR_REMOTE_KVS), so the copy races no forward.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from kvstore.connectors.cpu_copy import Ticket
from kvstore.connectors.engine_kv import EngineKV, FaultInjector
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm_meta import ConnectorConfig, LoadJob

log = logging.getLogger(__name__)

WAIT_THREADS = 4  # concurrent waiting loads (one daemon connection each)
UNACKED_STEPS = 64  # a failed load the scheduler never acknowledges stops holding saves back after this many steps


class _Unacked(NamedTuple):
    """A step's failed loads: the requests and their blocks that failed."""

    reqs: set[str]
    blocks: set[int]
    step: int


class LoadReport:
    """What the worker reports about loads: failed blocks, requests whose load failed this step, and
    requests whose asynchronous or waited load finished. Written by the engine thread, and by the
    wait threads under `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed_blocks: set[int] = set()  # to report at the step's end (get_block_ids_with_load_errors)
        # Failed loads the scheduler side has not acknowledged yet, one per step: (requests, their failed
        # blocks). Until it has, vLLM may plan further steps on those blocks (with asynchronous scheduling
        # the next step is planned before this one's output is read), so saves must leave them out.
        self.unacked: list[_Unacked] = []
        self._step = -1
        self.finished: set[str] = set()
        self.waited: dict[str, set[int]] = {}  # req id -> its blocks that did not load (wait threads)
        self.stats: dict[str, float] = {"jobs": 0, "blocks_waited": 0, "blocks_failed": 0, "wait_s": 0.0,
                                        "injected_failures": 0, "loaded_blocks": 0}  # loaded: copied, not failed

    def begin_step(self, step: int) -> None:
        self._step = step

    def fail(self, job: LoadJob, first: int, why: str) -> None:
        log.warning("kvstore: load of %s failed at block %d/%d (%s); vLLM recomputes", job.req_id, first,
                    len(job.block_ids), why)
        self.failed_blocks.update(job.block_ids[first:])
        if not self.unacked or self.unacked[-1].step != self._step:
            self.unacked.append(_Unacked(set(), set(), self._step))
        self.unacked[-1].reqs.add(job.req_id)
        self.unacked[-1].blocks.update(job.block_ids[first:])

    def acknowledged(self, invalid_seen: set[int], step: int) -> None:
        """The scheduler side has read the failed blocks `invalid_seen` (vLLM recomputes them from now on):
        failures all of whose blocks it has read are over. One it never reads (no step should lose it)
        is over after UNACKED_STEPS steps."""
        self.unacked = [u for u in self.unacked if not u.blocks <= invalid_seen and step - u.step < UNACKED_STEPS]

    def tainted(self) -> tuple[set[str], set[int]]:
        """The requests and blocks of the failed loads not acknowledged yet."""
        reqs: set[str] = set()
        blocks: set[int] = set()
        for u in self.unacked:
            reqs |= u.reqs
            blocks |= u.blocks
        return reqs, blocks

    def fail_all(self, jobs: Sequence[LoadJob], why: str = "store unavailable") -> None:
        for job in jobs:
            self.fail(job, 0, why)

    def fail_pinned(self, jobs: Sequence[LoadJob], pinned: "_Pinned", why: str) -> None:
        """A transfer of pinned blocks failed: every job that had blocks in it failed from its first."""
        for index, present in pinned.work:
            if present:
                self.fail(jobs[index], 0, why)

    def waited_done(self, req_id: str, failed: set[int]) -> None:
        """(Under the lock.) A waited request goes out at the next get_finished, its failed blocks with it."""
        self.waited[req_id] = failed
        self.stats["blocks_failed"] += len(failed)

    def take_finished(self) -> set[str]:
        done, self.finished = self.finished, set()
        with self.lock:
            waited, self.waited = self.waited, {}
        for req_id, failed in waited.items():
            done.add(req_id)
            self.failed_blocks.update(failed)
        return done

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed


@dataclass
class _Pinned:
    """Blocks one acquire pinned for a transfer: what to copy, what to release and on which connection."""

    link: StoreLink
    generation: int
    held: list  # hashes to release
    work: list  # (job index, blocks present and valid) per job

    def release(self) -> None:
        """Unpin (the reply is read at the next call on the connection: nothing waits for it now)."""
        if self.held and self.link.generation == self.generation:
            self.link.post("release", "release", ns=self.link.ns_ids[0], hashes=list(self.held))


def pin_jobs(link: StoreLink, engine: EngineKV, jobs: Sequence[LoadJob], report: LoadReport,
             faults: FaultInjector, prefix: bool = False):
    """One acquire for the jobs' blocks: (the pins, the plan's block ids, their extents as absolute
    addresses), or None when the store is away (every job failed). A job loads its leading present
    blocks; the rest of it is reported as failed. An engine that mapped the GPU pools reads each block
    where it sits (GPU pool or arena); any other reads the arena."""
    hashes = [h for job in jobs for h in job.hashes]
    mem = engine.memory(link)
    if mem is None:
        report.fail_all(jobs)
        return None
    ns = link.ns_ids[0] if link.ns_ids else ""
    if not hashes:
        answer: tuple | None = ([], [])
    elif mem.tier == "host":
        answer = link.run("acquire", lambda c: (lambda e: (e, ["host" if x is not None else None for x in e]))(
            c.acquire(ns, hashes, prefix=prefix)))
    else:
        answer = link.run("acquire", lambda c: c.acquire_at(ns, hashes, mem.tier, prefix=prefix))
    if answer is None:
        report.fail_all(jobs)
        return None
    extents, at = answer
    ids, exts, work, pos = [], [], [], 0
    for index, job in enumerate(jobs):
        mine = extents[pos : pos + len(job.hashes)]
        tiers = at[pos : pos + len(job.hashes)]
        pos += len(job.hashes)
        present = next((i for i, ext in enumerate(mine) if ext is None), len(mine))
        wrong = next((i for i in range(present) if sum(n for _, n in mine[i]) != engine.block_bytes), None)
        if wrong is not None:
            report.fail(job, wrong, f"extents of {sum(n for _, n in mine[wrong])} B for a {engine.block_bytes} B block")
            present = wrong
        elif present < len(mine):
            report.fail(job, present, "block no longer stored")
        injected = faults.first_failed(present)
        if injected is not None:
            report.stats["injected_failures"] += 1
            report.fail(job, injected, "injected load failure (fail_loads)")
            present = injected
        ids += job.block_ids[:present]
        exts += [mem.absolute(mine[i], tiers[i]) for i in range(present)]
        work.append((index, present))
    held = [h for h, e in zip(hashes, extents) if e is not None]
    return _Pinned(link, link.generation, held, work), ids, exts


@dataclass
class _Step:
    pinned: _Pinned
    jobs: list
    ticket: object
    layer_wise: bool
    started: float = field(default_factory=time.monotonic)
    awaited: list = field(default_factory=list)  # layers the forward waited for, in its order


class StepLoads:
    def __init__(self, config: ConnectorConfig, link: StoreLink, report: LoadReport, faults: FaultInjector,
                 layer_names: list[str]) -> None:
        self.config, self.link, self.report, self.faults = config, link, report, faults
        self.layer_names = layer_names
        self._layer_of = {name: i for i, name in enumerate(layer_names)}
        self.layer_order = list(range(len(layer_names)))  # the forward's order once a step has shown it
        self.layer_wise = config.layer_loads  # off after a forward that did not wait for its layers
        self._hooked: set[int] = set()  # layers the forward waited for in earlier layer-wise steps
        self._steps: list[_Step] = []  # this step's
        self._releasing: list[_Step] = []  # ended steps whose copies may still run (GPU): pins held

    def start(self, engine: EngineKV, jobs: list[LoadJob]) -> None:
        sync = [job for job in jobs if not job.is_async]  # they feed this step's forward
        if sync and self.layer_wise and engine.layer_wise:
            self._submit(engine, sync, layer_wise=True)
            jobs = [job for job in jobs if job.is_async]
        if jobs:
            self._submit(engine, jobs, layer_wise=False)
        for job in jobs:
            if job.is_async:
                self.report.finished.add(job.req_id)

    def _submit(self, engine: EngineKV, jobs: list[LoadJob], layer_wise: bool) -> None:
        pinned = pin_jobs(self.link, engine, jobs, self.report, self.faults)
        if pinned is None:
            return
        pins, ids, extents = pinned
        try:
            plan = engine.plan(ids, extents, 0, to_kv=True, merge_layers=not layer_wise)
        except Exception as exc:  # a plan that cannot be built fails these loads, not the engine's step
            self.report.fail_pinned(jobs, pins, f"no copy plan: {exc!r}")
            pins.release()
            return
        if layer_wise:
            ticket = engine.transfers.load_layers(plan.by_layer(self.layer_order), self.layer_order)
        else:
            ticket = engine.transfers.load(plan)
        self._steps.append(_Step(pins, jobs, ticket, layer_wise))

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for step in self._steps:
            if step.layer_wise:
                step.awaited.append(layer)
                step.ticket.wait_layer(layer)

    def finish(self) -> None:
        """The step's end: check that the forward waited for its layers, report what failed, and release the
        pins of copies that are done (a GPU copy still running keeps its pins until a later call)."""
        steps, self._steps = self._steps, []
        for step in steps:
            waited = self._check_forward(step)
            error = step.ticket.outcome()
            if error is not None:
                log.warning("kvstore: a step's load copy failed (%r)", error)
                self.report.fail_pinned(step.jobs, step.pinned, f"copy failed: {error!r}")
            elif waited:  # the blocks before an injected failure loaded too
                self.report.stats["loaded_blocks"] += sum(present for _, present in step.pinned.work)
            self._releasing.append(step)
        self.release_done()

    def release_done(self, block: bool = False) -> None:
        """Unpin the blocks of finished copies (host copies are finished when the step ends)."""
        keep = []
        for step in self._releasing:
            if block or step.ticket.done():
                step.ticket.finish()
                step.pinned.release()
                if log.isEnabledFor(logging.DEBUG):
                    trace = {"loaded": len(step.pinned.held), "layer_wise": step.layer_wise,
                             "since_start": time.monotonic() - step.started}
                    log.debug("kvstore: step load %s", trace, extra={"kvstore_trace": trace})
            else:
                keep.append(step)
        self._releasing = keep

    def _check_forward(self, step: _Step) -> bool:
        """Once per step: did the forward wait for the layers of a layer-wise load? (False: its blocks were
        reported as load errors.)"""
        awaited, step_awaited = set(step.awaited), step.awaited
        if not step.layer_wise or not any(present for _, present in step.pinned.work):
            return True
        if not awaited or not self._hooked <= awaited:
            # the forward may have attended to blocks before they were copied: recompute them
            log.warning("kvstore: the forward waited for %d of %d layers of a layer-wise load; its blocks are "
                        "reported as load errors and later loads are copied before the forward",
                        len(awaited), len(self.layer_names))
            self.layer_wise = False
            self.report.fail_pinned(step.jobs, step.pinned, "the forward did not wait for its layers")
            return False
        self._hooked |= awaited
        seen = list(dict.fromkeys(step_awaited))
        if seen and seen != self.layer_order[: len(seen)]:  # copy in the forward's order from now on
            self.layer_order = seen + [i for i in self.layer_order if i not in awaited]
        return True


@dataclass(eq=False)
class _WaitedCopy:
    """A waited load whose blocks committed and are pinned by its wait thread; the engine thread copies them."""

    job: LoadJob
    pins: _Pinned
    ids: list
    extents: list  # absolute addresses
    answered: float  # monotonic time the daemon's wait answered
    acquired: float  # ... and the acquire
    ticket: object = None
    submitted: threading.Event = field(default_factory=threading.Event)


class WaitedLoads:
    def __init__(self, config: ConnectorConfig, namespace, report: LoadReport, faults: FaultInjector) -> None:
        self.config, self.namespace, self.report, self.faults = config, namespace, report, faults
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # per wait thread: its StoreLink
        self._links: list[StoreLink] = []
        self._ready: list[_WaitedCopy] = []  # committed and pinned, waiting for the engine thread (under lock)
        self._closing = False

    def start(self, engine: EngineKV, jobs: list[LoadJob]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WAIT_THREADS, thread_name_prefix="kvstore-wait")
        for job in jobs:
            self._pool.submit(self._wait_and_load, engine, job)

    def _thread_link(self) -> StoreLink:
        link = getattr(self._local, "link", None)
        if link is None:
            link = StoreLink.of(self.config, [self.namespace], "vllm-worker-wait")
            self._local.link = link
            with self.report.lock:
                self._links.append(link)
        return link

    def _wait_and_load(self, engine: EngineKV, job: LoadJob) -> None:
        failed: set[int] | None = set(job.block_ids)
        t0 = time.monotonic()
        report = self.report
        with report.lock:  # counted before the request can be reported
            report.stats["jobs"] += 1
            report.stats["blocks_waited"] += len(job.hashes) - max(job.num_ready, 0)
        try:
            failed = self._wait_and_copy(engine, job)
        except Exception as exc:  # never let a wait thread die silently: the request must finish
            log.warning("kvstore: waiting load of %s failed (%r); vLLM recomputes", job.req_id, exc)
        with report.lock:
            if failed is not None:
                report.waited_done(job.req_id, failed)
            report.stats["wait_s"] += time.monotonic() - t0

    def _wait_and_copy(self, engine: EngineKV, job: LoadJob) -> set[int] | None:
        """Wait for the job's blocks, acquire those that committed, have the engine thread copy them.
        Returns the blocks that did not load, or None when the copy's outcome was reported with it."""
        link = self._thread_link()
        ns = lambda: link.ns_ids[0]  # noqa: E731  (the id of the connection the call runs on)
        res = link.run("wait", lambda c: c.wait_committed(ns(), job.hashes, job.wait_s, appear=job.appear))
        answered = time.monotonic()
        ready = res.ready if res is not None else 0
        if res is not None and res.reason != "done":
            log.info("kvstore: %s: %d/%d blocks arrived (%s); vLLM recomputes the rest",
                     job.req_id, ready, len(job.hashes), res.reason)
        part = LoadJob(job.req_id, job.block_ids[:ready], job.hashes[:ready], job.is_async)
        local = LoadReport()  # failures seen while pinning, merged below
        pinned = pin_jobs(link, engine, [part], local, self.faults, prefix=True) if ready else None
        if pinned is None:
            return set(job.block_ids)
        pins, ids, extents = pinned
        if not ids:
            pins.release()
            return set(job.block_ids)
        item = _WaitedCopy(job, pins, ids, extents, answered, time.monotonic())
        with self.report.lock:
            self._ready.append(item)
        try:
            while not item.submitted.wait(0.5):  # the engine thread submits the copy at its next get_finished
                if self._closing:
                    with self.report.lock:
                        if item in self._ready:  # not taken: nobody copies it now
                            self._ready.remove(item)
                            return set(job.block_ids)
            try:  # the engine thread reported the request already: whatever happens now, never again
                item.ticket.finish()  # unpin once the bytes moved
            except Exception as exc:
                log.warning("kvstore: waiting for the copy of %s failed (%r)", job.req_id, exc)
            return None
        finally:
            pins.release()

    def submit_ready(self, engine: EngineKV) -> None:
        """Engine thread: submit the copies of waited loads whose blocks committed."""
        with self.report.lock:
            items, self._ready = self._ready, []
        for item in items:
            try:
                item.ticket = engine.transfers.load(engine.plan(item.ids, item.extents, 0, to_kv=True))
            except Exception as exc:  # a plan that cannot be built fails this load, not the engine's step
                item.ticket = Ticket(exc)
            failed = set(item.job.block_ids[len(item.ids):])
            if item.ticket.error is not None:
                log.warning("kvstore: copy of a waited load of %s failed (%r)", item.job.req_id, item.ticket.error)
                failed = set(item.job.block_ids)
            with self.report.lock:  # reported in this step: the forward that reads the blocks comes after the copy
                self.report.waited_done(item.job.req_id, failed)
                self.report.stats["loaded_blocks"] += len(item.job.block_ids) - len(failed)
            if log.isEnabledFor(logging.DEBUG):
                trace = {"req": item.job.req_id, "blocks": len(item.ids), "answered": item.answered,
                         "acquired": item.acquired, "submitted": time.monotonic()}
                log.debug("kvstore: waited load %s", trace, extra={"kvstore_trace": trace})
            item.submitted.set()

    def close(self) -> None:
        self._closing = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self.report.lock:
            links, self._links = self._links, []
        for link in links:
            link.close()


def run_guarded(what: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # the engine must never fail because the store did
        log.warning("kvstore: %s failed (%r)", what, exc)
