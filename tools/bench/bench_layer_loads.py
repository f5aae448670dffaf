"""Benchmark: what a step's load costs the forward, copied whole before it or layer by layer beside it.

The vLLM connector's worker side (`connectors/vllm_worker.py`) against a daemon
in its own process, without an engine: the KV tensors are shaped like
SmolLM2-135M's on vLLM's CPU backend (30 layers, 3 KV heads, head size 64,
bf16, 128-token blocks: 2.95 MB a block) and laid out as vLLM 0.32 allocates
them (one buffer, a view per layer). Engine A's worker stores a prompt's blocks;
engine B's worker then loads them in one step whose forward is a stand-in: per
layer, `wait_for_layer_load` (as vLLM's attention does) and then
torch work on this thread that takes `--per-layer-ms` alone (a fixed number of
rounds of a 256x256 matmul between small element-wise ops, as an eager model's
Python-driven forward issues them; each op takes and releases the GIL, so a copy
thread's GIL hand-overs and its share of the core cost the forward what they
cost a real engine's).

For each per-layer time, median of the repeats:

* forward alone: the stand-in forward with no load;
* whole-step (`layer_loads` off): the copy runs in `start_load_kv`, before the forward;
* layer-wise (the default): a helper thread copies layer by layer while the forward runs.

"exposed" = a step's time (load start to the step's end) minus the forward
alone: what the load adds to the step, which is what it adds to a hit's TTFT.
Every repeat checks that the loaded blocks hold engine A's bytes. The stand-in
forward is what makes this measurable on any machine: in a real engine on these
2-core VMs the copy is 1-3 % of a hit's TTFT and drowns in its noise
(docs/benchmarks.md, "vLLM connector").

    python tools/bench/bench_layer_loads.py [--tokens 8000] [--per-layer-ms 0.5,2,8] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvstore.connectors.vllm_meta import ConnectorConfig  # noqa: E402
from kvstore.connectors.vllm_scheduler import SchedulerSide  # noqa: E402
from kvstore.connectors.vllm_worker import WorkerSide  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tools.harness.connector_standins import blocks, report_step, request, sched_output  # noqa: E402
from kvstore.tools.harness.vllm_helpers import start_daemon  # noqa: E402

BLOCK_TOKENS, KV_HEADS, HEAD_SIZE, LAYERS = 128, 3, 64, 30  # SmolLM2-135M
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TAIL = 64  # tokens the hit step computes after the loaded prefix


def namespace() -> Namespace:
    return Namespace(model="bench-layer-loads", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=KV_HEADS,
                     head_size=HEAD_SIZE, block_tokens=BLOCK_TOKENS,
                     block_bytes=LAYERS * KV_HEADS * BLOCK_TOKENS * 2 * HEAD_SIZE * 2)


def kv_tensors(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """One buffer, a `[num_blocks, heads, block_tokens, 2 * head_size]` view per layer (vLLM 0.32's CPU layout)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, num_blocks, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16)
    return {name: buf[i] for i, name in enumerate(LAYER_NAMES)}


class StandInForward:
    """Per layer: wait for its load, then a fixed number of rounds of a 256x256 matmul between small
    element-wise ops (an eager forward's mix of one big op and many Python-issued small ones) on this
    thread. The number of rounds is calibrated once so that a layer takes `per_layer_ms` alone: a copy
    thread that takes the GIL or the core's share from the forward makes the step longer, as it would
    a real engine's."""

    def __init__(self, per_layer_ms: float) -> None:
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.x = torch.randn(16, 64)
        self.rounds = 0
        if per_layer_ms > 0:
            probe = 200
            best = min(self._timed(probe) for _ in range(5))
            self.rounds = max(1, round(per_layer_ms / 1e3 / (best / probe)))

    def _timed(self, rounds: int) -> float:
        t0 = time.perf_counter()
        self._work(rounds)
        return time.perf_counter() - t0

    def _work(self, rounds: int) -> None:
        for _ in range(rounds):
            torch.mm(self.a, self.b)
            x = self.x
            for _ in range(8):
                x = (x * 0.5 + 1.0).relu_()

    def __call__(self, worker: WorkerSide | None) -> None:
        for name in LAYER_NAMES:
            if worker is not None:
                worker.wait_for_layer_load(name)
            self._work(self.rounds)


def store_prompt(cfg: ConnectorConfig, ns: Namespace, tokens: list[int], num_full: int,
                 num_blocks: int) -> dict[str, torch.Tensor]:
    """Engine A computes and stores the prompt's full blocks: its KV tensors."""
    sched, worker = SchedulerSide(cfg, [ns], BLOCK_TOKENS), WorkerSide(cfg, ns, LAYER_NAMES, num_blocks)
    kv = kv_tensors(num_blocks, seed=1)
    worker.register_kv_caches(kv)
    req = request("stored", tokens)
    sched.get_num_new_matched_tokens(req, 0)
    ids = list(range(num_full + 1))
    sched.update_state_after_alloc(req, blocks(ids), 0)
    meta = sched.build_connector_meta(sched_output(new=[("stored", ids, 0)], scheduled={"stored": len(tokens)}))
    worker.start_load_kv(meta)
    report_step(sched, worker, meta)
    worker.shutdown()
    return kv


def hit_step(cfg: ConnectorConfig, ns: Namespace, worker: WorkerSide, forward: StandInForward, tokens: list[int],
             num_full: int, req_id: str) -> float:
    """Engine B's step that loads the stored prefix into blocks [1, num_full] and runs the forward: its seconds
    from the load's start to the step's end."""
    sched = SchedulerSide(cfg, [ns], BLOCK_TOKENS)
    req = request(req_id, tokens[: num_full * BLOCK_TOKENS] + [7] * TAIL)
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    if num != num_full * BLOCK_TOKENS:
        raise SystemExit(f"the store offered {num} tokens of {num_full * BLOCK_TOKENS}")
    ids = list(range(1, num_full + 2))  # other ids than engine A's, so a missed copy shows
    sched.update_state_after_alloc(req, blocks(ids), num)
    meta = sched.build_connector_meta(sched_output(new=[(req_id, ids, num)], scheduled={req_id: TAIL}))
    t0 = time.perf_counter()
    worker.start_load_kv(meta)
    forward(worker)
    invalid = report_step(sched, worker, meta)
    elapsed = time.perf_counter() - t0
    if invalid:
        raise SystemExit(f"{len(invalid)} blocks failed to load")
    return elapsed


def bench(socket_path: str, tokens_n: int, per_layer_ms: list[float], repeats: int) -> dict:
    ns = namespace()
    num_full = (tokens_n - 1) // BLOCK_TOKENS
    num_blocks = num_full + 2
    tokens = list(range(1000, 1000 + tokens_n))
    base = dict(socket=socket_path, retry_s=0.0, attention_scores=False)
    kv_a = store_prompt(ConnectorConfig(**base), ns, tokens, num_full, num_blocks)
    out = {"tokens": tokens_n, "blocks": num_full, "block_bytes": ns.block_bytes,
           "load_mb": num_full * ns.block_bytes / 1e6, "repeats": repeats, "runs": []}
    for ms in per_layer_ms:
        forward = StandInForward(ms)
        alone = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(None)
            alone.append(time.perf_counter() - t0)
        row = {"per_layer_ms": ms, "forward_rounds": forward.rounds, "forward_alone_ms": statistics.median(alone) * 1e3}
        for arm, layer_loads in (("whole_step", False), ("layer_wise", True)):
            cfg = ConnectorConfig(**base, layer_loads=layer_loads)
            worker = WorkerSide(cfg, ns, LAYER_NAMES, num_blocks)
            kv_b = kv_tensors(num_blocks, seed=2)
            worker.register_kv_caches(kv_b)
            steps = [hit_step(cfg, ns, worker, forward, tokens, num_full, f"{arm}-{ms}-{i}") for i in range(repeats)]
            worker.shutdown()
            for name in LAYER_NAMES:
                if not torch.equal(kv_b[name][1 : num_full + 1], kv_a[name][0:num_full]):
                    raise SystemExit(f"{arm}: layer {name} does not hold the stored bytes")
            step_ms = statistics.median(steps) * 1e3
            row[f"{arm}_step_ms"] = step_ms
            row[f"{arm}_exposed_ms"] = step_ms - row["forward_alone_ms"]
            row[f"all_{arm}_step_ms"] = [s * 1e3 for s in steps]
        row["layer_wise_vs_whole_step_exposed"] = row["layer_wise_exposed_ms"] / max(row["whole_step_exposed_ms"], 1e-9)
        out["runs"].append(row)
    return out


def table(r: dict) -> str:
    lines = [f"{r['tokens']} tokens: {r['blocks']} blocks x {r['block_bytes'] / 1e6:.2f} MB = {r['load_mb']:.0f} MB "
             f"loaded per step, median of {r['repeats']}",
             "| per-layer forward | forward alone | whole-step step | exposed | layer-wise step | exposed | "
             "layer-wise / whole-step exposed |", "|---|---|---|---|---|---|---|"]
    for row in r["runs"]:
        lines.append(f"| {row['per_layer_ms']} ms | {row['forward_alone_ms']:.1f} ms | {row['whole_step_step_ms']:.1f} ms"
                     f" | {row['whole_step_exposed_ms']:.1f} ms | {row['layer_wise_step_ms']:.1f} ms"
                     f" | {row['layer_wise_exposed_ms']:.1f} ms | {row['layer_wise_vs_whole_step_exposed']:.2f} |")
    return "\n".join(lines)


def per_layer_times(text: str) -> list[float]:
    """`--per-layer-ms`: comma-separated milliseconds, each >= 0."""
    try:
        times = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of milliseconds: {text!r}") from None
    if not times or any(t < 0 for t in times):
        raise argparse.ArgumentTypeError(f"one or more times >= 0 ms, comma-separated: {text!r}")
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8000, help="prompt length; floor((tokens-1)/128) blocks load")
    p.add_argument("--per-layer-ms", type=per_layer_times, default="0.5,2,8", help="the stand-in forward's time per layer, comma-separated")
    p.add_argument("--repeats", type=int, default=7, help="steps per arm and per-layer time (medians reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (the engine's OMP threads)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.tokens <= BLOCK_TOKENS or args.repeats < 1:
        p.error("--tokens must exceed one block (128) and --repeats be at least 1")
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench-layer-loads-")
    host_bytes = f"{(args.tokens // BLOCK_TOKENS + 8) * 3 + 64}MiB"  # the prompt's blocks with room to spare
    daemon = start_daemon(workdir, host_bytes=host_bytes)
    try:
        results = bench(daemon.socket_path, args.tokens, args.per_layer_ms, args.repeats)
    finally:
        daemon.stop()
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
