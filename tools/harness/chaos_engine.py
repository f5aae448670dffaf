"""One vLLM engine of a chaos run, driven step by step in this process (tools/bench/chaos_run.py starts it).

    python tools/harness/chaos_engine.py SPEC.json

The engine is `vllm.LLM` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), driven
through its `LLMEngine`: requests are added at their arrival step, aborted
between steps at the moment their abort names (tools/bench/chaos_workload.py,
judged from the scheduler's view of the request), and stepped until none is
left. With `serial` every request is served alone, one after the other (the
baselines and the store-bytes reference). SPEC keys: `engine` (LLM keyword
arguments: model, dtype, block_size, kv_cache_memory_bytes, max_model_len,
max_num_batched_tokens, max_num_seqs, enable_prefix_caching,
kv_transfer_config, speculative_config), `requests` (ChaosRequest dicts),
`warmup` (requests served as a burst before the run, which starts after them),
`serial`, `plant` (names of planted bugs, tools/harness/chaos_plants.py, for the
oracles' own tests), `out` (the result JSON; `<out>.kv.npz` holds the KV of
requests marked `capture`: each full block's payload as the connector stores it,
copied out of the engine's paged cache once the prompt is computed), `progress` (rewritten every
PROGRESS_S: finished requests and steps), `hold` (after the last request the
engine writes `<hold>.idle` and waits until `<hold>` exists: the controller
checks the daemon while this engine's connections are still open, so a leaked
pin or reservation is still there to be seen).

The result: per request its outcome (finished: token ids, prompt logprobs of the
prompt tokens, num_cached_tokens; aborted: the moment and the scheduler state it
was aborted in), a timeline (wall time, steps, the connector's loaded blocks,
vLLM's external hit tokens and preemptions), and the counters at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PROGRESS_S = 0.5
TIMELINE_STEPS = 5  # a timeline point every this many steps
MAX_STEPS = 200_000
STALL_STEPS, STALL_S = 3000, 30.0  # no request moved in this many steps and seconds: the engine is stuck
IDLE_STEP_S = 0.005  # between steps with only finished requests left (their blocks wait for the connector)


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(value)
    return out


def connector_stats() -> dict:
    """The in-process connector's scheduler and worker counters (empty without a connector)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return {}
    if not has_kv_transfer_group():
        return {}
    worker = getattr(get_kv_transfer_group(), "worker", None)
    if worker is None:
        return {}
    report = getattr(worker, "report", None)  # (a hybrid model's worker side counts its loads itself)
    if report is None:
        stats = dict(worker.stats)
    else:
        with report.lock:
            stats = dict(report.stats)
    return {"injected_load_failures": worker.faults.injected, "injected_save_failures": worker.faults.injected_saves,
            **{f"worker_{k}": v for k, v in stats.items()}}


class Driver:
    def __init__(self, llm, spec: dict) -> None:
        from vllm.v1.request import RequestStatus

        self.llm, self.spec, self.Status = llm, spec, RequestStatus
        self.engine = llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.connector = getattr(self.scheduler, "connector", None)
        self.pending = sorted(spec["requests"], key=lambda r: r["arrive_step"])
        self.live: dict[str, dict] = {}  # rid -> {"req", "internal", "seen_running_at"}
        self.results: dict[str, dict] = {}
        self.captures: dict[str, list[bytes]] = {}  # rid -> its full blocks' KV payloads (capture requests)
        self.timeline: list[dict] = []
        self.step = 0
        self._progress_at = 0.0
        self._moved = (None, 0, 0.0)  # (what the requests' state was, the step and time it last changed)

    # -- requests ---------------------------------------------------------------------
    def add(self, r: dict) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True,
                                prompt_logprobs=r.get("prompt_logprobs"))
        internal = self.engine.add_request(r["rid"], {"prompt_token_ids": r["ids"]}, params)
        self.live[r["rid"]] = {"req": r, "internal": internal, "added_at": self.step, "running_at": None}

    def moment(self, item: dict) -> str | None:
        """The abort moment this request is at now, or None (not one of ABORT_MOMENTS)."""
        req = self.scheduler.requests.get(item["internal"])
        if req is None:
            return None
        S = self.Status
        if req.status == S.WAITING_FOR_REMOTE_KVS:
            return "loading"
        if req.status == S.PREEMPTED:
            return "preempted"
        if req.status == S.WAITING:
            return "queued" if self.step > item["added_at"] and req.num_preemptions == 0 else None
        if req.status != S.RUNNING:
            return None
        if item["running_at"] is None:
            item["running_at"] = self.step
        if self.step == item["running_at"] + 1:
            return "admitted"
        if 0 < req.num_computed_tokens < req.num_prompt_tokens:
            return "mid_prefill"
        if req.num_output_tokens >= 1:
            return "decoding"
        return None

    def abort_due(self) -> None:
        for rid, item in list(self.live.items()):
            want = item["req"].get("abort")
            if not want:
                continue
            now = self.moment(item)
            if now != want:
                continue
            req = self.scheduler.requests[item["internal"]]
            state = {"status": req.status.name, "num_computed_tokens": req.num_computed_tokens,
                     "num_output_tokens": req.num_output_tokens, "num_preemptions": req.num_preemptions}
            self.engine.abort_request([rid])
            del self.live[rid]
            self.results[rid] = {"outcome": "aborted", "moment": now, "state": state, "step": self.step,
                                 "token_ids": item.get("tokens", [])}

    def output(self, out) -> None:
        """A step's output for a request (cumulative): the tokens so far, or its end."""
        item = self.live.get(out.request_id)
        if item is not None:
            item["tokens"] = list(out.outputs[0].token_ids)
        if out.finished:
            self.finished(out)

    def capture(self) -> None:
        """Capture requests whose prompt is computed: copy their full blocks' KV out of the paged cache,
        a block's payload laid out as the connector stores it (layer after layer, each layer's block slice
        in the tensor's memory order), without the connector's code."""
        for rid, item in self.live.items():
            req = self.scheduler.requests.get(item["internal"])
            if not item["req"].get("capture") or rid in self.captures or req is None or req.num_output_tokens < 1:
                continue
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(item["internal"])
            bs = self.scheduler.block_size
            full = len(item["req"]["ids"]) // bs
            ctx = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
            layers = self.scheduler.kv_cache_config.kv_cache_groups[0].layer_names
            tensors = [ctx[name].kv_cache for name in layers]
            self.captures[rid] = [b"".join(t[b].contiguous().numpy().tobytes() for t in tensors)
                                  for b in block_ids[:full]]

    def finished(self, out) -> None:
        rid = out.request_id
        item = self.live.pop(rid, None)
        if item is None:
            return  # aborted by us already
        completion = out.outputs[0]
        result = {"outcome": "finished" if completion.finish_reason != "abort" else "aborted_by_engine",
                  "token_ids": list(completion.token_ids), "num_cached_tokens": out.num_cached_tokens,
                  "finish_reason": completion.finish_reason, "step": self.step}
        if item["req"].get("prompt_logprobs") is not None:
            ids = item["req"]["ids"]
            lps = out.prompt_logprobs or []
            result["prompt_logprobs"] = [None if d is None or ids[i] not in d else float(d[ids[i]].logprob)
                                         for i, d in enumerate(lps)]
        self.results[rid] = result

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        serial = self.spec.get("serial", False)
        # like EngineCore's busy loop, step while the scheduler has requests: finished ones whose blocks wait
        # for the connector (an aborted request's load in flight) too
        while self.pending or self.engine.has_unfinished_requests() or self.scheduler.has_requests():
            if not self.engine.has_unfinished_requests() and not self.pending:
                time.sleep(IDLE_STEP_S)
            if serial:
                if not self.engine.has_unfinished_requests() and self.pending:
                    self.add(self.pending.pop(0))
            else:
                while self.pending and self.pending[0]["arrive_step"] <= self.step:
                    self.add(self.pending.pop(0))
                self.abort_due()
            for out in self.engine.step():
                self.output(out)
            self.capture()
            self.step += 1
            if self.step % TIMELINE_STEPS == 0:
                self.sample()
            self.report_progress()
            self.check_stalled()
            if self.step > MAX_STEPS:
                raise RuntimeError("the engine did not finish its requests\n" + self.dump())
        self.sample()
        self.report_progress(force=True)

    def check_stalled(self) -> None:
        """Raise (with the scheduler's view of every request) when no request moved for STALL_STEPS steps
        and STALL_S seconds: a request the engine never schedules again, or a load never reported done."""
        state = (len(self.results), len(self.pending),
                 tuple((r.request_id, r.status.name, r.num_computed_tokens, r.num_output_tokens)
                       for r in self.scheduler.requests.values()))
        seen, step, t = self._moved
        now = time.monotonic()
        if state != seen:
            self._moved = (state, self.step, now)
        elif self.step - step > STALL_STEPS and now - t > STALL_S:
            raise RuntimeError(f"no request moved in {self.step - step} steps ({now - t:.0f} s)\n" + self.dump())

    def dump(self) -> str:
        lines = [f"step {self.step}: {len(self.pending)} pending, {len(self.live)} live, "
                 f"running {len(self.scheduler.running)}, waiting {len(self.scheduler.waiting)}"]
        sch = self.scheduler
        queues = {name: getattr(sch, name) for name in ("running", "waiting", "kv_holding_waiting", "deferred_waiting")
                  if hasattr(sch, name)}
        pool = sch.kv_cache_manager.block_pool
        lines.append(f"  KV blocks free: {pool.get_num_free_blocks()} of {pool.num_gpu_blocks}")
        for r in sch.requests.values():
            where = [name for name, q in queues.items() if r in q]
            try:
                held = len(sch.kv_cache_manager.get_block_ids(r.request_id)[0])
            except Exception:  # noqa: BLE001  (a diagnostic: whatever the manager says)
                held = "?"
            lines.append(f"  {r.request_id}: {r.status.name} computed {r.num_computed_tokens}/{r.num_tokens} "
                         f"prompt {r.num_prompt_tokens} outputs {r.num_output_tokens} "
                         f"preemptions {r.num_preemptions} blocks {held} in {where}")
        lines.append(f"  scheduler: finished_recving {getattr(self.scheduler, 'finished_recving_kv_req_ids', '?')}, "
                     f"failed_recving {getattr(self.scheduler, 'failed_recving_kv_req_ids', '?')}")
        lines.append(f"  connector: {connector_stats()}")
        return "\n".join(lines)

    def sample(self) -> None:
        c = counters(self.llm)
        side = getattr(self.connector, "scheduler", None)
        self.timeline.append({
            "t": time.time(), "step": self.step,
            "load_blocks": side.stats["load_blocks"] if side is not None else 0,
            "lookups": side.stats["lookups"] if side is not None else 0,
            "loaded_blocks": connector_stats().get("worker_loaded_blocks", 0),
            "external_hit_tokens": c.get("vllm:external_prefix_cache_hits", 0.0),
            "preemptions": c.get("vllm:num_preemptions", 0.0),
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
        })

    def report_progress(self, force: bool = False) -> None:
        path = self.spec.get("progress")
        now = time.monotonic()
        if not path or (not force and now - self._progress_at < PROGRESS_S):
            return
        self._progress_at = now
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"done": len(self.results), "total": len(self.spec["requests"]), "step": self.step,
                       "t": time.time()}, f)
        os.replace(tmp, path)


def llm_kwargs(engine: dict) -> dict:
    kwargs = dict(enforce_eager=True, disable_log_stats=False, seed=0, dtype="float32", block_size=32,
                  max_model_len=1024, enable_prefix_caching=True)
    kwargs.update({k: v for k, v in engine.items() if v is not None})
    return kwargs


def wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s} s")
        time.sleep(0.05)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from kvstore.tools.harness.chaos_plants import plant

    for name in spec.get("plant", []):
        plant(name)
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**llm_kwargs(spec["engine"]))
    warm_results = {}
    if spec.get("warmup"):  # a burst before the run: first-use costs and the largest shapes stay out of it
        warm = Driver(llm, dict(spec, requests=spec["warmup"], progress=None))
        warm.run()
        warm_results = warm.results
    driver = Driver(llm, spec)
    started = time.time()
    driver.run()
    result = {"pid": os.getpid(), "startup_s": started - t0, "run_s": time.time() - started, "started": started,
              "steps": driver.step, "results": driver.results, "warmup_results": warm_results, "timeline": driver.timeline,
              "counters": counters(llm), "connector": connector_stats()}
    if driver.captures:
        import numpy as np

        np.savez(spec["out"] + ".kv.npz", **{f"{rid}.{i}": np.frombuffer(b, np.uint8)
                                              for rid, blocks in driver.captures.items() for i, b in enumerate(blocks)})
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["out"])
    if spec.get("hold"):
        open(spec["hold"] + ".idle", "w").close()
        wait_for(spec["hold"], spec.get("hold_s", 600))


if __name__ == "__main__":
    main(sys.argv[1])
