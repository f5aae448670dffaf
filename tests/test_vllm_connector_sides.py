"""The connector's scheduler and worker sides against a real daemon, with stand-in vLLM objects.

No engine runs here (fast); vLLM is imported only for the metadata base classes.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from connectors.vllm_meta import ConnectorConfig, LoadJob, StepMeta, WorkerReport  # noqa: E402
from connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from connectors import vllm_worker  # noqa: E402
from connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.keys import ExtraKeys, Namespace, hash_blocks  # noqa: E402
from tools.harness.connector_standins import blocks, report_step, request, sched_output  # noqa: E402

BT, NB, H, D, L = 32, 16, 2, 8, 3  # block tokens, blocks, kv heads, head size, layers
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def namespace() -> Namespace:
    return Namespace(model="unit", dtype="float32", num_layers=L, num_kv_heads=H, head_size=D,
                     block_tokens=BT, block_bytes=L * H * BT * 2 * D * 4)


def kv_tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NB, H, BT, 2 * D, generator=g) for name in LAYERS}


@pytest.fixture
def sides(daemon):
    return make_sides(daemon)


@pytest.fixture
def whole_step_sides(daemon):
    """Loads copied whole before the forward (layer_loads off)."""
    return make_sides(daemon, layer_loads=False)


def make_sides(daemon, **config):
    cfg = ConnectorConfig(socket=daemon.socket_path, retry_s=0.0, attention_scores=True, **config)
    ns = namespace()

    def make_worker(seed: int) -> tuple[WorkerSide, dict]:
        w = WorkerSide(cfg, ns, LAYERS, NB)
        kv = kv_tensors(seed)
        w.register_kv_caches(kv)
        assert w.engine is not None
        return w, kv

    return SchedulerSide(cfg, [ns], BT), make_worker


def run_step(sched: SchedulerSide, worker: WorkerSide, so, forward=LAYERS) -> StepMeta:
    """One engine step as vLLM runs it: loads started, the forward (which waits for each layer
    before its attention: `forward`, the layers in its order), saves, reports."""
    meta = sched.build_connector_meta(so)
    worker.start_load_kv(meta)
    for name in forward:
        worker.wait_for_layer_load(name)
    meta.invalid = report_step(sched, worker, meta)
    return meta


def test_save_then_load_in_another_engine_copies_the_bytes(sides):
    sched_a, make_worker = sides
    worker_a, kv_a = make_worker(1)
    tokens = list(range(1000, 1000 + 5 * BT + 7))  # 5 full blocks + 7 tokens
    req = request("a", tokens)
    assert sched_a.get_num_new_matched_tokens(req, 0) == (0, False)
    sched_a.update_state_after_alloc(req, blocks([3, 4, 5, 6, 7, 8]), 0)
    meta = run_step(sched_a, worker_a, sched_output(new=[("a", [3, 4, 5, 6, 7, 8], 0)], scheduled={"a": len(tokens)}))
    assert meta.saves.block_ids == [3, 4, 5, 6, 7]  # full blocks only
    assert meta.saves.hashes == hash_blocks(tokens, BT)
    assert meta.saves.parents[0] is None and meta.saves.parents[1] == meta.saves.hashes[0]

    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, kv_b = make_worker(2)
    req_b = request("b", tokens[: 4 * BT] + [7] * 40)  # shares 4 blocks
    num, is_async = sched_b.get_num_new_matched_tokens(req_b, 0)
    assert (num, is_async) == (4 * BT, False)
    sched_b.update_state_after_alloc(req_b, blocks([9, 10, 11, 12, 13, 14]), num)
    meta = run_step(sched_b, worker_b, sched_output(new=[("b", [9, 10, 11, 12, 13, 14], num)], scheduled={"b": 40}))
    assert [j.block_ids for j in meta.loads] == [[9, 10, 11, 12]]
    assert meta.saves.block_ids == [13]  # its new full block; what it loaded is in the store, not offered back
    for name in LAYERS:
        assert torch.equal(kv_b[name][9:13], kv_a[name][3:7])
    assert worker_b.get_block_ids_with_load_errors() == set()
    stats = sched_b.link.client().stats()
    assert stats["pinned_blocks"] == 0  # scheduler pins released once the worker reported the load


def test_hit_never_covers_the_whole_prompt(sides):
    sched, make_worker = sides
    worker, _ = make_worker(3)
    tokens = list(range(4 * BT))  # exactly 4 blocks
    req = request("a", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 1, 2, 3]), 0)
    run_step(sched, worker, sched_output(new=[("a", [0, 1, 2, 3], 0)], scheduled={"a": len(tokens)}))
    again = SchedulerSide(sched.config, [namespace()], BT)
    assert again.get_num_new_matched_tokens(request("b", tokens), 0) == (3 * BT, False)
    # a local prefix-cache hit of 2 blocks: only what lies beyond it is reported
    assert again.get_num_new_matched_tokens(request("c", tokens), 2 * BT) == (1 * BT, False)


def test_cache_salt_separates_chains(sides):
    sched, make_worker = sides
    worker, _ = make_worker(4)
    tokens = list(range(3 * BT + 1))
    req = request("x", tokens, salt="X")
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 1, 2, 3]), 0)
    run_step(sched, worker, sched_output(new=[("x", [0, 1, 2, 3], 0)], scheduled={"x": len(tokens)}))
    other = SchedulerSide(sched.config, [namespace()], BT)
    assert other.get_num_new_matched_tokens(request("y", tokens, salt="Y"), 0)[0] == 0
    assert other.get_num_new_matched_tokens(request("n", tokens), 0)[0] == 0
    assert other.get_num_new_matched_tokens(request("x2", tokens, salt="X"), 0)[0] == 3 * BT
    assert ExtraKeys(cache_salt="X") != ExtraKeys(cache_salt="Y")


def test_speculative_tokens_are_never_saved(sides):
    sched, make_worker = sides
    worker, _ = make_worker(5)
    prompt = list(range(2 * BT - 2))
    req = request("a", prompt)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 1]), 0)
    meta = run_step(sched, worker, sched_output(new=[("a", [0, 1], 0)], scheduled={"a": len(prompt)}))
    assert len(meta.saves) == 1
    # decode step with 3 draft tokens: computed 62 + scheduled 4 reaches 66 > 64, but only 63 tokens
    # are verified (62 prompt + 1 sampled): block 1 is not complete in verified tokens.
    req.all_token_ids.append(5)
    req.num_tokens += 1
    meta = run_step(sched, worker, sched_output(cached=[("a", [2], len(prompt))], scheduled={"a": 4}))
    assert len(meta.saves) == 0
    req.all_token_ids.append(6)
    req.num_tokens += 1  # 64 verified tokens: block 1 is complete
    meta = run_step(sched, worker, sched_output(cached=[("a", [], len(prompt) + 1)], scheduled={"a": 4}))
    assert meta.saves.block_ids == [1]
    assert meta.saves.hashes == hash_blocks(req.all_token_ids, BT)[1:2]


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
    run_step(sched, writer, _admit(sched, "w", tokens, [0, 1, 2, 3], 0))
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
    assert sched.workers_disabled and sched.get_num_new_matched_tokens(request("p", tokens), 0) == (0, False)
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
    run_step(sched_a, worker_a, _admit(sched_a, "a", tokens, [0, 1, 2, 3, 4], 0))
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
    run_step(sched_a, worker_a, _admit(sched_a, "a", prefix + [1, 2, 3], [0, 1, 2, 3, 4], 0))
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
    run_step(sched_a, worker_a, _admit(sched_a, "a", prefix + [1, 2, 3], [0, 1, 2, 3, 4], 0))
    sched_b = SchedulerSide(sched_a.config, [namespace()], BT)
    worker_b, _ = make_worker(10)
    loader, sharer = prefix + [7] * (BT + 5), prefix + [8] * (2 * BT + 5)
    old = list(range(3000, 3000 + 3 * BT))  # preempted below: its block 7 goes to the loader
    run_step(sched_b, worker_b, _admit(sched_b, "o", old, [7, 13, 14], 0))
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


def _admit(sched: SchedulerSide, req_id: str, tokens: list[int], ids: list[int], num_computed: int):
    """A new request admitted with no external hit; the step's scheduler output."""
    sched.get_num_new_matched_tokens(request(req_id, tokens), num_computed)
    sched.update_state_after_alloc(request(req_id, tokens), blocks(ids), 0)
    return sched_output(new=[(req_id, ids, num_computed)], scheduled={req_id: len(tokens) - num_computed})


def test_split_copies_move_every_block_and_a_failed_copy_fails_the_whole_load(whole_step_sides, monkeypatch):
    """Copies split over the engine thread and copy threads (big steps): saves and loads are byte-exact;
    a copy that fails fails every block of the step's load (vLLM recomputes them all)."""
    from connectors import cpu_copy

    monkeypatch.setattr(cpu_copy, "SPLIT_BYTES", 0)
    sched_a, make_worker = whole_step_sides
    worker_a, kv_a = make_worker(21)
    tokens = list(range(7000, 7000 + 5 * BT + 3))
    req = request("a", tokens)
    sched_a.get_num_new_matched_tokens(req, 0)
    sched_a.update_state_after_alloc(req, blocks([3, 4, 5, 6, 7, 8]), 0)
    run_step(sched_a, worker_a, sched_output(new=[("a", [3, 4, 5, 6, 7, 8], 0)], scheduled={"a": len(tokens)}))

    def load_into(seed: int, req_id: str, fail: bool):
        sched = SchedulerSide(sched_a.config, [namespace()], BT)
        worker, kv = make_worker(seed)
        executor = worker.engine.transfers.executor
        executor.threads = 3
        req = request(req_id, tokens[: 4 * BT] + [5] * 9)
        num, _ = sched.get_num_new_matched_tokens(req, 0)
        assert num == 4 * BT
        sched.update_state_after_alloc(req, blocks([9, 10, 11, 12, 13]), num)
        real, threads = executor.execute, set()

        def copy(pieces):
            threads.add(threading.current_thread().name.split("_")[0])
            if fail and threading.current_thread() is not threading.main_thread():
                raise RuntimeError("injected copy failure")
            real(pieces)

        monkeypatch.setattr(executor, "execute", copy)
        meta = run_step(sched, worker, sched_output(new=[(req_id, [9, 10, 11, 12, 13], num)], scheduled={req_id: 9}))
        return meta, kv, threads

    meta, kv_b, threads = load_into(22, "b", False)
    assert meta.invalid == set() and "kvstore-copy" in threads and len(threads) == 2
    for name in LAYERS:
        assert torch.equal(kv_b[name][9:13], kv_a[name][3:7])
    meta, _, _ = load_into(23, "c", True)  # a helper thread's part fails
    assert meta.invalid == {9, 10, 11, 12}


def test_preempted_request_resumes_with_new_blocks(sides):
    """A resumed request's block ids are replaced; blocks already offered are not offered again."""
    sched, make_worker = sides
    worker, kv = make_worker(11)
    tokens = list(range(3000, 3000 + 4 * BT))
    req = request("p", tokens[: 2 * BT + 5])
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = run_step(sched, worker, sched_output(new=[("p", [1, 2, 3], 0)], scheduled={"p": 2 * BT + 5}))
    assert meta.saves.block_ids == [1, 2]
    # preempted, then resumed with other blocks and more tokens known (as vLLM recomputes them)
    req.all_token_ids[:] = tokens
    req.num_tokens = len(tokens)
    meta = run_step(sched, worker, sched_output(cached=[("p", [7, 8, 9, 10], 0)], resumed=["p"], scheduled={"p": 4 * BT}))
    assert meta.saves.block_ids == [9, 10]  # blocks 2 and 3 of the chain, in their new places
    assert meta.saves.hashes == hash_blocks(tokens, BT)[2:4]
    assert meta.saves.parents[0] == hash_blocks(tokens, BT)[1]


def test_hits_are_reported_by_the_tier_that_held_them(daemon_factory, tmp_path):
    """Saved blocks persist through a daemon restart on the disk tier: the next engine's hit is
    reported as DISK (the daemon promotes them for the load), the one after that as HOST."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from connectors.vllm import KVStoreConnector

    # Not persistent: the host tier goes down to the disk at SIGTERM (a kept arena would report HOST).
    disk = ["--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB", "--no-persistent-host"]
    d = daemon_factory(*disk, disk=True, name="tiers-test")
    cfg = ConnectorConfig(socket=d.socket_path, retry_s=0.0)
    sched = SchedulerSide(cfg, [namespace()], BT)
    worker = WorkerSide(cfg, namespace(), LAYERS, NB)
    worker.register_kv_caches(kv_tensors(7))
    tokens = list(range(2000, 2000 + 4 * BT + 3))
    req = request("a", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    run_step(sched, worker, sched_output(new=[("a", [0, 1, 2, 3, 4], 0)], scheduled={"a": len(tokens)}))
    assert d.stop() == 0  # SIGTERM: the host tier is written to disk
    d = daemon_factory(*disk, disk=True, name="tiers-test")

    def hit_sources(req_id: str) -> dict:
        s = SchedulerSide(ConnectorConfig(socket=d.socket_path, retry_s=0.0), [namespace()], BT)
        r = request(req_id, tokens)
        num, _ = s.get_num_new_matched_tokens(r, 0)
        assert num == 4 * BT
        s.update_state_after_alloc(r, blocks([5, 6, 7, 8, 9]), num)
        connector = KVStoreConnector.__new__(KVStoreConnector)  # only the scheduler half is needed
        connector.scheduler = s
        out = connector.get_external_cache_hit_sources(r, num)
        assert connector.get_external_cache_hit_sources(r, num - BT) == {CacheHitSource.HOST: num - BT}, \
            "a count that is not the planned load falls back to the class default"
        s._release(s._pending_pins.pop())
        return out

    assert hit_sources("b") == {CacheHitSource.DISK: 4 * BT}
    assert hit_sources("c") == {CacheHitSource.HOST: 4 * BT}  # promoted by b's acquire


def stored_prompt(sched, make_worker, seed: int, n_blocks: int, base: int) -> tuple[list[int], dict]:
    """Engine A computes and stores a prompt of `n_blocks` full blocks (+3 tokens): (tokens, A's KV)."""
    worker, kv = make_worker(seed)
    tokens = list(range(base, base + n_blocks * BT + 3))
    req = request(f"src{seed}", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    ids = list(range(n_blocks + 1))
    sched.update_state_after_alloc(req, blocks(ids), 0)
    run_step(sched, worker, sched_output(new=[(req.request_id, ids, 0)], scheduled={req.request_id: len(tokens)}))
    return tokens, kv


def hit_step(sched_a, worker, tokens, req_id: str, ids: list[int]):
    """Engine B's scheduler finds the stored prefix of `tokens` and plans its load into `ids`: (its scheduler,
    worker, the step's scheduler output)."""
    sched = SchedulerSide(sched_a.config, [namespace()], BT)
    req = request(req_id, tokens[: (len(ids) - 1) * BT] + [5] * 9)
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    assert num == (len(ids) - 1) * BT
    sched.update_state_after_alloc(req, blocks(ids), num)
    return sched, worker, sched_output(new=[(req_id, ids, num)], scheduled={req_id: 9})


def test_layer_wise_load_has_each_layer_in_place_when_the_forward_waits_for_it(sides, monkeypatch):
    """The copy runs on a helper thread one layer at a time; wait_for_layer_load(layer) returns once that
    layer of every block is copied (checked before the later layers are let through), in the forward's order."""
    sched_a, make_worker = sides
    tokens, kv_a = stored_prompt(sched_a, make_worker, 31, 4, 11000)
    worker, kv_b = make_worker(32)
    executor = worker.engine.transfers.executor
    real, gate, copied = executor.run, threading.Event(), []

    def held_after_first_layer(plan):  # layer 0 flows; the rest wait for the gate
        layers = set(plan.layer.tolist())
        assert len(layers) == 1, "one layer per plan in a layer-wise load"
        layer = layers.pop()
        if layer != worker.loads.layer_order[0]:
            assert gate.wait(10)
        assert threading.current_thread() is not threading.main_thread()
        copied.append(layer)
        real(plan)

    monkeypatch.setattr(executor, "run", held_after_first_layer)
    sched, _, so = hit_step(sched_a, worker, tokens, "b", [9, 10, 11, 12, 13])
    meta = sched.build_connector_meta(so)
    worker.start_load_kv(meta)
    worker.wait_for_layer_load(LAYERS[0])  # returns with layer 0 done although the others are held
    assert torch.equal(kv_b[LAYERS[0]][9:13], kv_a[LAYERS[0]][0:4])
    assert set(copied) == {0} and not torch.equal(kv_b[LAYERS[1]][9:13], kv_a[LAYERS[1]][0:4])
    returned = threading.Event()
    waiting = threading.Thread(target=lambda: (worker.wait_for_layer_load(LAYERS[1]), returned.set()))
    waiting.start()
    assert not returned.wait(0.3)  # layer 1 is held back: its wait waits
    gate.set()
    assert returned.wait(10)
    waiting.join()
    for name in LAYERS[1:]:
        worker.wait_for_layer_load(name)
        assert torch.equal(kv_b[name][9:13], kv_a[name][0:4])
    assert report_step(sched, worker, meta) == set()
    assert sched_a.link.client().stats()["pinned_blocks"] == 0  # the step's end released the worker's pins
    # a forward that reaches the layers in another order: the next loads copy in that order
    backwards = LAYERS[::-1]
    worker.wait_for_layer_load(LAYERS[0])  # outside a step: nothing to wait for
    run_step(*hit_step(sched_a, worker, tokens, "c", [1, 2, 3, 4, 5]), forward=backwards)
    assert worker.loads.layer_order == [LAYERS.index(n) for n in backwards]
    copied.clear()
    meta = run_step(*hit_step(sched_a, worker, tokens, "d", [6, 7, 8, 14, 15]), forward=backwards)
    assert copied == list(range(L))[::-1] and meta.invalid == set()  # one plan per layer, the forward's order
    for name in LAYERS:
        assert torch.equal(kv_b[name][[6, 7, 8, 14]], kv_a[name][0:4])


def test_a_forward_that_does_not_wait_gets_load_errors_and_whole_step_copies_after(sides, caplog):
    """Without wait_for_layer_load calls the forward may have read blocks not yet copied: the step's loaded
    blocks are reported as load errors (vLLM recomputes them), and later steps copy before the forward."""
    sched_a, make_worker = sides
    tokens, kv_a = stored_prompt(sched_a, make_worker, 41, 3, 12000)
    worker, kv_b = make_worker(42)
    with caplog.at_level(logging.WARNING):
        meta = run_step(*hit_step(sched_a, worker, tokens, "b", [4, 5, 6, 7]), forward=())
    assert meta.invalid == {4, 5, 6}
    assert any("did not wait" in r.getMessage() for r in caplog.records)
    assert sched_a.link.client().stats()["pinned_blocks"] == 0
    sched, _, so = hit_step(sched_a, worker, tokens, "c", [8, 9, 10, 11])
    meta = sched.build_connector_meta(so)
    worker.start_load_kv(meta)  # copied here, before any forward
    for name in LAYERS:
        assert torch.equal(kv_b[name][8:11], kv_a[name][0:3])
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == set()


def test_an_injected_save_failure_aborts_its_reservations(daemon):
    """fail_saves (fault injection, off by default): a step's save fails after its reserve, as if its copy
    had failed; its reservations are aborted and nothing is committed."""
    sched, make_worker = make_sides(daemon, fail_saves=1.0)
    worker, _ = make_worker(1)
    tokens = list(range(2000, 2000 + 3 * BT))
    req = request("a", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = run_step(sched, worker, sched_output(new=[("a", [1, 2, 3], 0)], scheduled={"a": len(tokens)}))
    assert len(meta.saves) == 3 and worker.faults.injected_saves == 1
    stats = sched.link.client().stats()
    assert stats["blocks"] == 0 and stats["reserved_blocks"] == 0
    with pytest.raises(ValueError, match="fractions in 0..1"):
        ConnectorConfig.from_extra({"fail_saves": 1.5})
