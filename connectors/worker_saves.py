"""The worker side's saves: a step's newly computed full blocks, out to the store.

Per step (`wait_for_save`, after the target and draft forwards): one `reserve`
RPC for the step's SaveBatch, one copy plan (KV -> the reserved extents) run by
the engine's transfers, and one `commit` RPC once the copy is done — with a
key-norm attention estimate per block when available, and the blocks' token
ids when the scheduler side sent them (for KV events). A host copy is done
when it returns, so the commit follows at once; a GPU copy is committed at a
later hook once its event completed (the forward's later work waits for the
copy on the GPU, so vLLM may free and reuse the blocks). A copy that fails
aborts the step's reservations; a save that cannot happen is a future miss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstore.connectors.attention_score import KeyNormScorer
from kvstore.connectors.engine_kv import EngineKV, FaultInjector
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm_meta import SaveBatch
from kvstore.protocol import metadata_frame_bytes

log = logging.getLogger(__name__)


@dataclass
class _Saving:
    ticket: object
    hashes: list
    generation: int
    scores: object  # attention_score.Scores or None
    tokens: list | None


class Saves:
    def __init__(self, link: StoreLink, scorer: KeyNormScorer | None, faults: FaultInjector | None = None) -> None:
        self.link, self.scorer, self.faults = link, scorer, faults
        self._pending: list[_Saving] = []  # copies submitted, not yet committed

    def save(self, engine: EngineKV, saves: SaveBatch) -> None:
        """Reserve (into the GPU tier while it has free pages, for an engine that mapped the pools; else
        the arena), copy, and commit once the copy is done."""
        link = self.link
        mem = engine.memory(link)
        if mem is None:
            return
        blocks = list(zip(saves.hashes, saves.parents))
        if mem.tier == "host":
            answer = link.run("reserve", lambda c: (lambda e: (e, ["host"] * len(e)))(c.reserve(link.ns_ids[0], blocks)))
        else:
            answer = link.run("reserve", lambda c: c.reserve_at(link.ns_ids[0], blocks, mem.tier))
        if answer is None:
            return
        slots, at = answer
        reserved = [i for i, ext in enumerate(slots) if ext is not None]
        if not reserved:
            return
        hashes = [saves.hashes[i] for i in reserved]
        block_ids = [saves.block_ids[i] for i in reserved]
        generation = link.generation
        try:
            plan = engine.plan(block_ids, [mem.absolute(slots[i], at[i]) for i in reserved], 0, to_kv=False)
        except (ValueError, IndexError) as exc:
            self._abort(hashes, generation, exc)
            return
        if self.faults is not None and self.faults.save_fails():
            self._abort(hashes, generation, RuntimeError("injected save failure (fail_saves)"))
            return
        ticket = engine.transfers.save(plan)
        if ticket.error is not None:
            self._abort(hashes, generation, ticket.error)
            return
        scores = self.scorer.submit(block_ids) if self.scorer is not None else None
        tokens = [saves.tokens[i] for i in reserved] if any(saves.tokens) else None
        self._pending.append(_Saving(ticket, hashes, generation, scores, tokens))
        self.commit_done()

    def _abort(self, hashes: list, generation: int, exc: BaseException) -> None:
        log.warning("kvstore: save copy failed (%r); aborting %d reserved blocks", exc, len(hashes))
        if self.link.generation == generation:
            self.link.run("abort", lambda c: c.abort(self.link.ns_ids[0], hashes))

    def commit_done(self, block: bool = False) -> None:
        """Commit the saves whose copies are done (every pending one, waiting for it, with `block`)."""
        keep = []
        for item in self._pending:
            if not block and not item.ticket.done():
                keep.append(item)
                continue
            error = item.ticket.finish()
            if error is not None:
                self._abort(item.hashes, item.generation, error)
            elif self.link.generation == item.generation:
                self._commit(item)
        self._pending = keep

    def _commit(self, item: _Saving) -> None:
        link = self.link
        attention = item.scores.result() if item.scores is not None else None
        ns_id = link.ns_ids[0]
        link.run("commit", lambda c: c.commit(ns_id, item.hashes, attention=attention,
                                             tokens=_fitting(c, item.tokens)))
        if log.isEnabledFor(logging.DEBUG):
            trace = {"committed": len(item.hashes), "at": time.monotonic()}
            log.debug("kvstore: commit %s", trace, extra={"kvstore_trace": trace})


def without_requests(saves: SaveBatch, req_ids: set[str]) -> SaveBatch:
    kept = SaveBatch(admitted={r: ids for r, ids in saves.admitted.items() if r not in req_ids})
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
