"""Engines forked from a zygote that imported vLLM (tools/harness/engine_fork.py) get what a subprocess
would: their own environment, working directory, temporary folder, thread count, stdout and stderr files
(or one socket as their stdin and stdout) and exit status; and an environment the zygote cannot honour
gets a plain subprocess (None)."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from kvstore.tools.harness import engine_fork
from kvstore.tools.harness.vllm_helpers import base_env

SCRIPT = """
import json, os, sys, tempfile, time
import torch
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("KVSTORE_FORK_PROBE"),
                  "tmp": tempfile.gettempdir(), "threads": torch.get_num_threads(),
                  "preloaded": "vllm" in sys.modules, "numba": "numba" in sys.modules, "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return script


def start(probe, tmp_path, *argv, **env_extra):
    tmp = tmp_path / "t"
    tmp.mkdir(exist_ok=True)
    env = dict(base_env(str(tmp), threads=2), KVSTORE_FORK_PROBE="yes", **env_extra)
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    out.write_text("")
    err.write_text("")
    return engine_fork.start(str(probe), list(argv), str(tmp_path), env, str(out), str(err)), out, err


def test_a_forked_engine_has_its_own_environment_files_and_exit_status(probe, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_ENGINE_FORK", raising=False)
    proc, out, err = start(probe, tmp_path, "run", "3")
    assert proc is not None
    assert proc.wait(timeout=120) == 3 and proc.returncode == 3 and proc.poll() == 3
    seen = json.loads(out.read_text().splitlines()[-1])
    assert seen["argv"] == ["run", "3"] and seen["cwd"] == str(tmp_path) and seen["x"] == "yes"
    assert seen["tmp"] == str(tmp_path / "t") and seen["threads"] == 2
    assert seen["preloaded"], "the zygote did not import vLLM: every engine pays the import again"
    assert not seen["numba"], "the zygote imported numba: an engine's NUMBA_NUM_THREADS no longer applies"
    assert seen["pid"] == proc.pid
    assert "to stderr" in err.read_text()


def test_a_forked_engine_can_be_waited_on_with_a_timeout_and_killed(probe, tmp_path):
    proc, _, _ = start(probe, tmp_path, "sleep", "0")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -9


def test_what_only_an_import_reads_gets_a_plain_subprocess(probe, tmp_path, monkeypatch):
    # the zygote was started without TRITON_INTERPRET (or with it: flip it either way)
    engine_fork._context()
    flipped = "0" if engine_fork._zygote.get("TRITON_INTERPRET") == "1" else "1"
    assert start(probe, tmp_path, "run", "0", TRITON_INTERPRET=flipped)[0] is None
    monkeypatch.setenv("KVSTORE_ENGINE_FORK", "0")
    assert start(probe, tmp_path, "run", "0")[0] is None  # (the callers then start a plain subprocess)


def test_a_forked_engine_can_talk_over_one_socket_as_its_stdin_and_stdout(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_ENGINE_FORK", raising=False)
    script = tmp_path / "echo.py"
    script.write_text("import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"
                      "print('left', file=sys.stderr)\n")
    ours, theirs = socket.socketpair()
    with ours:
        with theirs:
            proc = engine_fork.start(str(script), [], str(tmp_path), base_env(str(tmp_path)), None,
                                     str(tmp_path / "err.log"), stdio=theirs)
        assert proc is not None
        to, back = ours.makefile("w"), ours.makefile("r")
        to.write("one\ntwo\n")
        to.flush()
        assert [back.readline(), back.readline()] == ["ONE\n", "TWO\n"]
        ours.shutdown(socket.SHUT_WR)  # its stdin ends: the script leaves
        assert proc.wait(timeout=60) == 0 and back.readline() == ""
    assert "left" in (tmp_path / "err.log").read_text()
