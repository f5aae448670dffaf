"""Engine processes forked from one that has already imported vLLM.

Importing vLLM and torch takes 13-23 s on the 2-core test machines, and
every engine test pays it for each engine it starts. `start` runs a harness script
(tools/harness/engine_runner.py, tools/harness/chaos_engine.py) in a process
forked from a zygote: multiprocessing's fork server, started once per test
process, which imports vLLM (`PRELOAD`) and nothing else: no
model, no thread pool, no CUDA. Each engine is still its own process, with
its own environment, working directory, stdout and stderr files, as a
`subprocess.Popen` of `sys.executable SCRIPT ARGS` would be.

What an environment variable decides at import time is applied again in the
child: torch's thread count (`OMP_NUM_THREADS`), vLLM's log level
(`VLLM_LOGGING_LEVEL`), the temporary folder (`TMPDIR`). A variable that only
an import reads, and that differs from the zygote's, cannot be honoured:
`start` returns None for such an environment (`IMPORT_TIME`), and with
`KVSTORE_ENGINE_FORK=0`, and the caller starts a plain subprocess.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
from multiprocessing import forkserver

# Read when torch, triton or vLLM's platform are imported: an engine that needs another value than the
# zygote's gets a plain subprocess.
IMPORT_TIME = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "VLLM_TARGET_DEVICE", "LD_PRELOAD", "PYTHONHASHSEED",
               "VLLM_PLUGINS", "KMP_AFFINITY", "MKL_NUM_THREADS")
_ZYGOTE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_ctx = None
_zygote: dict = {}  # the IMPORT_TIME variables the zygote was started with


def enabled() -> bool:
    return os.environ.get("KVSTORE_ENGINE_FORK", "1") != "0"


# What the zygote imports: modules only, none of this repository's (an engine imports those from its own
# checkout, as a subprocess would), and not numba (an engine's NUMBA_NUM_THREADS applies when vLLM's ngram
# proposer imports it).
PRELOAD = ["torch", "vllm", "vllm.v1.engine.llm_engine"]


def _context():
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in _ZYGOTE_ENV}
        os.environ.update(_ZYGOTE_ENV)  # the fork server starts with this process's environment
        try:
            forkserver.ensure_running()
            _zygote.update({k: os.environ.get(k) for k in IMPORT_TIME})  # what the zygote imported with
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _ctx = ctx
    return _ctx


def _child(script: str, argv: list[str], cwd: str, env: dict, stdout: str | None, stderr: str,
           stdio: socket.socket | None = None) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        if path is not None:
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(f, fd)
            os.close(f)
    if stdio is not None:  # stdin and stdout are the socket
        for fd in (0, 1):
            os.dup2(stdio.fileno(), fd)
        stdio.close()
        sys.stdin = open(0, closefd=False)  # multiprocessing gave the child /dev/null
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR again
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1") or 1)))
    logger = sys.modules.get("vllm.logger")
    if logger is not None and hasattr(logger, "_configure_vllm_root_logger"):
        logger._configure_vllm_root_logger()  # the log level of this engine's environment
    # sys.path as a subprocess's starts: the script's folder, then PYTHONPATH
    for path in reversed([os.path.dirname(script), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]):
        if path not in sys.path:
            sys.path.insert(0, path)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (multiprocessing ends with os._exit)
        sys.stdout.flush()
        sys.stderr.flush()


class ForkedProc:
    """The part of `subprocess.Popen` the harness uses, for a forked engine."""

    def __init__(self, proc, args: list[str]) -> None:
        self._proc, self.args, self.pid = proc, args, proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def start(script: str, argv: list[str], cwd: str, env: dict, stdout: str | None, stderr: str,
          stdio: socket.socket | None = None) -> ForkedProc | None:
    """`script argv` in a process forked from the zygote, or None where it must be a plain subprocess.
    With `stdio` (one end of a socket pair), the script's stdin and stdout are that socket, and `stdout` is
    None."""
    if not enabled():
        return None
    ctx = _context()
    if any(env.get(k) != _zygote[k] for k in IMPORT_TIME):
        return None
    proc = ctx.Process(target=_child, args=(script, list(argv), cwd, dict(env), stdout, stderr, stdio),
                       name=os.path.basename(script))
    proc.start()
    return ForkedProc(proc, [sys.executable, script, *argv])
