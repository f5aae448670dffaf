"""The package as a user gets it: a wheel built from this checkout, installed into a fresh virtual
environment, run from outside the checkout.

The wheel adds one top-level import, `kvstore` (the repository's other folders are its subpackages;
benchmarks and test harnesses stay out, the CLI's traces go in). Installed, `kvstore --version` and
`kvstore serve --check-config` work, the daemon starts from the wheel's files and `kvstore stats` answers
it, and vLLM finds the connector by name through the wheel's plugin entry point (in the vllm suite: an
engine with `"kv_connector": "KVStoreConnector"` and no module path shares a hit).

The fresh environment takes the project's dependencies from the test environment's site-packages (a
path entry, not a site directory: the editable install's finder there is not loaded), so the test needs
no network; the only copy of `kvstore` it can import is the wheel's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import uuid
import zipfile

import pytest

from tests.conftest import ROOT
from kvstore.tools.harness.vllm_helpers import base_env, build_model, corpus_text, tokenize, vllm_available


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), ROOT],
                   check=True, capture_output=True, timeout=300)
    (name,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return str(out / name)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> str:
    """A fresh venv with the wheel installed (no dependencies: those come from this environment's site-packages)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    clean = dict(env=_outside_env(), cwd=str(root))  # (with the checkout on the path, pip would see its kvstore)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", wheel], check=True, capture_output=True, timeout=300, **clean)
    site = subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, **clean).stdout.strip()
    assert os.path.isdir(os.path.join(site, "kvstore"))
    with open(os.path.join(site, "deps-from-the-test-env.pth"), "w") as f:  # (after the install: pip would see
        f.write(sysconfig.get_paths()["purelib"] + "\n")                     # the editable kvstore there and skip it)
    return str(root)


def _outside_env() -> dict:
    """This environment without the checkout on the path (tests/conftest.py puts it there)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(venv: str, *argv: str, cwd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=cwd, env=_outside_env(), capture_output=True, text=True, timeout=timeout)


def test_the_wheel_adds_one_top_level_import(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvstore"}
    assert "kvstore/tiers/disk.py" in names and "kvstore/connectors/vllm.py" in names and "kvstore/tools/cli.py" in names
    assert "kvstore/tools/traces/mooncake_conversation_trace.jsonl" in names
    assert not [n for n in names if n.startswith(("kvstore/tools/bench/", "kvstore/tools/harness/"))]
    assert "kvstore = kvstore.tools.cli:main" in entry_points
    assert "[vllm.general_plugins]" in entry_points and "kvstore.connectors.plugin:register" in entry_points


def test_installed_it_runs_from_its_own_files(venv, tmp_path):
    bin_ = os.path.join(venv, "bin")
    where = run(venv, f"{bin_}/python", "-c", "import kvstore, kvstore.tiers.disk as d; print(kvstore.__file__, d.__file__)",
                cwd=str(tmp_path))
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(venv) for p in where.stdout.split())  # the wheel's copy, not the checkout's
    version = run(venv, f"{bin_}/kvstore", "--version", cwd=str(tmp_path))
    assert version.returncode == 0 and version.stdout.startswith("kvstore ")
    sock = str(tmp_path / "run" / "k.sock")
    check = run(venv, f"{bin_}/kvstore", "serve", "--socket", sock, "--no-disk", "--check-config", cwd=str(tmp_path))
    assert check.returncode == 0 and json.loads(check.stdout)["server"]["socket_path"] == sock
    replay = run(venv, f"{bin_}/kvstore", "replay", "trace:conversation", "--limit", "50", "--capacity-blocks", "500",
                 "--json", cwd=str(tmp_path), timeout=120)
    assert replay.returncode == 0 and json.loads(replay.stdout)["runs"][0]["capacity_blocks"] == 500
    daemon = subprocess.Popen([f"{bin_}/kvstore", "serve", "--name", f"wheel-{uuid.uuid4().hex[:8]}", "--socket", sock,
                               "--host-bytes", "64MiB", "--no-disk", "--no-admin", "--no-persistent-host"], cwd=str(tmp_path), env=_outside_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert "ready" in daemon.stdout.readline()
        stats = run(venv, f"{bin_}/kvstore", "stats", "--json", "--socket", sock, cwd=str(tmp_path))
        assert stats.returncode == 0 and json.loads(stats.stdout)["tiers"]["host"]["capacity_bytes"] == 64 << 20
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


ENGINES = """
import json, sys
from vllm import LLM, SamplingParams
model, sock, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kvt = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"socket": sock}}
cached = []
for _ in range(2):  # two engines, one after the other: the second reads what the first stored
    llm = LLM(model=model, dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20, max_model_len=1024,
              enforce_eager=True, kv_transfer_config=kvt)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    cached.append(out[0].num_cached_tokens)
    del llm
import kvstore.connectors.vllm as c
print("RESULT", json.dumps({"cached": cached, "connector": c.__file__}))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_finds_the_connector_by_name_through_the_wheel_s_plugin(venv, tmp_path):
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    model = build_model("tiny")
    ids = tokenize(model, corpus_text(4000))[:200]
    sock = str(tmp_path / "run" / "k.sock")
    bin_ = os.path.join(venv, "bin")
    daemon = subprocess.Popen([f"{bin_}/kvstore", "serve", "--name", f"wheel-{uuid.uuid4().hex[:8]}", "--socket", sock,
                               "--host-bytes", "128MiB", "--no-disk", "--no-admin", "--no-persistent-host"], cwd=str(tmp_path), env=_outside_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in daemon.stdout.readline()
        env = {k: v for k, v in base_env(str(tmp_path)).items() if k != "PYTHONPATH"}
        script = tmp_path / "engines.py"
        script.write_text(textwrap.dedent(ENGINES))
        r = subprocess.run([f"{bin_}/python", str(script), model, sock, json.dumps(ids)], cwd=str(tmp_path), env=env,
                           capture_output=True, text=True, timeout=600)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, r.stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT "):])
        assert result["connector"].startswith(venv)
        assert result["cached"] == [0, 192]  # the second engine loads the first one's 6 full blocks
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
