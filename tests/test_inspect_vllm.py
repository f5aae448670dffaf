"""`kvstore inspect` against a daemon filled by a real vLLM engine through the connector.

One engine (SmolLM2, block size 32) serves text prompt P, then text prompt R;
the host tier holds about 10 blocks, so R's saves push P's tail down to the
disk tier. Then `kvstore inspect --model <the model> --text P` must:
tokenize P exactly as the engine did; give the hashes the connector's own
scheduler code computes for the engine's token ids; and show, per block, the
tier the daemon's own listing shows. A prompt that shares P's first 3 blocks
shows exactly 3 cached. The daemon publishes KV events meanwhile: each block
the connector stored arrives with its token ids (sent by the connector).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvstore.tools.harness.vllm_helpers import REPO, build_model, connector_config, corpus_text, engine_spec, run_engine, start_daemon
from kvstore.tools.harness.vllm_helpers import vllm_available

ok, why = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

BS = 32


def inspect(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "inspect", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def connector_hashes(token_ids: list[int]) -> list[bytes]:
    """The hashes the connector's scheduler side computes for a request with these tokens."""
    from kvstore.connectors.vllm_scheduler import _ReqState, request_extra_keys

    request = SimpleNamespace(request_id="r", all_token_ids=token_ids, prompt_embeds=None, lora_request=None,
                              mm_features=None, cache_salt=None)
    return _ReqState(request, request_extra_keys(request)).hashes_upto(len(token_ids) // BS, BS)


def test_inspect_matches_what_the_connector_stored(tmp_path):
    import zmq

    workdir = str(tmp_path)
    model = build_model("smollm2")
    p_text, r_text = corpus_text(1300, offset=0), corpus_text(1300, offset=6000)
    daemon = start_daemon(workdir, host_bytes="8MiB", disk_bytes="256MiB",
                          extra=("--events-endpoint", "tcp://127.0.0.1:0"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events_endpoint)
    try:
        time.sleep(0.3)
        spec = engine_spec(model, [{"prompts": [{"text": p_text}], "max_tokens": 2},
                                   {"prompts": [{"text": r_text}], "max_tokens": 2}],
                           dtype="bfloat16", block_size=BS, kv_cache_memory_bytes=256 << 20, max_model_len=2048,
                           kv_transfer_config=connector_config(daemon.socket_path))
        engine = run_engine(spec, workdir)
        p_ids = engine.outputs(0)[0]["prompt_token_ids"]
        r_ids = engine.outputs(1)[0]["prompt_token_ids"]
        num_blocks = len(p_ids) // BS
        assert num_blocks >= 6

        r = inspect("--socket", daemon.socket_path, "--model", model, "--text", p_text, "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["num_tokens"] == len(p_ids)  # tokenized as the engine tokenized it
        hashes = [bytes.fromhex(b["hash"]) for b in report["blocks"]]
        assert hashes == connector_hashes(p_ids)  # the connector's own scheduler code path
        with daemon.client() as c:
            rows, _ = c.list_blocks(report["namespace"], limit=10_000)
        listed = {h: tier for _, h, tier, _, _, committed, _ in rows if committed}
        assert [b["tier"] for b in report["blocks"]] == [listed[h] for h in hashes]
        assert {"host", "disk"} <= set(listed[h] for h in hashes), "R's saves should have pushed P's tail to disk"
        assert report["cached_blocks"] == report["total_blocks"] == num_blocks
        assert report["cached_tokens"] == num_blocks * BS
        assert report["tiers"] == {t: [listed[h] for h in hashes].count(t) for t in ("host", "disk")
                                   if t in listed.values() and [listed[h] for h in hashes].count(t)}

        q_ids = p_ids[: 3 * BS] + r_ids[100:200]  # shares exactly P's first 3 blocks
        r = inspect("--socket", daemon.socket_path, "--model", model, "--tokens", json.dumps(q_ids), "--json")
        assert r.returncode == 0, r.stderr
        q = json.loads(r.stdout)
        assert q["cached_blocks"] == 3 and q["cached_tokens"] == 3 * BS
        assert [b["tier"] for b in q["blocks"]][3:] == ["missing"] * (len(q_ids) // BS - 3)

        r = inspect("--socket", daemon.socket_path, "--model", model, "--text", p_text)  # the table
        assert r.returncode == 0, r.stderr
        assert f"first {num_blocks} of {num_blocks} blocks cached" in r.stdout and "tokens would be reused" in r.stdout

        tokens_of: dict[bytes, list[int]] = {}  # what the connector sent, as KV events carried it
        while sub.poll(500):
            _, _, payload = sub.recv_multipart()
            from vllm.distributed.kv_events import BlockStored, KVEventBatch
            import msgspec

            for ev in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
                if isinstance(ev, BlockStored) and ev.medium == "CPU":
                    for i, h in enumerate(ev.block_hashes):
                        tokens_of[h] = ev.token_ids[i * BS:(i + 1) * BS]
        assert all(tokens_of[h] == p_ids[i * BS:(i + 1) * BS] for i, h in enumerate(hashes))

        for args, why in [(("--model", os.path.join(workdir, "no-model"), "--text", "hi"), "cannot load the tokenizer"),
                          (("--model-name", "no-such-model", "--tokens", "[1, 2]"), "no namespace for model"),
                          (("--model", model, "--tokens", "[1, 2,"), "is not JSON")]:
            r = inspect("--socket", daemon.socket_path, *args)
            assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        sub.close(linger=0)
        daemon.stop()
