"""The processes of a chaos run: engine subprocesses (tools/harness/chaos_engine.py), the daemon killed
and restarted, and RSS samples of all of them.

`EngineProc` starts one engine on a spec and knows its progress, whether it is
idle (all requests done, connections still open) and its result. `Daemon`
wraps a `kvstore serve` subprocess that can be SIGKILLed and restarted under
the same name (the successor re-adopts the host arena) and snapshots its state
over the admin API. `anon_rss` reads a process's private (anonymous) resident
memory: the shared arena that engines and daemon map is not counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tools.harness import engine_fork
from kvstore.tools.harness.daemon_proc import DaemonProc, start_daemon
from kvstore.tools.harness.vllm_helpers import base_env

REPO = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).resolve().parent / "chaos_engine.py"


def anon_rss(pid: int) -> int | None:
    """RssAnon of a process in bytes (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class EngineProc:
    name: str
    folder: Path
    spec: dict
    proc: subprocess.Popen | None = None

    @property
    def out(self) -> Path:
        return self.folder / "result.json"

    @property
    def hold(self) -> Path:
        return self.folder / "release"

    def start(self) -> "EngineProc":
        self.folder.mkdir(parents=True, exist_ok=True)
        spec = dict(self.spec, out=str(self.out), progress=str(self.folder / "progress.json"))
        if spec.get("hold", True):
            spec["hold"] = str(self.hold)
        else:
            spec.pop("hold", None)
        (self.folder / "spec.json").write_text(json.dumps(spec))
        log = open(self.folder / "engine.log", "w")
        tmp = self.folder / "tmp"
        tmp.mkdir(exist_ok=True)
        env, spec_path = base_env(str(tmp)), str(self.folder / "spec.json")
        self.proc = engine_fork.start(str(ENGINE), [spec_path], str(REPO), env, log.name, log.name) \
            or subprocess.Popen([sys.executable, str(ENGINE), spec_path], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        return self

    def progress(self) -> tuple[int, int]:
        try:
            p = json.loads((self.folder / "progress.json").read_text())
            return p["done"], p["total"]
        except (OSError, ValueError):
            return 0, len(self.spec["requests"])

    @property
    def idle(self) -> bool:
        return Path(str(self.hold) + ".idle").exists()

    def failed(self) -> str | None:
        """The log's tail if the process ended before finishing its work."""
        if self.proc is None or self.proc.poll() is None or self.out.exists():
            return None
        return f"engine {self.name} exited {self.proc.returncode}:\n" + (self.folder / "engine.log").read_text()[-4000:]

    def release(self, timeout_s: float = 120) -> None:
        self.hold.touch()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def result(self) -> dict:
        return json.loads(self.out.read_text())


def wait_all(engines: list[EngineProc], timeout_s: float, tick=None, idle: bool = True, every_s: float = 0.25) -> None:
    """Until every engine is idle (or has exited, with `idle` false), looking every `every_s`; `tick()` runs
    each time."""
    deadline = time.monotonic() + timeout_s
    while True:
        for e in engines:
            why = e.failed()
            if why is not None:
                raise RuntimeError(why)
        done = [e.idle if idle else (e.proc is not None and e.proc.poll() is not None) for e in engines]
        if all(done):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines not done after {timeout_s} s: {[e.name for e, d in zip(engines, done) if not d]}")
        if tick is not None:
            tick()
        time.sleep(every_s)


@dataclass
class Daemon:
    """A daemon that can be killed and restarted under its name (re-adopting the arena)."""

    folder: Path
    host_bytes: str
    name: str = field(default_factory=lambda: f"chaos-{os.getpid()}-{int(time.time())}")
    proc: DaemonProc | None = None
    restarts: list = field(default_factory=list)  # {"killed", "ready"} wall times
    starts: int = 0

    @property
    def socket_path(self) -> str:
        return str(self.folder / "kvstore.sock")

    def start(self) -> "Daemon":
        log = self.folder / f"daemon-{self.starts}.log"  # one per process: a restart's does not overwrite
        self.starts += 1
        self.proc = start_daemon(self.folder, host_bytes=self.host_bytes, page_bytes="256KiB", name=self.name,
                                 admin=True, socket_path=self.socket_path, log_path=str(log),
                                 env=base_env(str(self.folder)))
        return self

    def kill_and_restart(self, down_s: float) -> dict:
        """SIGKILL, `down_s` with no daemon, start again; a snapshot taken at once (stats first: engines
        reconnect within their retry_s)."""
        assert self.proc is not None
        killed = time.time()
        self.proc.stop(signal.SIGKILL, keep_arena=True)
        time.sleep(down_s)
        self.start()
        ready = time.time()
        self.restarts.append({"killed": killed, "ready": ready})
        return self.snapshot("restart")

    def snapshot(self, when: str) -> dict:
        assert self.proc is not None
        stats = json.loads(self.proc.http("/stats")[1])
        return {"when": when, "t": time.time(), "stats": stats, "problems": self.proc.check()}

    @property
    def pid(self) -> int | None:
        return self.proc.proc.pid if self.proc is not None and self.proc.alive() else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
