"""The connector's two sides against a real daemon, with stand-in vLLM objects: the shapes, KV tensors
and steps the sides tests share (tests/test_vllm_connector_sides.py, test_vllm_connector_load_errors.py,
test_vllm_pd_sides.py, test_connector_tokens.py, test_connector_gpu_tier.py). Import it after
`pytest.importorskip("vllm")` and `("torch")`."""

from __future__ import annotations

import pytest
import torch

from kvstore.connectors.vllm_meta import ConnectorConfig, StepMeta
from kvstore.connectors.vllm_scheduler import SchedulerSide
from kvstore.connectors.vllm_worker import WorkerSide
from kvstore.keys import Namespace
from kvstore.tools.harness.connector_standins import blocks, report_step, request, sched_output

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


def admit(sched: SchedulerSide, req_id: str, tokens: list[int], ids: list[int], num_computed: int):
    """A new request admitted with no external hit; the step's scheduler output."""
    sched.get_num_new_matched_tokens(request(req_id, tokens), num_computed)
    sched.update_state_after_alloc(request(req_id, tokens), blocks(ids), 0)
    return sched_output(new=[(req_id, ids, num_computed)], scheduled={req_id: len(tokens) - num_computed})
