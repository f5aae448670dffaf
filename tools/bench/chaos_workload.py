"""The chaos run's workload: requests with shared prefixes of several lengths, per engine, seeded.

Prompts are token ids cut from one corpus (`tools/harness/vllm_helpers.corpus_text`):
a few system prompts of different lengths (none block-aligned), multi-turn
sessions (turn t = system prompt + user_1 + assistant_1 + ... + user_t, the
assistant parts fixed text, so turn t+1 extends turn t's prompt), and one-shot
questions after a system prompt. Turns of one session go to different engines,
so engines reuse each other's blocks. Every request has an arrival step (in its
engine's steps), a greedy output length, and possibly `prompt_logprobs` and an
abort moment (`ABORT_MOMENTS`, checked between engine steps by the engine
process, tools/harness/chaos_engine.py). Nothing here imports vLLM.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

# when an abort fires, judged between engine steps from the request's scheduler state:
ABORT_MOMENTS = (
    "queued",  # added, never scheduled (before any lookup or load)
    "loading",  # waiting for an asynchronous load (WAITING_FOR_REMOTE_KVS)
    "admitted",  # the step after it was first scheduled (its load ran, its first saves are done)
    "mid_prefill",  # running, some of the prompt computed, not all
    "preempted",  # preempted, back in the waiting queue
    "decoding",  # after its first output tokens (its prompt blocks saved)
)


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    num_requests: int = 48  # over all engines
    num_engines: int = 2
    system_lens: tuple = (70, 150, 260)  # tokens; none a multiple of the block size
    num_sessions: int = 6
    turns: int = 3
    segment: tuple = (20, 70)  # user / assistant segment lengths (tokens)
    max_prompt: int = 560
    max_tokens: tuple = (6, 32)
    abort_rate: float = 0.25
    logprobs_rate: float = 0.12
    arrival_steps: int = 120  # arrivals spread over this many steps of each engine
    burst: float = 0.3  # share of each engine's requests that arrive at step 0
    warmup: int = 3  # requests per engine served as a burst before the run (its memory high-water mark)


@dataclass
class ChaosRequest:
    rid: str
    engine: int
    ids: list
    max_tokens: int
    arrive_step: int
    prompt_logprobs: int | None = None
    abort: str | None = None
    kind: str = ""  # "turn s.t" or "oneshot"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Workload:
    requests: list = field(default_factory=list)
    warmup: list = field(default_factory=list)  # served by each engine (a burst) before its run

    def for_engine(self, engine: int) -> list:
        return [r for r in self.requests if r.engine == engine]

    def by_id(self) -> dict:
        return {r.rid: r for r in self.requests}


def build_workload(corpus_ids: list[int], cfg: WorkloadConfig) -> Workload:
    """`cfg.num_requests` requests over `cfg.num_engines` engines; deterministic for a seed."""
    rng = random.Random(cfg.seed)
    pos = 0

    def cut(n: int) -> list[int]:
        nonlocal pos
        if pos + n > len(corpus_ids):
            pos = rng.randrange(0, max(1, len(corpus_ids) // 4))  # wrap around: reuse is fine
        out = corpus_ids[pos : pos + n]
        pos += n
        return out

    systems = [cut(n) for n in cfg.system_lens]
    work = Workload()
    sessions = []
    for _ in range(cfg.num_sessions):
        prompt = list(rng.choice(systems))
        turns = []
        for _ in range(cfg.turns):
            prompt = prompt + cut(rng.randint(*cfg.segment))
            if len(prompt) > cfg.max_prompt:
                break
            turns.append(list(prompt))
            prompt = prompt + cut(rng.randint(*cfg.segment))  # the assistant's (fixed) reply
        sessions.append(turns)
    for e in range(cfg.num_engines):  # a burst per engine, long prompts: the run's largest shapes come first
        for w in range(cfg.warmup):
            ids = (systems[w % len(systems)] + cut(cfg.max_prompt))[: cfg.max_prompt // 2 + 40 * w]
            work.warmup.append(ChaosRequest(rid=f"w{e}.{w}", engine=e, ids=ids, max_tokens=16,
                                            arrive_step=0, prompt_logprobs=1 if w == 0 else None, kind="warmup"))
    prompts: list[tuple[str, list[int]]] = [(f"turn {s}.{t}", p) for s, turns in enumerate(sessions)
                                            for t, p in enumerate(turns)]
    for i in range(cfg.num_requests):
        if i < len(prompts) and rng.random() < 0.7:
            kind, ids = prompts[i]
        elif prompts and rng.random() < 0.5:
            kind, ids = rng.choice(prompts)  # the same prompt again, maybe on another engine
        else:
            kind, ids = "oneshot", rng.choice(systems) + cut(rng.randint(*cfg.segment))
        engine = i % cfg.num_engines
        burst = rng.random() < cfg.burst
        work.requests.append(ChaosRequest(
            rid=f"r{i:04d}", engine=engine, ids=list(ids[: cfg.max_prompt]),
            max_tokens=rng.randint(*cfg.max_tokens),
            arrive_step=0 if burst else rng.randrange(cfg.arrival_steps),
            prompt_logprobs=1 if rng.random() < cfg.logprobs_rate else None,
            abort=rng.choice(ABORT_MOMENTS) if rng.random() < cfg.abort_rate else None,
            kind=kind,
        ))
    return work
