"""The connector's scheduler and worker sides against a real daemon, with stand-in vLLM objects.

No engine runs here (fast); vLLM is imported only for the metadata base classes. Loads that fail:
tests/test_vllm_connector_load_errors.py.
"""

from __future__ import annotations

import logging
import threading

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvstore.client import SPIN_US  # noqa: E402
from kvstore.connectors.vllm_meta import ConnectorConfig  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.keys import ExtraKeys, hash_blocks  # noqa: E402
from tests.connector_sides import BT, LAYERS, NB, L, admit, kv_tensors, make_sides, namespace, run_step  # noqa: E402
from tests.connector_sides import sides, whole_step_sides  # noqa: E402,F401  (fixtures)
from kvstore.tools.harness.connector_standins import blocks, report_step, request, sched_output  # noqa: E402


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


def test_split_copies_move_every_block_and_a_failed_copy_fails_the_whole_load(whole_step_sides, monkeypatch):
    """Copies split over the engine thread and copy threads (big steps): saves and loads are byte-exact;
    a copy that fails fails every block of the step's load (vLLM recomputes them all)."""
    from kvstore.connectors import cpu_copy

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

    from kvstore.connectors.vllm import KVStoreConnector

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
        s._release(s.pins.pending.pop())
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
    meta = run_step(sched, worker, admit(sched, "a", tokens, [1, 2, 3], 0))
    assert len(meta.saves) == 3 and worker.faults.injected_saves == 1
    stats = sched.link.client().stats()
    assert stats["blocks"] == 0 and stats["reserved_blocks"] == 0
    with pytest.raises(ValueError, match="fractions in 0..1"):
        ConnectorConfig.from_extra({"fail_saves": 1.5})


def test_spin_us_reaches_both_sides_clients_and_is_validated(daemon):
    """`spin_us` (how long a call polls for its reply before it sleeps) is what the scheduler's and the
    worker's clients use; 0 (sleep at once) serves the same hit."""
    sched, make_worker = make_sides(daemon, spin_us=0)
    worker, _ = make_worker(5)
    tokens = list(range(3000, 3000 + 3 * BT))
    run_step(sched, worker, admit(sched, "a", tokens, [1, 2, 3], 0))
    assert sched.link.client()._spin_s == 0 and worker.link.client()._spin_s == 0
    req_b = request("b", tokens + [5])
    assert sched.get_num_new_matched_tokens(req_b, 0) == (3 * BT, False)
    assert make_sides(daemon)[0].link.client()._spin_s == SPIN_US / 1e6
    for bad in (-1, True, "100", 1e9):
        with pytest.raises(ValueError, match="spin_us"):
            ConnectorConfig.from_extra({"spin_us": bad})
