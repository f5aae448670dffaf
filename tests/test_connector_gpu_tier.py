"""The connector's worker side over the daemon's GPU tier, on the emulated device (pools in shared memory,
which a CPU engine maps the way a CUDA engine maps the real pools by IPC): saves go into the GPU pools
while they have free pages, loads read each block where it sits, the demoter's moves change nothing a
loader sees, and the same code runs with the GPU tier absent."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvstore.connectors.vllm_meta import ConnectorConfig  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.connector_sides import run_step  # noqa: E402
from kvstore.tools.harness.connector_standins import blocks, request, sched_output  # noqa: E402

BT, NB, H, D, L = 32, 24, 2, 16, 4  # one block = 4 layers x 2 heads x 32 tokens x 32 x 4 B = 32 KiB
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
BLOCK = L * H * BT * 2 * D * 4
GPU = ["--gpu-device", "cpu", "--gpu-devices", "0,1", "--gpu-bytes", str(6 * BLOCK), "--gpu-page-bytes", str(BLOCK)]


def namespace() -> Namespace:
    return Namespace(model="gpu-tier-unit", dtype="float32", num_layers=L, num_kv_heads=H, head_size=D,
                     block_tokens=BT, block_bytes=BLOCK)


def kv_tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(L, NB, H, BT, 2 * D, generator=g)  # vLLM 0.32's one buffer, a view per layer
    return {name: raw[i] for i, name in enumerate(LAYERS)}


def step(sched, worker, so):
    return run_step(sched, worker, so, forward=LAYERS)


def store_prompt(cfg, tokens, seed):
    sched, worker = SchedulerSide(cfg, [namespace()], BT), WorkerSide(cfg, namespace(), LAYERS, NB)
    kv = kv_tensors(seed)
    worker.register_kv_caches(kv)
    req = request(f"src{seed}", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    ids = list(range(len(tokens) // BT + 1))
    sched.update_state_after_alloc(req, blocks(ids), 0)
    step(sched, worker, sched_output(new=[(req.request_id, ids, 0)], scheduled={req.request_id: len(tokens)}))
    worker.shutdown()
    return kv


def load_prompt(cfg, tokens, n_blocks, req_id, seed):
    """A fresh engine loads the stored prefix into blocks [NB - n_blocks - 1, ...): its KV and the step."""
    sched, worker = SchedulerSide(cfg, [namespace()], BT), WorkerSide(cfg, namespace(), LAYERS, NB)
    kv = kv_tensors(seed)
    worker.register_kv_caches(kv)
    req = request(req_id, tokens[: n_blocks * BT] + [3] * 5)
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    assert num == n_blocks * BT
    ids = list(range(NB - n_blocks - 1, NB))
    sched.update_state_after_alloc(req, blocks(ids), num)
    meta = step(sched, worker, sched_output(new=[(req_id, ids, num)], scheduled={req_id: 5}))
    worker.shutdown()
    return kv, meta, ids


def test_saves_fill_the_gpu_pools_and_loads_read_every_block_where_it_sits(daemon_factory):
    d = daemon_factory(*GPU)
    cfg = ConnectorConfig(socket=d.socket_path, retry_s=0.0)
    tokens = list(range(5000, 5000 + 11 * BT + 7))  # 11 full blocks; the GPU tier holds 12
    kv_a = store_prompt(cfg, tokens, seed=1)
    assert d.stats()["counters"]["put_gpu_blocks"] == 11
    # 1 of 12 pages free is under the demoter's 10%: it moves the coldest leaves to the arena
    assert wait_for(lambda: d.stats()["tiers"]["host"]["blocks"] >= 2, timeout_s=10)
    assert d.stats()["counters"]["gpu_demotions"] >= 2
    kv_b, meta, ids = load_prompt(cfg, tokens, 11, "b", seed=2)
    assert meta.invalid == set()
    for name in LAYERS:
        bad = [i for i in range(11) if not torch.equal(kv_b[name][ids[i]], kv_a[name][i])]
        assert not bad, (name, bad)
    assert d.stats()["pinned_blocks"] == 0
    assert d.check() == []


def test_without_a_gpu_tier_the_same_engine_uses_the_arena(daemon_factory):
    d = daemon_factory()
    cfg = ConnectorConfig(socket=d.socket_path, retry_s=0.0)
    tokens = list(range(9000, 9000 + 4 * BT + 1))
    kv_a = store_prompt(cfg, tokens, seed=3)
    assert "put_gpu_blocks" not in d.stats()["counters"] and d.stats()["tiers"]["host"]["blocks"] == 4
    kv_b, meta, ids = load_prompt(cfg, tokens, 4, "c", seed=4)
    assert meta.invalid == set()
    for name in LAYERS:
        assert torch.equal(kv_b[name][ids[:4]], kv_a[name][0:4])
