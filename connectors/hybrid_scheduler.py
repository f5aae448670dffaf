"""Scheduler side of the vLLM connector for hybrid models (several KV cache groups; lives in EngineCore).

The layout (connectors/hybrid.py) says what each group needs at a hit boundary; this side plans, per
request, one hit length N for every group, the loads that restore exactly that, and the saves that keep
the spine and the attachments at kept boundaries in time.

* Lookup (`get_num_new_matched_tokens`): the spine's leading blocks after vLLM's local hit s are pinned
  (one `acquire` per TP rank), which bounds N; with attachments, the deepest boundary in (s, N] whose
  attachment is stored is pinned too and becomes N: the spine's end first (where a repeated or extended
  prompt's hit ends), else the deepest that `describe` (which pins and moves nothing) finds. A
  window spine keeps pins on the blocks its window needs only. The hit is reported as an asynchronous load:
  with several groups vLLM takes load failures per request only (`failed_recving`, which applies to
  asynchronous loads), and a recurrent state's layers never wait for a layer-wise copy.
* Load (`update_state_after_alloc`): vLLM's block ids for every group at the planned positions — the spine's
  from s to N, each window group's from the first its window needs (and not below s), each state group's
  at N/B - 1 — become a `HybridLoad`. Where vLLM gave a null block for a position the plan needs, the job
  is sent as broken and reported failed: vLLM recomputes the request, nothing is loaded halfway.
* Saves (`build_connector_meta`): each step, the spine blocks of verified tokens completed by it, and
  the attachments at the kept boundaries it crossed (vLLM's offered states, or the layout's rule without
  state groups), while their pages are still the request's: a window page is freed by vLLM at the next
  step's allocation at the earliest, and a state offer holds for its own step only. Nothing is saved from
  vLLM's null block.

Invariants: pins are released exactly once (the workers report the load, the request finishes, or a new
lookup replaces them); a planned N is never larger than what every group can restore.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.connectors.hybrid import ATTACHMENT, SPINE, HybridLayout, attachment_ids, spine_ids
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.step_pins import StepPins
from kvstore.connectors.vllm_meta import ConnectorConfig, HybridLoad, HybridSave, HybridStepMeta
from kvstore.connectors.vllm_scheduler import _ReqState, request_extra_keys
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _Pins:
    """What one lookup pinned, in every rank's namespaces: spine blocks [first, end), the attachment at end."""

    first: int
    end: int
    spine: list[bytes]
    attachment: bytes | None
    generation: int


@dataclass
class _Req:
    st: _ReqState  # the request, its hash chain and its spine saves (num_saved), as a dense model's
    block_ids: list[list[int]] = field(default_factory=list)  # per vLLM group
    pins: _Pins | None = None
    pin_key: tuple[int, int] | None = None


class HybridSchedulerSide:
    def __init__(self, config: ConnectorConfig, namespaces: list[list[Namespace]], layout: HybridLayout) -> None:
        self.config = config
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.num_ranks = len(namespaces)
        self.slots = len(namespaces[0])  # SPINE, or SPINE and ATTACHMENT
        self.link = StoreLink.of(config, [ns for rank in namespaces for ns in rank], "vllm-scheduler")
        self._reqs: dict[str, _Req] = {}
        self._pending_loads: list[HybridLoad] = []
        self._step = 0
        self.stats = Counter()
        self.pins: StepPins[_Pins] = StepPins(self.num_ranks, self._release)  # planned loads' pins
        self.link.client()

    def _ns(self, slot: int) -> list[str]:
        """This slot's namespace id in every rank (after the link registered them)."""
        return [self.link.ns_ids[rank * self.slots + slot] for rank in range(self.num_ranks)]

    def _req(self, request: "Request") -> _Req | None:
        r = self._reqs.get(request.request_id)
        if r is None:
            extra = request_extra_keys(request)
            if extra is None:
                return None
            r = self._reqs[request.request_id] = _Req(_ReqState(request, extra))
        return r

    # -- lookups ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        r = self._req(request)
        if r is None or not self.config.load or self.pins.workers_disabled:
            return 0, False
        bt = self.block_tokens
        start, limit = num_computed_tokens // bt, (request.num_tokens - 1) // bt  # vLLM computes >= 1 token
        if limit <= start:
            return 0, False
        stale = r.pins is not None and r.pins.generation != self.link.generation
        if r.pin_key != (start, limit) or stale:
            self._release(r.pins)
            r.pins, r.pin_key = self._lookup(r.st.hashes_upto(limit, bt), start, limit), (start, limit)
            self.stats["lookups"] += 1
        if r.pins is None:
            return 0, False
        return (r.pins.end - start) * bt, True

    def _lookup(self, hashes: list[bytes], start: int, limit: int) -> _Pins | None:
        """Pin what a hit at the deepest boundary every group can serve needs (see the module docstring)."""
        spine_ns = self._ns(SPINE)
        answers = self.link.run("acquire", lambda c: [c.acquire(ns, hashes[start:limit]) for ns in spine_ns])
        if answers is None:
            return None
        counts = [next((i for i, e in enumerate(ext) if e is None), len(ext)) for ext in answers]
        end = start + min(counts)
        generation = self.link.generation
        self._unpin(SPINE, [hashes[start + min(counts) : start + n] for n in counts])  # beyond the common prefix
        attachment = None
        if self.layout.attachment and end > start:
            end, attachment = self._pin_attachment(hashes, start, end)
        first = max(start, end - self.layout.window_spine) if self.layout.window_spine else start
        held = start + min(counts)
        self._unpin(SPINE, [hashes[start:first] + hashes[max(end, first):held]] * self.num_ranks)
        if end <= start:
            return None
        return _Pins(first, end, hashes[first:end], attachment, generation)

    def _pin_attachment(self, hashes: list[bytes], start: int, end: int) -> tuple[int, bytes | None]:
        """The deepest boundary in (start, end] whose attachment every rank holds, pinned; (start, None) if none."""
        att_ns = self._ns(ATTACHMENT)
        pinned = self._try_attachment(att_ns, hashes[end - 1])  # the spine's end: most hits end there
        if pinned is not None:
            return (end, pinned) if pinned else (start, None)
        candidates = list(range(end - 1, start, -1))
        found = self.link.run("describe", lambda c: c.describe(att_ns[0], [hashes[j - 1] for j in candidates]))
        for j, info in zip(candidates, found or ()):
            if info is None or not info.get("committed", True):
                continue
            pinned = self._try_attachment(att_ns, hashes[j - 1])
            if pinned == b"":
                break
            if pinned is not None:
                return j, pinned  # (else a rank lost it meanwhile: the next one)
        return start, None

    def _try_attachment(self, att_ns: list[str], h: bytes) -> bytes | None:
        """Pin the attachment `h` in every rank: `h` if every rank holds it, None if not (nothing left
        pinned), b"" if the daemon is away."""
        got = self.link.run("acquire", lambda c: [c.acquire(ns, [h], prefix=False)[0] for ns in att_ns])
        if got is None:
            return b""
        if all(e is not None for e in got):
            return h
        self._unpin(ATTACHMENT, [[h] if e is not None else [] for e in got])
        return None

    def _unpin(self, slot: int, per_rank: list[list[bytes]]) -> None:
        ns = self._ns(slot)
        if any(per_rank):
            self.link.run("release", lambda c: [c.release(ns[i], hs) for i, hs in enumerate(per_rank) if hs])

    def _release(self, pins: _Pins | None) -> None:
        if pins is None or pins.generation != self.link.generation:
            return  # nothing pinned, or pinned on a connection that is gone (its pins went with it)
        self._unpin(SPINE, [pins.spine] * self.num_ranks)
        if pins.attachment is not None:
            self._unpin(ATTACHMENT, [[pins.attachment]] * self.num_ranks)

    # -- loads --------------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None:
            return
        pins, r.pins = r.pins, None
        start = (r.pin_key or (0, 0))[0]
        r.pin_key = None
        end = start + num_external_tokens // self.block_tokens
        if pins is None or num_external_tokens <= 0 or end != pins.end:
            self._release(pins)  # not the hit we planned (vLLM allocated for less): nothing to load
            return
        block_ids = blocks.get_block_ids()
        spine = [spine_ids(self.layout, block_ids, pos) for pos in range(pins.first, end)]
        att = attachment_ids(self.layout, block_ids, end, first=start) if pins.attachment is not None else None
        job = HybridLoad(request.request_id, list(zip(pins.spine, spine)),
                         (pins.attachment, att) if pins.attachment is not None else None)
        if any(ids is None for ids in spine) or (pins.attachment is not None and att is None):
            job.broken = "vLLM gave a null block where the hit needs a page"
            self.stats["broken_loads"] += 1
        self._pending_loads.append(job)
        self.pins.pending.append(pins)
        self.stats["load_blocks"] += end - start
        r.st.num_saved = max(r.st.num_saved, end)  # the store holds what it loads

    def hit_tiers(self, request: "Request", num_external_tokens: int) -> dict[str, int]:
        return {}  # per-tier hit sources are reported for dense models only

    # -- per step -----------------------------------------------------------------------------------
    def build_connector_meta(self, so: "SchedulerOutput") -> HybridStepMeta:
        meta = HybridStepMeta(step=self._step, loads=self._pending_loads)
        self.pins.close_step(self._step)
        self._pending_loads = []
        state = getattr(so, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            r = self._reqs.get(req_id)
            if r is not None:
                r.block_ids = []  # freed by vLLM; a resumption brings new ones
        for new in so.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is not None:
                r.block_ids = [list(ids) for ids in new.block_ids]
                self._collect(r, new.num_computed_tokens, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0),
                              offers.get(new.req_id, ()), meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._reqs.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                for g, ids in enumerate(new_ids):
                    r.block_ids[g].extend(ids)
            before = cached.num_computed_tokens[i]
            self._collect(r, before, before + so.num_scheduled_tokens.get(req_id, 0), offers.get(req_id, ()), meta)
        self._step += 1
        return meta

    def _collect(self, r: _Req, before: int, end: int, offers, meta: HybridStepMeta) -> None:
        """The spine blocks and attachments this step completes (see the module docstring)."""
        if not self.config.save or not r.block_ids:
            return
        st, layout, bt = r.st, self.layout, self.block_tokens
        full = min(end, st.request.num_tokens) // bt  # verified tokens only, never a speculative one
        if full <= st.num_saved and not offers:
            return
        hashes = st.hashes_upto(full, bt)
        save = HybridSave(st.request.request_id)
        for pos in range(st.num_saved, full):
            ids = spine_ids(layout, r.block_ids, pos)
            if ids is not None:  # (a window spine's position vLLM no longer holds: not saved, a later child is refused)
                save.spine.append((hashes[pos], hashes[pos - 1] if pos else None, ids))
        st.num_saved = max(st.num_saved, full)
        if layout.attachment:
            for j, states in self._boundaries(before // bt, full, st.request.num_prompt_tokens, offers):
                ids = attachment_ids(layout, r.block_ids, j, state_ids=states)
                if ids is not None:
                    save.attachments.append((hashes[j - 1], ids))
        if save.spine or save.attachments:
            meta.saves.append(save)
            self.stats["save_blocks_offered"] += len(save.spine)
            self.stats["save_attachments_offered"] += len(save.attachments)

    def _boundaries(self, first: int, full: int, prompt_tokens: int, offers) -> list[tuple[int, dict | None]]:
        """Kept boundaries (in blocks) in (first, full]: with state groups, where vLLM offered every state
        group's state this step (with those blocks); else the layout's rule."""
        if not self.layout.has_state:
            return [(j, None) for j in self.layout.kept_boundaries(first, full, prompt_tokens)]
        by_end: dict[int, dict[int, int]] = {}
        for group, block, tokens in offers:
            if tokens % self.block_tokens == 0:
                by_end.setdefault(tokens // self.block_tokens, {})[group] = block
        wanted = {g.group for g in self.layout.groups if g.kind == "state"}
        return [(j, states) for j, states in sorted(by_end.items()) if 0 < j <= full and wanted <= set(states)]

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        self.pins.report(getattr(output, "kv_connector_worker_meta", None))

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        r = self._reqs.pop(request.request_id, None)
        if r is not None:
            self._release(r.pins)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def shutdown(self) -> None:
        self.link.close()
