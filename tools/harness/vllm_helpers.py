"""Helpers for the vLLM end-to-end tests and benchmarks: the test models, a daemon, engine subprocesses.

Every engine runs in its own subprocess (tools/harness/engine_runner.py) with its own TMPDIR and one
OpenMP thread: on a 2-core machine shared with other work, two threads spin on each other at every
barrier (a 24-token generation measured 40 s with 2 threads, 2 s with 1). Engines that do not depend on
each other run side by side (`EngineRun`), one core each. The daemon is a
`kvstore serve` subprocess (tools/harness/daemon_proc.py) on a socket in a temporary
folder, with a small host tier and no disk tier unless asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvstore.tools.harness import engine_fork
from kvstore.tools.harness.daemon_proc import DaemonProc
from kvstore.tools.harness.daemon_proc import start_daemon as launch_daemon

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "engine_runner.py"
CONNECTOR_CLASS = "KVStoreConnector"
CONNECTOR_MODULE = "kvstore.connectors.vllm"
# What vLLM logs when it turns its hybrid KV cache manager off (sliding layers then keep every token)
HMA_OFF_LINES = ("Turning off hybrid kv cache manager", "Hybrid KV cache manager is disabled")


def vllm_available() -> tuple[bool, str]:
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return False, "vllm is not installed (pip install -e '.[vllm]')"
    except Exception as exc:  # a broken install
        return False, f"vllm cannot be imported: {exc}"
    return True, ""


def build_model(which: str) -> str:
    """Path of a test model folder (built once into .cache/models): smollm2, tiny, or a hybrid one by its
    folder name (tiny-gemma3, tiny-gptoss, tiny-mistral-swa, tiny-qwen3next, tiny-mla)."""
    from kvstore.tools.harness.build_models import build

    if which.startswith("tiny-"):
        return str(next(p for p in build("hybrid") if p.name == which))
    if which == "bench-gemma3":
        return str(build("bench-hybrid")[0])
    return str(build(which)[0])


def base_env(tmpdir: str, threads: int = 1, multiprocess: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        TMPDIR=tmpdir,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        OMP_NUM_THREADS=str(threads),
        # numba's pool (vLLM's ngram proposer, which runs it on one thread): its idle workers spin, and an engine
        # beside an ngram engine ran at half its speed on two cores
        NUMBA_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("PYTHONHASHSEED", None)
    return env


def start_daemon(workdir: str, host_bytes: str = "512MiB", socket: str | None = None,
                 disk_bytes: str | None = None, extra: tuple[str, ...] = (), admin: bool = False) -> DaemonProc:
    """A daemon on `socket` (default: <workdir>/kvstore.sock), logging to <workdir>/daemon-<name>.log.

    No disk tier unless `disk_bytes` is given (then in <workdir>/disk-<name>); `extra`: more serve flags;
    the admin plane (for `DaemonProc.check()`) only with `admin`."""
    name = f"vt-{uuid.uuid4().hex[:10]}"
    disk = ["--disk-path", os.path.join(workdir, f"disk-{name}"), "--disk-bytes", disk_bytes] if disk_bytes else []
    return launch_daemon(workdir, *disk, *extra, host_bytes=host_bytes, page_bytes="256KiB", name=name,
                         disk=bool(disk_bytes), admin=admin,
                         socket_path=socket or os.path.join(workdir, "kvstore.sock"),
                         log_path=os.path.join(workdir, f"daemon-{name}.log"), env=base_env(workdir))


def connector_config(socket: str, **extra) -> dict:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": socket, "retry_s": 0.5, **extra},
    }


@dataclass
class EngineResult:
    runs: list[dict]
    startup_s: float
    stderr: str
    stdout: str = ""  # vLLM's own log lines go to stdout
    num_blocks: int | None = None  # the KV capacity vLLM settled on

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    @property
    def hma_off(self) -> bool:
        """vLLM turned its hybrid KV cache manager off in this engine."""
        return any(line in self.log for line in HMA_OFF_LINES)

    def outputs(self, run: int) -> list[dict]:
        return self.runs[run]["outputs"]

    def tokens(self, run: int, i: int = 0) -> list[int]:
        return self.runs[run]["outputs"][i]["token_ids"]

    def cached(self, run: int, i: int = 0) -> int:
        return self.runs[run]["outputs"][i]["num_cached_tokens"]

    def counter(self, run: int, name: str) -> float:
        return self.runs[run]["counters"].get(name, 0.0)


class EngineRun:
    """One tools/harness/engine_runner.py subprocess on `spec`, started at once; `result()` waits for it and
    raises with its stderr tail if it fails. Engines that do not depend on each other (a baseline without
    the connector beside an engine with it) can run side by side: each is one OpenMP thread."""

    def __init__(self, spec: dict, workdir: str, multiprocess: bool = False, timeout_s: float = 300,
                 threads: int = 1, env_extra: dict | None = None) -> None:
        tmp = tempfile.mkdtemp(prefix="engine-", dir=workdir)
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = base_env(tmp, threads=threads, multiprocess=multiprocess)
        env.update(env_extra or {})
        # files, not pipes: an engine beside another must never block on a full pipe nobody reads yet
        self._out = open(os.path.join(tmp, "stdout.log"), "w+")
        self._err = open(os.path.join(tmp, "stderr.log"), "w+")
        self.proc = engine_fork.start(str(RUNNER), [spec_path], str(REPO), env, self._out.name, self._err.name) \
            or subprocess.Popen([sys.executable, str(RUNNER), spec_path], cwd=REPO, env=env, text=True,
                                stdout=self._out, stderr=self._err)
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def result(self) -> EngineResult:
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise subprocess.TimeoutExpired(self.proc.args, self.timeout_s) from None
        finally:
            stdout, stderr = (_read_all(f) for f in (self._out, self._err))
        lines = [ln for ln in stdout.splitlines() if ln.startswith("ENGINE_RESULT ")]
        if self.proc.returncode != 0 or not lines:
            raise RuntimeError(f"engine failed (rc={self.proc.returncode}):\n{stderr[-6000:]}\n{stdout[-2000:]}")
        data = json.loads(lines[-1][len("ENGINE_RESULT "):])
        return EngineResult(data["runs"], data["startup_s"], stderr, stdout, data.get("num_blocks"))


def _read_all(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def run_engine(spec: dict, workdir: str, multiprocess: bool = False, timeout_s: float = 300,
               threads: int = 1, env_extra: dict | None = None) -> EngineResult:
    """Run one engine (tools/harness/engine_runner.py) on `spec` in a subprocess and wait for its results."""
    return EngineRun(spec, workdir, multiprocess, timeout_s, threads, env_extra).result()


def engine_spec(model: str, runs: list[dict], **kw) -> dict:
    spec = {"model": model, "runs": runs}
    spec.update({k: v for k, v in kw.items() if v is not None})
    return spec


def tokenize(model: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok(text, add_special_tokens=False)["input_ids"]


def corpus_text(num_chars: int, offset: int = 0) -> str:
    """Deterministic English text from /usr/share/common-licenses (the tiny model's training text too)."""
    parts = []
    for p in sorted(Path("/usr/share/common-licenses").iterdir()):
        if p.is_file():
            parts.append(p.read_text(errors="ignore"))
    text = " ".join(" ".join(parts).split())
    return text[offset : offset + num_chars]
