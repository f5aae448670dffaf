"""The connector sends token ids with its commits only where KV events need them.

Scheduler and worker sides with stand-in vLLM objects (no engine) against real
daemons: with `[events]` on, a plain request's saved blocks carry their token
ids and the daemon publishes them; a salted request's blocks carry none (a
router keying blocks by tokens must not match them); with events off nothing is sent.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from kvstore.connectors.vllm_meta import ConnectorConfig  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.server.event_wire import decode_batch  # noqa: E402
from kvstore.tools.harness.connector_standins import blocks, request, sched_output  # noqa: E402
from tests.connector_sides import BT, LAYERS, NB, kv_tensors, namespace, run_step  # noqa: E402


def save(daemon, req_id: str, tokens: list[int], salt: str | None, block_ids: list[int]):
    cfg = ConnectorConfig(socket=daemon.socket_path, retry_s=0.0)
    sched = SchedulerSide(cfg, [namespace()], BT)
    worker = WorkerSide(cfg, namespace(), LAYERS, NB)
    worker.register_kv_caches(kv_tensors(7))
    req = request(req_id, tokens, salt=salt)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks(block_ids), 0)
    meta = run_step(sched, worker, sched_output(new=[(req_id, block_ids, 0)], scheduled={req_id: len(tokens)}))
    sched.shutdown()
    worker.shutdown()
    return meta


def test_tokens_go_with_commits_only_when_the_daemon_publishes_them(daemon_factory):
    on = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0", "--events-replay-endpoint", "tcp://127.0.0.1:0")
    plain = list(range(500, 500 + 3 * BT + 5))
    meta = save(on, "p", plain, None, [0, 1, 2, 3])
    assert meta.saves.tokens == [np.asarray(plain[i * BT:(i + 1) * BT], "<u4").tobytes() for i in range(3)]
    meta = save(on, "s", plain, "tenant-a", [4, 5, 6, 7])
    assert len(meta.saves.hashes) == 3 and meta.saves.tokens == [None] * 3
    time.sleep(0.3)
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(on.events_replay)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    stored = []
    while True:
        assert req.poll(5000)
        _, _, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        stored += [e for e in decode_batch(payload)["events"] if e["type"] == "BlockStored"]
    req.close(linger=0)
    assert [e["token_ids"] for e in stored] == [plain[: 3 * BT], []]  # the plain chain's, then the salted one's
    off = daemon_factory()
    assert save(off, "q", plain, None, [0, 1, 2, 3]).saves.tokens == [None] * 3
