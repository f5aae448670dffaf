"""A stand-in engine process: KV tensors on a device, driven through the connector's two sides — the code
vLLM calls — by JSON lines on stdin, one reply line each on stdout. No vLLM is needed (the GPU machines
carry none): requests, block lists and scheduler outputs are the stand-ins of connector_standins.

    python -m tests.kv_engine SOCKET --device cuda:0|cpu --layout LBHNC|BLHNC --seed N

Requests (each answered with {"ok": true, ...} or {"ok": false, "error": ...}):
- {"op": "save", "tokens": [...], "ids": [...]}: a cold prefill of `tokens` into blocks `ids`; its full
  blocks are saved. Reply: "saved" (block ids offered), "sha" (block id -> sha256 of its payload).
- {"op": "load", "tokens": [...], "ids": [...]}: a hit: the scheduler side finds the stored prefix, the
  worker loads it into `ids` (layer by layer where the layout allows). Reply: "hit" (tokens), "invalid"
  (block ids whose load failed), "sha" of every loaded block.
- {"op": "quit"}.
A block's payload is its bytes in every layer, in the tensors' memory order (copy_plan.kv_geometry).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from kvstore.connectors.copy_plan import kv_geometry
from kvstore.connectors.vllm_meta import ConnectorConfig
from kvstore.connectors.vllm_scheduler import SchedulerSide
from kvstore.connectors.vllm_worker import WorkerSide
from kvstore.keys import Namespace
from kvstore.tools.harness.connector_standins import blocks, report_step, request, sched_output

L, H, N, D = 8, 4, 16, 64  # a 16-token block: 8 layers x 4 KV heads x 16 tokens x 2 x 64 x bf16 = 128 KiB
NB = 64


def namespace(device: str, layout: str) -> Namespace:
    return Namespace(model="kv-engine", dtype="bfloat16", num_layers=L, num_kv_heads=H, head_size=D,
                     block_tokens=N, block_bytes=L * H * N * 2 * D * 2, layout=f"{device.split(':')[0]}/{layout}")


def kv_tensors(device: str, layout: str, seed: int) -> dict:
    """Per-layer [blocks, heads, tokens, 2 * head] views over one allocation, as vLLM 0.32 builds them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (NB, L, H, N, 2 * D) if layout == "BLHNC" else (L, NB, H, N, 2 * D)
    raw = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
    views = [raw[:, i] for i in range(L)] if layout == "BLHNC" else [raw[i] for i in range(L)]
    return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


class Engine:
    def __init__(self, socket: str, device: str, layout: str, seed: int, layer_loads: bool = True) -> None:
        import torch

        self.torch, self.device = torch, device
        ns = namespace(device, layout)
        self.cfg = ConnectorConfig(socket=socket, retry_s=0.2, layer_loads=layer_loads, attention_scores=False)
        self.kv = kv_tensors(device, layout, seed)
        self.layers = list(self.kv)
        self.sched = SchedulerSide(self.cfg, [ns], N, device=device.split(":")[0])
        self.worker = WorkerSide(self.cfg, ns, self.layers, NB)
        self.worker.register_kv_caches(self.kv)
        if self.worker.engine is None:
            raise SystemExit("the worker side disabled itself (see its log)")
        self.geom = kv_geometry(list(self.kv.values()), NB)
        self._n = 0

    def step(self, req_id: str, so):
        meta = self.sched.build_connector_meta(so)
        self.worker.start_load_kv(meta)
        for name in self.layers:  # the forward reaches each attention layer in order
            self.worker.wait_for_layer_load(name)
        if self.device != "cpu":
            self.torch.cuda.current_stream().synchronize()  # the forward "reads" the loaded KV
        invalid = report_step(self.sched, self.worker, meta)
        self.worker.get_finished()
        return meta, invalid

    def save(self, tokens: list[int], ids: list[int]) -> dict:
        self._n += 1
        req = request(f"save{self._n}", tokens)
        self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, blocks(ids), 0)
        meta, _ = self.step(req.request_id, sched_output(new=[(req.request_id, ids, 0)],
                                                        scheduled={req.request_id: len(tokens)}))
        self.worker.saves.commit_done(block=True)
        return {"saved": list(meta.saves.block_ids), "sha": self.sha(meta.saves.block_ids)}

    def load(self, tokens: list[int], ids: list[int]) -> dict:
        self._n += 1
        req = request(f"load{self._n}", tokens)
        hit, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, blocks(ids), hit or 0)
        meta, invalid = self.step(req.request_id, sched_output(new=[(req.request_id, ids, hit or 0)],
                                                              scheduled={req.request_id: len(tokens) - (hit or 0)}))
        self.sched.request_finished(req)
        loaded = ids[: (hit or 0) // N]
        return {"hit": hit or 0, "invalid": sorted(invalid), "sha": self.sha(loaded)}

    def sha(self, ids) -> dict:
        """block id -> sha256 of the block's payload bytes (its pieces, in payload order)."""
        torch = self.torch
        first = next(iter(self.kv.values()))
        storage = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
        base = first.untyped_storage().data_ptr()
        g = self.geom
        out = {}
        for b in ids:
            parts = [storage[int(a) + b * int(st) - base:][: int(n)] for a, st, n in zip(g.addr0, g.stride, g.size)]
            out[str(b)] = hashlib.sha256(torch.cat(parts).cpu().numpy().tobytes()).hexdigest()
        return out

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("socket")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layout", choices=["LBHNC", "BLHNC"], default="LBHNC")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--whole-step", action="store_true", help="loads copied whole before the forward")
    args = p.parse_args(argv)
    engine = Engine(args.socket, args.device, args.layout, args.seed, layer_loads=not args.whole_step)
    print(json.dumps({"ok": True, "ready": True, "block_outermost": engine.geom.block_outermost}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                break
            reply = {"ok": True, **getattr(engine, req["op"])(req["tokens"], req["ids"])}
        except Exception as exc:  # the test reads the error
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
