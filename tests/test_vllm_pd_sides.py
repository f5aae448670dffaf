"""Prefill/decode roles and waiting loads, on the connector's sides with stand-in vLLM objects and a
real daemon (fast: no engine). The engines themselves are in tests/test_vllm_pd.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvstore.connectors.vllm_meta import ConnectorConfig  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.tools.harness.connector_standins import blocks, sched_output  # noqa: E402
from tests.connector_sides import BT, LAYERS, NB, kv_tensors, namespace, run_step  # noqa: E402

TOKENS = list(range(5000, 5000 + 5 * BT + 7))  # 5 full blocks + 7 tokens
PRODUCER_IDS = [3, 4, 5, 6, 7, 8]
CONSUMER_IDS = [9, 10, 11, 12, 13, 14]


def request(req_id: str, tokens: list[int], wait: bool = False):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens),
                           num_prompt_tokens=len(tokens), prompt_embeds=None, lora_request=None, cache_salt=None,
                           mm_features=[], kv_transfer_params={"kvstore_wait": True} if wait else None)


class Engine:
    def __init__(self, socket: str, role: str, seed: int, **extra) -> None:
        self.config = ConnectorConfig(socket=socket, retry_s=0.0, **extra).for_role(role)
        self.sched = SchedulerSide(self.config, [namespace()], BT)
        self.worker = WorkerSide(self.config, namespace(), LAYERS, NB)
        self.kv = kv_tensors(seed)
        self.worker.register_kv_caches(self.kv)

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


def producer_schedules(p: Engine):
    req = request("p", TOKENS)
    assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer never loads
    p.sched.update_state_after_alloc(req, blocks(PRODUCER_IDS), 0)
    meta = p.sched.build_connector_meta(sched_output(new=[("p", PRODUCER_IDS, 0)], scheduled={"p": len(TOKENS)}))
    return req, meta


def finished(worker: WorkerSide, req_id: str, timeout_s: float = 10.0) -> tuple[float, set[int]]:
    """Poll get_finished as the engine does each step; (seconds until reported, failed block ids)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        _, done = worker.get_finished()
        if done and req_id in done:
            return time.monotonic() - t0, worker.get_block_ids_with_load_errors()
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never reported finished")


def consumer_admits(c: Engine, wait: bool = False):
    req = request("c", TOKENS, wait=wait)
    num, is_async = c.sched.get_num_new_matched_tokens(req, 0)
    if num:
        c.sched.update_state_after_alloc(req, blocks(CONSUMER_IDS), num)
    meta = c.sched.build_connector_meta(sched_output(new=[("c", CONSUMER_IDS, num)], scheduled={}))
    c.worker.start_load_kv(meta)
    return num, is_async, meta


def test_roles_a_producer_never_loads_a_consumer_never_saves(daemon):
    both = Engine(daemon.socket_path, "kv_both", 1)
    req = request("a", TOKENS)
    both.sched.get_num_new_matched_tokens(req, 0)
    both.sched.update_state_after_alloc(req, blocks(PRODUCER_IDS), 0)
    run_step(both.sched, both.worker, sched_output(new=[("a", PRODUCER_IDS, 0)], scheduled={"a": len(TOKENS)}))
    producer = Engine(daemon.socket_path, "kv_producer", 2)
    assert producer.sched.get_num_new_matched_tokens(request("b", TOKENS), 0) == (0, False)
    consumer = Engine(daemon.socket_path, "kv_consumer", 3)
    other = TOKENS[:BT] + [1] * (3 * BT)
    req_c = request("c", other)
    assert consumer.sched.get_num_new_matched_tokens(req_c, 0) == (BT, False)
    consumer.sched.update_state_after_alloc(req_c, blocks([0, 1, 2, 3]), BT)
    meta = run_step(consumer.sched, consumer.worker, sched_output(new=[("c", [0, 1, 2, 3], BT)], scheduled={"c": 3 * BT}))
    assert len(meta.saves) == 0 and meta.loads
    assert ConnectorConfig(announce=None).for_role("kv_producer").announce
    assert not ConnectorConfig().for_role("kv_both").announce
    with pytest.raises(ValueError):
        ConnectorConfig().for_role("kv_sideways")
    for e in (both, producer, consumer):
        e.close()
    assert daemon.check() == []


def test_a_consumer_waits_for_announced_blocks_and_loads_the_committed_bytes(daemon):
    p = Engine(daemon.socket_path, "kv_producer", 1)
    c = Engine(daemon.socket_path, "kv_consumer", 2)
    req_p, meta_p = producer_schedules(p)  # announced, not yet computed
    num, is_async, _ = consumer_admits(c)
    assert (num, is_async) == (5 * BT, True)  # all five in flight: an async load
    time.sleep(0.3)
    assert not c.worker.get_finished()[1], "finished before the producer committed"
    p.worker.start_load_kv(meta_p)
    p.worker.wait_for_save(meta_p)  # reserve, copy, commit
    elapsed, failed = finished(c.worker, "c")
    assert failed == set()
    for name in LAYERS:
        assert torch.equal(c.kv[name][9:14], p.kv[name][3:8])
    p.sched.request_finished(req_p)
    assert c.worker.wait_stats["blocks_waited"] == 5
    p.close(), c.close()
    assert daemon.check() == []


def test_the_wait_ends_when_the_producer_dies_and_the_blocks_are_recomputed(daemon):
    p = Engine(daemon.socket_path, "kv_producer", 1)
    c = Engine(daemon.socket_path, "kv_consumer", 2, wait_s=30.0)
    producer_schedules(p)
    num, is_async, _ = consumer_admits(c)
    assert (num, is_async) == (5 * BT, True)
    time.sleep(0.2)
    p.close()  # killed mid-prefill: its connections (and announcements) go
    elapsed, failed = finished(c.worker, "c")
    assert failed == set(CONSUMER_IDS[:5]) and elapsed < 5  # at the lease, not the 30 s timeout
    c.close()
    assert daemon.check() == []


def test_wait_disabled_claims_only_committed_blocks(daemon):
    p = Engine(daemon.socket_path, "kv_producer", 1)
    c = Engine(daemon.socket_path, "kv_consumer", 2, wait_s=0.0)
    producer_schedules(p)
    num, is_async, meta = consumer_admits(c, wait=True)
    assert (num, is_async) == (0, False) and not meta.loads  # negative control: vLLM computes the prompt
    p.close(), c.close()


def test_a_proxied_request_waits_for_blocks_not_yet_announced(daemon):
    c = Engine(daemon.socket_path, "kv_consumer", 2, wait_s=20.0)
    num, is_async, _ = consumer_admits(c, wait=True)  # asks before the producer even scheduled it
    assert (num, is_async) == (5 * BT, True)
    time.sleep(0.2)
    p = Engine(daemon.socket_path, "kv_producer", 1)
    _, meta_p = producer_schedules(p)
    p.worker.wait_for_save(meta_p)
    elapsed, failed = finished(c.worker, "c")
    assert failed == set()
    for name in LAYERS:
        assert torch.equal(c.kv[name][9:14], p.kv[name][3:8])
    p.close(), c.close()
    assert daemon.check() == []


def test_a_proxied_request_whose_blocks_never_come_times_out_and_recomputes(daemon):
    c = Engine(daemon.socket_path, "kv_consumer", 2, wait_s=0.5)
    num, is_async, _ = consumer_admits(c, wait=True)
    assert (num, is_async) == (5 * BT, True)
    elapsed, failed = finished(c.worker, "c")
    assert failed == set(CONSUMER_IDS[:5]) and 0.4 < elapsed < 5
    c.close()


def test_a_request_whose_wait_failed_is_not_made_to_wait_again(daemon):
    """vLLM reschedules a request whose async load failed and asks again: it must not wait again."""
    c = Engine(daemon.socket_path, "kv_consumer", 2, wait_s=0.3)
    req = request("c", TOKENS, wait=True)
    num, is_async = c.sched.get_num_new_matched_tokens(req, 0)
    assert (num, is_async) == (5 * BT, True)
    c.sched.update_state_after_alloc(req, blocks(CONSUMER_IDS), num)
    c.worker.start_load_kv(c.sched.build_connector_meta(sched_output(new=[("c", CONSUMER_IDS, num)], scheduled={})))
    _, failed = finished(c.worker, "c")
    assert failed == set(CONSUMER_IDS[:5])
    assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # rescheduled: recompute now
    c.close()
