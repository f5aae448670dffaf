"""Stand-ins for the vLLM objects the connector's two sides read (requests, block lists, scheduler
output): only the attributes the connector touches. Used by the sides tests and by
tools/bench/bench_layer_loads.py, which drive SchedulerSide and WorkerSide without an engine."""

from __future__ import annotations

from types import SimpleNamespace


def request(req_id: str, tokens: list[int], salt: str | None = None):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens),
                           prompt_embeds=None, lora_request=None, cache_salt=salt, mm_features=[])


def blocks(ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def sched_output(new=(), cached=(), scheduled=None, resumed=(), preempted=()):
    """new: [(req_id, block_ids, num_computed)]; cached: [(req_id, new_block_ids, num_computed)]."""
    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(b,) if b else None for _, b, _ in cached],
            num_computed_tokens=[n for _, _, n in cached]),
        num_scheduled_tokens=scheduled or {},
    )


def report_step(sched, worker, meta) -> set[int]:
    """The end of an engine step after its forward: saves, the worker's reports handed to the scheduler
    side. Returns the block ids whose load failed."""
    worker.wait_for_save(meta)
    invalid = worker.get_block_ids_with_load_errors()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta(),
                                                  invalid_block_ids=invalid))
    return invalid
