"""Scheduler side of the vLLM connector (lives in EngineCore): lookups, pins, load and save plans.

Per admitted request it keeps the chain of the project's own block hashes
(`kvstore.keys.hash_blocks`, extended incrementally as tokens arrive) and the
request's block ids. Per step it emits a `StepMeta`:

* loads: on admission, one `acquire(prefix=True)` RPC pins the leading stored
  blocks after the local prefix-cache hit, capped so that at least one prompt
  token is computed; the hit is reported to vLLM and, once blocks are
  allocated, becomes a LoadJob. The pins are released when the worker reports
  the load done (or `PIN_TTL_STEPS` steps later at the latest, connectors/step_pins.py: the worker pins
  what it copies itself, so an early release costs a possible recompute,
  never wrong bytes).
* saves: the full blocks of *verified* tokens completed by this step
  (tokens below min(num_computed + num_scheduled, num_tokens): speculative
  tokens are never in `all_token_ids`), each once, with its parent hash and,
  when the daemon publishes KV events with token ids and the request is keyed
  by its tokens alone (no LoRA, salt or multimodal item), its token ids.

Prefill/decode disaggregation (kv_role kv_producer / kv_consumer, server/pd_proxy.py):

* a producer saves and never loads; a consumer loads and never saves
  (`ConnectorConfig.for_role`, as vLLM's own connectors read is_kv_producer /
  is_kv_consumer);
* a producer *announces* a new request's full prompt blocks (`expect`, one RPC
  per step with new requests) when it first schedules the prefill, before the
  forward pass that computes them, and withdraws what it did not save when the
  request finishes. Chosen over reserving at schedule time: a reservation is
  owned by the connection that copies the bytes (the worker's), and the worker
  only learns of the request at that step; an announcement costs no arena room
  and dies with the scheduler's connection, so a dead producer's blocks stop
  being waited for at its lease;
* a consumer's lookup (`acquire` with `inflight`) learns how many blocks after
  the committed prefix are in flight (reserved or announced); a request the
  proxy marked with kv_transfer_params {"kvstore_wait": true} counts all its
  full prompt blocks as coming (the producer may not have scheduled it yet: the
  wait then also waits for them to *appear*). Such a hit is reported with
  load_kv_async=True; the worker waits in a thread of its own
  (vllm_worker.py) for at most `wait_s` (lowered per request by
  kv_transfer_params {"kvstore_wait_s": s}; 0 = never wait) and reports the
  request through get_finished, with the blocks that did not arrive as load
  errors (recomputed: kv_load_failure_policy "recompute"). The scheduler
  loop never waits.

Invariants: a request's pins are released exactly once (load done, request
finished, or a new lookup); pins of a previous daemon connection are never
released on a new one; the daemon being away only turns hits into misses.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.connectors.engine_kv import reader_tier
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.step_pins import StepPins
from kvstore.connectors.vllm_meta import ConnectorConfig, LoadJob, SaveBatch, StepMeta
from kvstore.keys import ROOT_HASH, ExtraKeys, MultimodalItem, Namespace, hash_blocks, lora_key
from kvstore.wire import RANK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)



def request_extra_keys(request: "Request") -> ExtraKeys | None:
    """What besides the tokens makes this request's KV differ; None if the store cannot key it."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None  # the KV depends on embeddings, not token ids
    adapter = getattr(request, "lora_request", None)
    lora = lora_key(adapter.lora_name, getattr(adapter, "lora_path", "")) if adapter is not None else None
    mm = tuple(
        MultimodalItem(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in (getattr(request, "mm_features", None) or ())
    )
    return ExtraKeys(lora=lora, cache_salt=getattr(request, "cache_salt", None), mm=mm)


@dataclass
class _Pins:
    hashes: list[bytes]
    generation: int
    tiers: list[str] = field(default_factory=list)  # per block, the tier the daemon found it in


@dataclass
class _ReqState:
    request: "Request"
    extra: ExtraKeys
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_saved: int = 0  # blocks [0, num_saved) were offered to the store already, or loaded from it
    pins: _Pins | None = None  # from the latest lookup, not yet handed to a load
    pin_key: tuple[int, int] | None = None  # (first block, block limit) of that lookup
    hit_tiers: Counter = field(default_factory=Counter)  # tier -> blocks of the planned load
    num_wait: int = 0  # blocks after the pinned ones that the lookup found in flight (to be waited for)
    waited: bool = False  # a waiting load was planned once: a request whose wait failed is not made to wait again
    announced: list[bytes] = field(default_factory=list)  # hashes this (producer) engine announced
    async_blocks: set[int] = field(default_factory=set)  # engine blocks of its asynchronous load in progress
    async_failed: bool = False  # an asynchronous load of it failed: its next loads are synchronous
    save_limit: int | None = None  # blocks from this index on are never offered (it shares a failed block)

    def hashes_upto(self, num_blocks: int, block_tokens: int) -> list[bytes]:
        have = len(self.hashes)
        if num_blocks > have:
            tokens = self.request.all_token_ids[have * block_tokens : num_blocks * block_tokens]
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.extend(hash_blocks(tokens, block_tokens, self.extra, parent=parent, start_block=have))
        return self.hashes[:num_blocks]


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, namespaces: list[Namespace], block_tokens: int,
                 device: str = "cpu", num_workers: int | None = None) -> None:
        """`namespaces`: one per TP rank, or one for all where the ranks hold the same KV (MLA);
        `num_workers`: the workers that report each step's loads (default: one per namespace).
        `device`: the platform's device type ("cpu", "cuda"): the scheduler pins blocks for a reader of
        the tier its workers read (`engine_kv.reader_tier`), so a block in the GPU tier is a hit there."""
        self.config = config
        self.device = device
        self.block_tokens = block_tokens
        self.num_ranks = num_workers or len(namespaces)
        self.link = StoreLink.of(config, namespaces, "vllm-scheduler")
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadJob] = []
        self._step = 0
        self.stats = Counter()
        self.pins: StepPins[_Pins] = StepPins(self.num_ranks, self._release)  # planned loads' pins
        self._invalid_seen: set[int] = set()  # failed blocks read since the last metadata (StepMeta.invalid_seen)
        self.link.client()  # connect now: mapping the arena costs ~0.1 s per GiB, not a first request's TTFT

    # -- RPC helpers ------------------------------------------------------------
    def _acquire(self, hashes: list[bytes]) -> tuple[_Pins | None, int]:
        """Pin the leading stored blocks in every rank's namespace; the common prefix stays pinned.
        Also: how many leading blocks every rank has committed or in flight (0 unless waits are on)."""
        if not hashes:
            return None, 0
        waits = self.config.wait_s > 0

        def rpc(client) -> list[tuple[list, list, int]]:
            tier = reader_tier(client.gpu_pools, self.device)
            tier = tier if tier != "host" else None
            if waits:
                return [client.acquire_inflight(ns_id, hashes, tier=tier) for ns_id in self.link.ns_ids]
            return [(*client.acquire_with_tiers(ns_id, hashes, prefix=True, tier=tier), 0)
                    for ns_id in self.link.ns_ids]

        answers = self.link.run("acquire", rpc)
        if answers is None:
            return None, 0
        inflight = min(n for _, _, n in answers)
        answers = [(ext, tiers) for ext, tiers, _ in answers]
        per_rank = [ext for ext, _ in answers]
        hits = min(sum(1 for _ in _leading(ext)) for ext in per_rank)
        generation = self.link.generation
        extra = [(i, hashes[hits : sum(1 for _ in _leading(ext))]) for i, ext in enumerate(per_rank)]
        if any(h for _, h in extra):
            self.link.run("release", lambda c: [c.release(self.link.ns_ids[i], h) for i, h in extra if h])
        # a block's slowest rank (TP) decides which tier its hit came from
        tiers = [max((t[j] or "host" for _, t in answers), key=lambda x: RANK.get(x, len(RANK))) for j in range(hits)]
        return (_Pins(hashes[:hits], generation, tiers) if hits else None), max(inflight, hits)

    def _release(self, pins: _Pins | None) -> None:
        if pins is None or not pins.hashes or pins.generation != self.link.generation:
            return  # nothing pinned, or pinned on a connection that is gone (its pins went with it)
        self.link.run("release", lambda c: [c.release(ns_id, pins.hashes) for ns_id in self.link.ns_ids])

    def _state(self, request: "Request") -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            extra = request_extra_keys(request)
            if extra is None:
                return None
            st = self._reqs[request.request_id] = _ReqState(request, extra)
        return st

    # -- admission ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)  # a save-only (kv_producer) engine needs the state for its saves too
        if st is None or not self.config.load or self.pins.workers_disabled:
            return 0, False
        bt = self.block_tokens
        start = num_computed_tokens // bt
        limit = (request.num_tokens - 1) // bt  # never the whole prompt: vLLM computes >= 1 token
        if limit <= start:
            return 0, False
        key = (start, limit)
        stale = st.pins is not None and st.pins.generation != self.link.generation  # pinned in a daemon now gone
        if st.pin_key != key or stale:  # asked again with other bounds (or the daemon restarted): look up again
            self._release(st.pins)
            st.pins, reachable = self._acquire(st.hashes_upto(limit, bt)[start:limit])
            st.pin_key = key
            hits = len(st.pins.hashes) if st.pins else 0
            may_wait = _wait_s(request, self.config) > 0 and not st.waited
            if may_wait and _proxy_says_wait(request):
                reachable = limit - start  # the producer was sent this prompt: its blocks will come
            st.num_wait = max(reachable - hits, 0) if may_wait else 0
            self.stats["lookups"] += 1
        hits = len(st.pins.hashes) if st.pins else 0
        if st.num_wait:
            self.stats["wait_lookups"] += 1
            return (hits + st.num_wait) * bt, True  # in-flight blocks: an async load, finished by get_finished
        # a request whose asynchronous load failed is admitted again with a synchronous one: vLLM admits it
        # from the queue of requests holding blocks, ahead of those whose loads finished, and an asynchronous
        # admission must leave the in-flight prefills' remaining blocks free (its own counted too); when it
        # does not fit, vLLM stops at it every step and the requests behind it are never promoted
        return hits * bt, self.config.load_async and hits > 0 and not st.async_failed

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        pins, st.pins, start = st.pins, None, (st.pin_key or (0, 0))[0]
        num_wait, st.num_wait = st.num_wait, 0
        st.pin_key = None
        st.hit_tiers = Counter()
        num_load = num_external_tokens // self.block_tokens
        num_pinned = len(pins.hashes) if pins is not None else 0
        if num_load <= 0 or (pins is None and not num_wait):
            self._release(pins)
            return
        block_ids = list(blocks.get_block_ids()[0])
        generation = pins.generation if pins is not None else self.link.generation
        loaded = _Pins(pins.hashes[:num_load] if pins is not None else [], generation)
        st.hit_tiers = Counter(pins.tiers[:num_load] if pins is not None else [])
        if pins is not None:
            self._release(_Pins(pins.hashes[num_load:], pins.generation))
        job = LoadJob(request.request_id, block_ids[start : start + num_load],
                      st.hashes[start : start + num_load], self.config.load_async and not st.async_failed)
        if num_load > num_pinned:  # some are in flight: the worker waits for them off the engine's thread
            st.waited = True  # vLLM reschedules the request if the wait fails: then it takes what is committed
            job.is_async, job.num_ready, job.wait_s = True, num_pinned, _wait_s(request, self.config)
            job.appear = _proxy_says_wait(request)
            st.hit_tiers["host"] += num_load - num_pinned
            self.stats["wait_blocks"] += num_load - num_pinned
        if job.is_async:
            st.async_blocks = set(job.block_ids)
        self._pending_loads.append(job)
        self.pins.pending.append(loaded)
        self.stats["load_blocks"] += num_load
        if st.num_saved >= start:  # the store holds what it loads: not offered back (a failed load is, below)
            st.num_saved = max(st.num_saved, start + num_load)

    def hit_tiers(self, request: "Request", num_external_tokens: int) -> dict[str, int]:
        """Tokens of the planned load per tier they were found in (sums to num_external_tokens)."""
        st = self._reqs.get(request.request_id)
        blocks = st.hit_tiers if st is not None else Counter()
        if sum(blocks.values()) * self.block_tokens != num_external_tokens:
            return {}  # not the load we planned: the caller reports it as unspecified
        return {tier: n * self.block_tokens for tier, n in blocks.items() if n}

    # -- per step -----------------------------------------------------------------
    def build_connector_meta(self, so: "SchedulerOutput") -> StepMeta:
        meta = StepMeta(step=self._step, loads=self._pending_loads, invalid_seen=self._invalid_seen)
        self._invalid_seen = set()
        self.pins.close_step(self._step)
        self._pending_loads = []
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.block_ids = []  # freed by vLLM (and soon another request's); a resumption brings new ones
        announce: list[bytes] = []
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None and self.config.announce and self.config.save and not st.announced:
                st.announced = st.hashes_upto(st.request.num_prompt_tokens // self.block_tokens, self.block_tokens)
                announce.extend(st.announced)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._collect_saves(st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), meta.saves,
                                    admitted=True)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            self._collect_saves(st, end, meta.saves, admitted=resumed)
        if announce:  # before the forward pass that computes them: consumers may wait for these
            self.link.run("expect", lambda c: [c.expect(ns_id, announce) for ns_id in self.link.ns_ids])
            self.stats["announced_blocks"] += len(announce)
        self._step += 1
        return meta

    def _collect_saves(self, st: _ReqState, end: int, saves: SaveBatch, admitted: bool = False) -> None:
        """Offer the request's newly completed full blocks. A request `admitted` (or resumed) this step
        also sends its block ids: the worker saves none of its blocks if one of them failed to load this
        step (vLLM's prefix cache hands a synchronous load's blocks to requests admitted after it)."""
        if not self.config.save:
            return
        verified = min(end, st.request.num_tokens)  # never a speculative token
        num_full = min(verified // self.block_tokens, len(st.block_ids))
        if st.save_limit is not None:
            num_full = min(num_full, st.save_limit)
        if num_full <= st.num_saved:
            return
        if admitted:
            saves.admitted[st.request.request_id] = list(st.block_ids)
        hashes = st.hashes_upto(num_full, self.block_tokens)
        bt = self.block_tokens
        # Token ids only for the daemon's KV events, and only for requests keyed by their tokens alone:
        # a router that hashes token ids must not match a LoRA's or a salted request's blocks.
        tokens = st.request.all_token_ids if self.link.wants_tokens and st.extra.is_empty() else None
        for i in range(st.num_saved, num_full):
            ids = np.asarray(tokens[i * bt : (i + 1) * bt], "<u4").tobytes() if tokens is not None else None
            saves.add(st.request.request_id, st.block_ids[i], hashes[i], hashes[i - 1] if i else None, ids)
        self.stats["save_blocks_offered"] += num_full - st.num_saved
        st.num_saved = num_full

    def update_connector_output(self, output: "KVConnectorOutput") -> set[int]:
        """The workers' reports of a step. Returns the engine blocks a failed load left wrong: the failed
        ones and, in each request that holds one, every block after it (computed on it). The connector
        evicts them from vLLM's prefix cache: with the "recompute" policy vLLM keeps them cached for the
        request that recomputes them, and a request admitted before it has (it may be aborted or
        preempted first) would attend to garbage."""
        invalid = getattr(output, "invalid_block_ids", None)
        stale = self._offer_again(invalid) if invalid else set()
        if invalid:
            self._invalid_seen |= invalid  # the workers hear it with the next step's metadata
        for req_id in getattr(output, "finished_recving", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:  # its asynchronous load ended: failed if one of its blocks is invalid
                st.async_failed |= bool(invalid and st.async_blocks.intersection(invalid))
                st.async_blocks = set()
        self.pins.report(getattr(output, "kv_connector_worker_meta", None))
        return stale

    def _offer_again(self, invalid_block_ids: set[int]) -> set[int]:
        """Blocks that failed to load get recomputed by vLLM: offer them (and what follows) for saving
        again. Returns them and what follows them in every request that holds one.

        A failed block that several requests hold (vLLM's prefix cache shared it) is recomputed by one of
        them only; the others keep it as computed and attend to it. If that one is aborted or preempted
        first, they attend to garbage (vLLM's own failure mode). So a request holding a failed block that
        another request holds too offers nothing from that block on, ever; a sole holder offers again."""
        holders: Counter = Counter()
        first: list[tuple[_ReqState, int]] = []
        for st in self._reqs.values():
            bad = [i for i, block_id in enumerate(st.block_ids) if block_id in invalid_block_ids]
            if bad:
                first.append((st, bad[0]))
                holders.update({st.block_ids[i] for i in bad})
        stale = set(invalid_block_ids)
        for st, i in first:
            stale.update(st.block_ids[i:])
            if all(holders[b] == 1 for b in st.block_ids[i:] if b in invalid_block_ids):
                st.num_saved = min(st.num_saved, i)
            else:
                st.save_limit = i if st.save_limit is None else min(st.save_limit, i)
        return stale

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st.pins)
            if st.announced:  # what was not saved will not come: waiters stop waiting for it
                self.link.run("withdraw", lambda c: [c.withdraw(ns_id, st.announced) for ns_id in self.link.ns_ids])
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def shutdown(self) -> None:
        self.link.close()


def _proxy_says_wait(request: "Request") -> bool:
    """The disaggregation proxy (server/pd_proxy.py) sent this prompt to a prefill engine too and marks
    the decode request with kv_transfer_params {"kvstore_wait": true}: its blocks will appear."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("kvstore_wait"))


def _wait_s(request: "Request", config: ConnectorConfig) -> float:
    """How long this request's load may wait for blocks in flight: the config's wait_s, lowered per
    request by kv_transfer_params {"kvstore_wait_s": seconds} (0 = take only what is committed)."""
    params = getattr(request, "kv_transfer_params", None)
    asked = params.get("kvstore_wait_s") if isinstance(params, dict) else None
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked >= 0:
        return min(float(asked), config.wait_s)
    return config.wait_s


def _leading(extents: list):
    for e in extents:
        if e is None:
            return
        yield e
