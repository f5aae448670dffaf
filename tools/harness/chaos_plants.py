"""Bugs planted into a chaos-run engine process, so that each oracle of the chaos run is shown to fail.

Test-only: tools/harness/chaos_engine.py applies the names its spec lists
(`plant`) before the engine starts; nothing else imports this. Each bug is one
of a class that users of other KV offloading connectors hit, put back into this connector by
monkeypatching:

- `stale_block_ids_on_resume`: the scheduler side ignores that a request was
  preempted and resumed, and keeps its old (freed, reused) block ids, so it
  saves other requests' KV under this request's hashes (vLLM #52360);
- `silent_load_failure`: an injected load failure (`fail_loads`) is not
  reported: the blocks stay uncopied and vLLM computes on whatever they held
  (vLLM #49250's garbage after a failed load);
- `leak_pins`: lookup pins that vLLM did not take as a load (a prompt_logprobs
  request, an aborted one) are never released (LMCache #1034: hit but never
  retrieved, pinned forever);
- `drop_commits`: every 7th save is reserved and copied but never committed;
- `rss_leak`: every step keeps 6 MiB (engines growing until an OOM kill, LMCache #3767);
- `no_hits`: lookups answer no hit (vLLM #52735: spec decoding turning offload hits off);
- `no_reconnect`: the connector never reconnects after the daemon went away.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_kept: list = []  # what rss_leak holds on to


def _stale_block_ids_on_resume() -> None:
    from kvstore.connectors.vllm_scheduler import SchedulerSide

    original = SchedulerSide.build_connector_meta

    def build(self, so):
        cached = so.scheduled_cached_reqs
        if cached.resumed_req_ids or so.preempted_req_ids:  # hidden from the connector only, not from vLLM
            so = dataclasses.replace(so, preempted_req_ids=set(),
                                     scheduled_cached_reqs=dataclasses.replace(cached, resumed_req_ids=set()))
        return original(self, so)

    SchedulerSide.build_connector_meta = build


def _silent_load_failure() -> None:
    from kvstore.connectors.worker_loads import LoadReport

    original = LoadReport.fail

    def fail(self, job, first, why):
        if "injected" not in why:
            original(self, job, first, why)

    LoadReport.fail = fail


def _leak_pins() -> None:
    from kvstore.connectors.vllm_scheduler import SchedulerSide

    original = SchedulerSide.update_state_after_alloc

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens == 0:
            st.pins = None  # vLLM took none of the hit (prompt_logprobs, ...): the pins are forgotten
        return original(self, request, blocks, num_external_tokens)

    def request_finished(self, request):
        self._reqs.pop(request.request_id, None)  # its pins are forgotten, never released
        return False, None

    SchedulerSide.update_state_after_alloc = update_state_after_alloc
    SchedulerSide.request_finished = request_finished


def _drop_commits() -> None:
    from kvstore.connectors.worker_saves import Saves

    original = Saves._commit
    calls = [0]

    def commit(self, item):
        calls[0] += 1
        if calls[0] % 7:
            original(self, item)

    Saves._commit = commit


def _rss_leak() -> None:
    from kvstore.connectors.vllm_worker import WorkerSide

    original = WorkerSide.wait_for_save

    def wait_for_save(self, meta):
        _kept.append(np.ones(6 << 20, np.uint8))
        return original(self, meta)

    WorkerSide.wait_for_save = wait_for_save


def _no_hits() -> None:
    from kvstore.connectors.vllm_scheduler import SchedulerSide

    SchedulerSide.get_num_new_matched_tokens = lambda self, request, num_computed_tokens: (0, False)


def _no_reconnect() -> None:
    from kvstore.connectors.store_link import StoreLink

    original = StoreLink._failed

    def failed(self, exc, what="connect"):
        original(self, exc, what)
        self._next_try = float("inf")

    StoreLink._failed = failed


PLANTS = {
    "stale_block_ids_on_resume": _stale_block_ids_on_resume,
    "silent_load_failure": _silent_load_failure,
    "leak_pins": _leak_pins,
    "drop_commits": _drop_commits,
    "rss_leak": _rss_leak,
    "no_hits": _no_hits,
    "no_reconnect": _no_reconnect,
}


def plant(name: str) -> None:
    if name not in PLANTS:
        raise ValueError(f"unknown planted bug {name!r}; known: {sorted(PLANTS)}")
    PLANTS[name]()
