"""Scheduler side of the vLLM connector (lives in EngineCore): lookups, pins, load and save plans.

Per admitted request it keeps the chain of the project's own block hashes
(`kvstore.keys.hash_blocks`, extended incrementally as tokens arrive) and the
request's block ids. Per step it emits a `StepMeta`:

* loads: on admission, one `acquire(prefix=True)` RPC pins the leading stored
  blocks after the local prefix-cache hit, capped so that at least one prompt
  token is computed; the hit is reported to vLLM and, once blocks are
  allocated, becomes a LoadJob. The pins are released when the worker reports
  the load done (or after `PIN_TTL_STEPS` steps at the latest: the worker pins
  what it copies itself, so an early release costs a possible recompute,
  never wrong bytes).
* saves: the full blocks of *verified* tokens completed by this step
  (tokens below min(num_computed + num_scheduled, num_tokens): speculative
  tokens are never in `all_token_ids`), each once, with its parent hash and,
  when the daemon publishes KV events with token ids and the request is keyed
  by its tokens alone (no LoRA, salt or multimodal item), its token ids.

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

from connectors.store_link import StoreLink
from connectors.vllm_meta import ConnectorConfig, LoadJob, SaveBatch, StepMeta, WorkerReport
from kvstore.keys import ROOT_HASH, ExtraKeys, MultimodalItem, Namespace, hash_blocks, lora_key
from kvstore.store import RANK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PIN_TTL_STEPS = 16


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
    num_saved: int = 0  # blocks [0, num_saved) were offered to the store already
    pins: _Pins | None = None  # from the latest lookup, not yet handed to a load
    pin_key: tuple[int, int] | None = None  # (first block, block limit) of that lookup
    hit_tiers: Counter = field(default_factory=Counter)  # tier -> blocks of the planned load

    def hashes_upto(self, num_blocks: int, block_tokens: int) -> list[bytes]:
        have = len(self.hashes)
        if num_blocks > have:
            tokens = self.request.all_token_ids[have * block_tokens : num_blocks * block_tokens]
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.extend(hash_blocks(tokens, block_tokens, self.extra, parent=parent, start_block=have))
        return self.hashes[:num_blocks]


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, namespaces: list[Namespace], block_tokens: int) -> None:
        self.config = config
        self.block_tokens = block_tokens
        self.num_ranks = len(namespaces)
        self.link = StoreLink(config.socket_path, namespaces, config.timeout_s, config.retry_s, "vllm-scheduler")
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadJob] = []
        self._pending_pins: list[_Pins] = []
        self._pins_by_step: dict[int, list[_Pins]] = {}
        self._done_counts: Counter = Counter()
        self._step = 0
        self.stats = Counter()
        self.link.client()  # connect now: mapping the arena costs ~0.1 s per GiB, not a first request's TTFT

    # -- RPC helpers ------------------------------------------------------------
    def _acquire(self, hashes: list[bytes]) -> _Pins | None:
        """Pin the leading stored blocks in every rank's namespace; the common prefix stays pinned."""
        if not hashes:
            return None

        def rpc(client) -> list[tuple[list, list]]:
            return [client.acquire_with_tiers(ns_id, hashes, prefix=True) for ns_id in self.link.ns_ids]

        answers = self.link.run("acquire", rpc)
        if answers is None:
            return None
        per_rank = [ext for ext, _ in answers]
        hits = min(sum(1 for _ in _leading(ext)) for ext in per_rank)
        generation = self.link.generation
        extra = [(i, hashes[hits : sum(1 for _ in _leading(ext))]) for i, ext in enumerate(per_rank)]
        if any(h for _, h in extra):
            self.link.run("release", lambda c: [c.release(self.link.ns_ids[i], h) for i, h in extra if h])
        # a block's slowest rank (TP) decides which tier its hit came from
        tiers = [max((t[j] or "host" for _, t in answers), key=lambda x: RANK.get(x, len(RANK))) for j in range(hits)]
        return _Pins(hashes[:hits], generation, tiers) if hits else None

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
        if not self.config.load:
            return 0, False
        st = self._state(request)
        if st is None:
            return 0, False
        bt = self.block_tokens
        start = num_computed_tokens // bt
        limit = (request.num_tokens - 1) // bt  # never the whole prompt: vLLM computes >= 1 token
        if limit <= start:
            return 0, False
        key = (start, limit)
        if st.pin_key != key:  # asked again with other bounds: redo the lookup
            self._release(st.pins)
            st.pins = self._acquire(st.hashes_upto(limit, bt)[start:limit])
            st.pin_key = key
            self.stats["lookups"] += 1
        hits = len(st.pins.hashes) if st.pins else 0
        return hits * bt, self.config.load_async and hits > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        pins, st.pins, start = st.pins, None, (st.pin_key or (0, 0))[0]
        st.pin_key = None
        st.hit_tiers = Counter()
        num_load = num_external_tokens // self.block_tokens
        if num_load <= 0 or pins is None:
            self._release(pins)
            return
        block_ids = list(blocks.get_block_ids()[0])
        loaded = _Pins(pins.hashes[:num_load], pins.generation)
        st.hit_tiers = Counter(pins.tiers[:num_load])
        self._release(_Pins(pins.hashes[num_load:], pins.generation))
        self._pending_loads.append(
            LoadJob(request.request_id, block_ids[start : start + num_load], loaded.hashes, self.config.load_async)
        )
        self._pending_pins.append(loaded)
        self.stats["load_blocks"] += num_load

    def hit_tiers(self, request: "Request", num_external_tokens: int) -> dict[str, int]:
        """Tokens of the planned load per tier they were found in (sums to num_external_tokens)."""
        st = self._reqs.get(request.request_id)
        blocks = st.hit_tiers if st is not None else Counter()
        if sum(blocks.values()) * self.block_tokens != num_external_tokens:
            return {}  # not the load we planned: the caller reports it as unspecified
        return {tier: n * self.block_tokens for tier, n in blocks.items() if n}

    # -- per step -----------------------------------------------------------------
    def build_connector_meta(self, so: "SchedulerOutput") -> StepMeta:
        meta = StepMeta(step=self._step, loads=self._pending_loads)
        if self._pending_pins:
            self._pins_by_step[self._step] = self._pending_pins
        self._pending_loads, self._pending_pins = [], []
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._collect_saves(st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), meta.saves)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            self._collect_saves(st, end, meta.saves)
        self._expire_pins()
        self._step += 1
        return meta

    def _collect_saves(self, st: _ReqState, end: int, saves: SaveBatch) -> None:
        if not self.config.save:
            return
        verified = min(end, st.request.num_tokens)  # never a speculative token
        num_full = min(verified // self.block_tokens, len(st.block_ids))
        if num_full <= st.num_saved:
            return
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

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            self._offer_again(invalid)
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport):
            return
        for step, n in report.loads_done.items():
            self._done_counts[step] += n
            if self._done_counts[step] >= self.num_ranks:
                del self._done_counts[step]
                for pins in self._pins_by_step.pop(step, []):
                    self._release(pins)

    def _offer_again(self, invalid_block_ids: set[int]) -> None:
        """Blocks that failed to load get recomputed by vLLM: offer them (and what follows) for saving again."""
        for st in self._reqs.values():
            for i, block_id in enumerate(st.block_ids[: st.num_saved]):
                if block_id in invalid_block_ids:
                    st.num_saved = i
                    break

    def _expire_pins(self) -> None:
        for step in [s for s in self._pins_by_step if s < self._step - PIN_TTL_STEPS]:
            self._done_counts.pop(step, None)
            for pins in self._pins_by_step.pop(step):
                self._release(pins)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st.pins)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def shutdown(self) -> None:
        self.link.close()


def _leading(extents: list):
    for e in extents:
        if e is None:
            return
        yield e
