"""The connector's sides when loads fail (a missing block, a plan the engine refuses, the daemon down, a
disabled worker, a failed copy under vLLM's prefix cache and asynchronous scheduling), against a real
daemon with stand-in vLLM objects: a failed load is reported and recomputed, and nothing computed on it
is stored.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvstore.connectors.vllm_meta import ConnectorConfig, LoadJob, StepMeta, WorkerReport  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from tests.connector_sides import BT, LAYERS, NB, H, D, L, admit, kv_tensors, make_sides, namespace  # noqa: E402
from tests.connector_sides import run_step, sides  # noqa: E402,F401  (sides: a fixture)
from kvstore.tools.harness.connector_standins import blocks, request, sched_output  # noqa: E402


def test_missing_block_is_reported_as_a_load_error(sides):
    sched, make_worker = sides
    worker, kv = make_worker(6)
    before = {n: t.clone() for n, t in kv.items()}
    missing = hash_blocks(list(range(BT)), BT)
    meta = StepMeta(step=0, loads=[LoadJob("r", [2, 3], missing + missing, False)])
    worker.start_load_kv(meta)
    assert worker.get_block_ids_with_load_errors() == {2, 3}
    assert worker.build_worker_meta() == WorkerReport({0: 1})
    for n in LAYERS:
        assert torch.equal(kv[n], before[n])


def test_a_load_whose_copy_plan_cannot_be_built_fails_and_releases_its_pins(sides, daemon):
    """A plan the engine refuses (here: one engine block named twice) fails that load, reported for
    recompute, its pins released; the engine's step goes on."""
    sched, make_worker = sides
    writer, _ = make_worker(14)
    tokens = list(range(800, 800 + 3 * BT + 5))
    run_step(sched, writer, admit(sched, "w", tokens, [0, 1, 2, 3], 0))
    worker, _ = make_worker(15)
    meta = StepMeta(step=0, loads=[LoadJob("r", [3, 3], hash_blocks(tokens, BT)[:2], False)])
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {3}
    assert daemon.stats()["pinned_blocks"] == 0 and daemon.check() == []
    worker.shutdown()
    writer.shutdown()


def test_daemon_down_means_misses_and_load_errors_never_exceptions(tmp_path, caplog):
    cfg = ConnectorConfig(socket=str(tmp_path / "absent.sock"), retry_s=0.0, timeout_s=0.5)
    ns = namespace()
    sched = SchedulerSide(cfg, [ns], BT)
    worker = WorkerSide(cfg, ns, LAYERS, NB)
    worker.register_kv_caches(kv_tensors(7))
    tokens = list(range(3 * BT))
    with caplog.at_level(logging.WARNING):
        assert sched.get_num_new_matched_tokens(request("a", tokens), 0) == (0, False)
        meta = StepMeta(step=0, loads=[LoadJob("a", [0, 1], hash_blocks(tokens, BT)[:2], True)])
        meta.saves.add("a", 2, b"h" * 16, None)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {0, 1}
    assert worker.get_finished() == (None, {"a"})  # async loads still complete (as failed)
    assert any("daemon unavailable" in r.getMessage() for r in caplog.records)


def test_block_size_mismatch_disables_the_worker(daemon, caplog):
    cfg = ConnectorConfig(socket=daemon.socket_path)
    bad = Namespace(model="unit", dtype="float32", num_layers=L, num_kv_heads=H, head_size=D,
                    block_tokens=BT, block_bytes=123)
    w = WorkerSide(cfg, bad, LAYERS, NB)
    with caplog.at_level(logging.WARNING):
        w.register_kv_caches(kv_tensors(8))
    assert w.engine is None
    assert any("disabled" in r.getMessage() for r in caplog.records)


def test_a_disabled_worker_finishes_its_asynchronous_loads_and_the_scheduler_stops_offering_hits(sides, daemon):
    """vLLM holds a request with an asynchronous load until the worker reports it finished: a worker that
    could not map its KV fails the load and reports it, and tells the scheduler side, which offers no
    more hits (each would fail and be recomputed)."""
    sched, make_worker = sides
    writer, _ = make_worker(12)
    tokens = list(range(700, 700 + 3 * BT + 5))
    req = request("w", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 1, 2, 3]), 0)
    run_step(sched, writer, sched_output(new=[("w", [0, 1, 2, 3], 0)], scheduled={"w": len(tokens)}))
    bad = Namespace(model="unit", dtype="float32", num_layers=L, num_kv_heads=H, head_size=D,
                    block_tokens=BT, block_bytes=123)
    disabled = WorkerSide(ConnectorConfig(socket=daemon.socket_path), bad, LAYERS, NB)
    disabled.register_kv_caches(kv_tensors(13))
    assert disabled.engine is None
    hashes = hash_blocks(tokens, BT)[:3]
    meta = StepMeta(step=0, loads=[LoadJob("r", [5, 6, 7], hashes, True), LoadJob("s", [8], hashes[:1], False)])
    disabled.start_load_kv(meta)
    disabled.wait_for_save(meta)
    assert disabled.get_finished() == (None, {"r"})  # the synchronous one is not reported: vLLM never waits for it
    assert disabled.get_block_ids_with_load_errors() == {5, 6, 7, 8}
    report = disabled.build_worker_meta()
    assert report == WorkerReport({0: 1}, disabled=True)
    assert disabled.build_worker_meta() == WorkerReport({}, disabled=True)  # said every step
    other = request("o", tokens)
    assert sched.get_num_new_matched_tokens(other, 0)[0] == 3 * BT  # stored: a hit, before it hears
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report, invalid_block_ids=set()))
    assert sched.pins.workers_disabled and sched.get_num_new_matched_tokens(request("p", tokens), 0) == (0, False)
    disabled.shutdown()
    writer.shutdown()


@pytest.mark.parametrize("layer_loads", [True, False], ids=["layer-wise", "whole-step"])
def test_failed_load_saves_nothing_of_that_request_and_offers_the_blocks_again(daemon, monkeypatch, layer_loads):
    sched_a, make_worker = make_sides(daemon, layer_loads=layer_loads)
    worker_a, _ = make_worker(9)
    tokens = list(range(500, 500 + 4 * BT + 3))
    req = request("a", tokens)
    sched_a.get_num_new_matched_tokens(req, 0)
    sched_a.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    run_step(sched_a, worker_a, sched_output(new=[("a", [0, 1, 2, 3, 4], 0)], scheduled={"a": len(tokens)}))
    stored = sched_a.link.client().stats()["blocks"]

    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, _ = make_worker(10)
    longer = tokens[: 4 * BT] + list(range(9000, 9000 + 3 * BT))  # 4 shared blocks, 3 new full blocks
    req_b = request("b", longer)
    num, _ = sched_b.get_num_new_matched_tokens(req_b, 0)
    assert num == 4 * BT
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    sched_b.update_state_after_alloc(req_b, blocks(ids), num)
    # the second block fails (the connector's fault injection, its position fixed here)
    monkeypatch.setattr(worker_b.faults, "first_failed", lambda num_blocks: 1)
    meta = run_step(sched_b, worker_b, sched_output(new=[("b", ids, num)], scheduled={"b": len(longer) - num}))
    assert meta.invalid == {6, 7, 8}  # the failed block and the rest of the load
    assert meta.saves.block_ids == [9, 10, 11]  # the step offered the new blocks (not the loaded ones) ...
    assert sched_b.link.client().stats()["blocks"] == stored  # ... but none were stored
    assert sched_b._reqs["b"].num_saved == 1  # vLLM recomputes from block 1: offered again


def test_with_asynchronous_scheduling_a_failed_load_holds_saves_back_until_the_scheduler_read_it(daemon, monkeypatch):
    """vLLM's asynchronous scheduling (the default on GPUs) plans step N+1 before it reads step N's
    output: a request whose load failed in N goes on with its chunked prefill in N+1, on the garbage. Its
    blocks of N+1 must not be stored (other engines would load them); once the scheduler side has read
    the failure (the metadata of N+2 says so) and vLLM recomputes, they are."""
    sched_a, make_worker = make_sides(daemon)
    worker_a, _ = make_worker(9)
    tokens = list(range(500, 500 + 4 * BT + 3))
    run_step(sched_a, worker_a, admit(sched_a, "a", tokens, [0, 1, 2, 3, 4], 0))
    stored = sched_a.link.client().stats()["blocks"]

    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, _ = make_worker(10)
    longer = tokens[: 4 * BT] + list(range(9000, 9000 + 4 * BT + 5))  # 4 shared blocks, then 4 new ones
    req_b = request("b", longer)
    num, _ = sched_b.get_num_new_matched_tokens(req_b, 0)
    assert num == 4 * BT
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    sched_b.update_state_after_alloc(req_b, blocks(ids), num)
    monkeypatch.setattr(worker_b.faults, "first_failed", lambda num_blocks: 1)

    def step(so):  # a step's worker hooks, its output not read yet
        meta = sched_b.build_connector_meta(so)
        worker_b.start_load_kv(meta)
        for name in LAYERS:
            worker_b.wait_for_layer_load(name)
        worker_b.wait_for_save(meta)
        return meta, SimpleNamespace(invalid_block_ids=worker_b.get_block_ids_with_load_errors(),
                                     kv_connector_worker_meta=worker_b.build_worker_meta())

    meta_n, out_n = step(sched_output(new=[("b", ids, num)], scheduled={"b": BT // 2}))  # half of block 9
    assert out_n.invalid_block_ids == {6, 7, 8} and meta_n.saves.block_ids == []
    meta_n1, out_n1 = step(sched_output(cached=[("b", [], num + BT // 2)], scheduled={"b": 2 * BT}))
    assert meta_n1.saves.block_ids == [9, 10]  # offered (their parent is stored): the scheduler has not
    assert sched_b.link.client().stats()["blocks"] == stored  # read step N yet; not stored: computed on garbage
    sched_b.update_connector_output(out_n)
    sched_b.update_connector_output(out_n1)
    # vLLM recomputes from the first failed block (block 1 of the request, engine block 6)
    meta_n2, _ = step(sched_output(cached=[("b", [], BT)], scheduled={"b": len(longer) - BT}))
    assert meta_n2.invalid_seen == {6, 7, 8}
    assert meta_n2.saves.block_ids == [6, 7, 8, 9, 10, 11, 12]  # offered again from the failed block ...
    assert sched_b.link.client().stats()["blocks"] == stored + 4  # ... and the new ones stored now
    worker_a.shutdown()
    worker_b.shutdown()


def test_a_request_sharing_a_failed_load_by_prefix_cache_saves_nothing_in_that_step(daemon, monkeypatch):
    """Found by the chaos run's probe: vLLM caches the blocks of a synchronous load as soon as it
    allocates them, so a request admitted in the same step can hit them in its local prefix cache and
    attend to them in the same forward. When the load fails, that request's new blocks were computed on
    garbage: it must save none of them in that step either (they were stored, and a later engine that
    loaded them gave wrong output), and offer them again."""
    sched_a, make_worker = make_sides(daemon)
    worker_a, _ = make_worker(9)
    prefix = list(range(500, 500 + 4 * BT))
    run_step(sched_a, worker_a, admit(sched_a, "a", prefix + [1, 2, 3], [0, 1, 2, 3, 4], 0))
    stored = sched_a.link.client().stats()["blocks"]

    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, _ = make_worker(10)
    loader = prefix + list(range(9000, 9000 + BT + 5))  # loads the 4 prefix blocks
    sharer = prefix + list(range(7000, 7000 + 2 * BT + 5))  # vLLM's local hit on the loader's blocks
    num, _ = sched_b.get_num_new_matched_tokens(request("l", loader), 0)
    assert num == 4 * BT
    sched_b.update_state_after_alloc(request("l", loader), blocks([5, 6, 7, 8, 9]), num)
    sched_b.get_num_new_matched_tokens(request("s", sharer), 4 * BT)  # nothing after the local hit
    sched_b.update_state_after_alloc(request("s", sharer), blocks([5, 6, 7, 8, 10, 11, 12]), 0)
    monkeypatch.setattr(worker_b.faults, "first_failed", lambda num_blocks: 2)  # the loader's 3rd block fails
    so = sched_output(new=[("l", [5, 6, 7, 8, 9], num), ("s", [5, 6, 7, 8, 10, 11, 12], 4 * BT)],
                      scheduled={"l": len(loader) - num, "s": len(sharer) - 4 * BT})
    meta = run_step(sched_b, worker_b, so)
    assert meta.invalid == {7, 8}
    assert set(meta.saves.req_ids) == {"l", "s"}  # both offered blocks ...
    assert sched_b.link.client().stats()["blocks"] == stored  # ... and neither stored one
    # Both hold the failed blocks: vLLM recomputes them in one of them, and the other attends to them as
    # they are until then (to garbage, if that one is aborted first): neither offers them, or what
    # follows them, again.
    assert sched_b._reqs["s"].save_limit == 2 and sched_b._reqs["l"].save_limit == 2
    sched_b._reqs["s"].request = request("s", sharer + list(range(100, 100 + 2 * BT)))  # it decodes on
    meta = run_step(sched_b, worker_b, sched_output(cached=[("s", [13, 14], len(sharer))], scheduled={"s": 2 * BT}))
    assert "s" not in meta.saves.req_ids  # its new full blocks come after the failed ones: never offered


def test_a_failed_load_names_the_blocks_to_evict_from_the_prefix_cache(daemon, monkeypatch):
    """vLLM's "recompute" policy keeps a failed load's blocks in its prefix cache for the request that
    recomputes them; the scheduler side names them, and what follows them in every request holding one
    (computed on them), for the connector to evict. A preempted request's old block ids are forgotten."""
    sched_a, make_worker = make_sides(daemon)
    worker_a, _ = make_worker(9)
    prefix = list(range(600, 600 + 4 * BT))
    run_step(sched_a, worker_a, admit(sched_a, "a", prefix + [1, 2, 3], [0, 1, 2, 3, 4], 0))
    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, _ = make_worker(10)
    loader, sharer = prefix + [7] * (BT + 5), prefix + [8] * (2 * BT + 5)
    old = list(range(3000, 3000 + 3 * BT))  # preempted below: its block 7 goes to the loader
    run_step(sched_b, worker_b, admit(sched_b, "o", old, [7, 13, 14], 0))
    num, _ = sched_b.get_num_new_matched_tokens(request("l", loader), 0)
    sched_b.update_state_after_alloc(request("l", loader), blocks([5, 6, 7, 8, 9]), num)
    sched_b.get_num_new_matched_tokens(request("s", sharer), 4 * BT)
    sched_b.update_state_after_alloc(request("s", sharer), blocks([5, 6, 7, 8, 10, 11, 12]), 0)
    monkeypatch.setattr(worker_b.faults, "first_failed", lambda num_blocks: 2)
    so = sched_output(new=[("l", [5, 6, 7, 8, 9], num), ("s", [5, 6, 7, 8, 10, 11, 12], 4 * BT)],
                      scheduled={"l": len(loader) - num, "s": len(sharer) - 4 * BT}, preempted=["o"])
    meta = sched_b.build_connector_meta(so)
    worker_b.start_load_kv(meta)
    for name in LAYERS:
        worker_b.wait_for_layer_load(name)
    worker_b.wait_for_save(meta)
    invalid = worker_b.get_block_ids_with_load_errors()
    stale = sched_b.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker_b.build_worker_meta(),
                                                            invalid_block_ids=invalid))
    assert invalid == {7, 8}
    assert stale == {7, 8, 9, 10, 11, 12}  # the loader's from block 2 on, the sharer's too; not 13, 14
    assert sched_b._reqs["o"].num_saved == 3  # the preempted request's old ids are not its blocks any more
