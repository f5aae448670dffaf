"""Configuration: defaults, TOML, flags, and clear errors for bad values."""

import subprocess
import sys

import pytest

from kvstore.config import Config, load_config, parse_size
from kvstore.errors import ConfigError

from tests.conftest import ROOT


def test_defaults_are_valid_and_per_user():
    cfg = load_config()
    assert cfg.host.capacity_bytes == 4 << 30
    assert cfg.server.admin_host == "127.0.0.1" and cfg.server.tcp_port is None
    assert str(cfg.host.page_bytes) and cfg.shm_path.startswith("/dev/shm/kvstore-")
    assert cfg.host.persistent  # the arena is kept for the next start
    assert not load_config(None, {"host.persistent": False}).host.persistent


def test_toml_then_flags(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('name = "a"\n[host]\ncapacity = "1GiB"\npage_size = "64KiB"\n[server]\nadmin_port = 9000\n')
    cfg = load_config(str(path), {"host.capacity": 512 << 20, "server.socket": str(tmp_path / "s.sock")})
    assert cfg.name == "a" and cfg.host.capacity_bytes == 512 << 20 and cfg.host.page_bytes == 64 << 10
    assert cfg.server.admin_port == 9000 and cfg.server.socket_path.endswith("s.sock")


@pytest.mark.parametrize("text,fragment", [
    ('[host]\ncapacity = "lots"\n', "host.capacity"),
    ('[host]\npage_size = 1000\n', "multiple of 4KiB"),
    ('[host]\ncapacity = 4096\npage_size = 8192\n', "at least one page"),
    ('[server]\nadmin_port = 70000\n', "admin_port"),
    ('[server]\ntcp_port = 9999\n', "tcp_token"),
    ('[server]\nbogus = 1\n', "unknown key server.bogus"),
    ('[server]\nevent_loop = "trio"\n', "server.event_loop must be one of auto, uvloop, asyncio"),
    ('colour = "red"\n', "unknown config key"),
    ('policy = "random"\n', "policy must be one of"),
    ('name = "../etc"\n', "name must be"),
    ('[host\n', "not valid TOML"),
    ('[gpu]\ndevice = "tpu"\n', "gpu.device must be cuda"),
    ('[gpu]\nenabled = "yes"\n', "gpu.enabled must be true or false"),
    ('[gpu]\ncapacity = 4096\npage_size = 8192\n', "gpu.capacity must hold at least one page"),
    ('[gpu]\nsize = "1GiB"\n', "unknown key gpu.size"),
    ('[host]\npersistent = "yes"\n', "host.persistent must be true or false"),
    ('[compression]\nremote = "yes"\n', "compression.remote must be true or false"),
    ('[compression]\nexact_when_busy = 1\n', "compression.exact_when_busy must be true or false"),
    ('[compression]\nprofile_dir = "/nonexistent/kvstore"\n', "is not a folder"),
])
def test_bad_values_are_named(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        load_config(str(path))


def test_sizes():
    assert parse_size("4GiB", "x") == 4 << 30 and parse_size("512M", "x") == 512 << 20 and parse_size(7, "x") == 7
    with pytest.raises(ConfigError):
        parse_size(True, "x")
    with pytest.raises(ConfigError):
        Config(log_level="LOUD")


def test_serve_rejects_bad_config_without_starting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--host-bytes", "12 apples"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "bad configuration" in out.stderr and "--host-bytes" in out.stderr
    missing = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(tmp_path / "nope.toml")],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "config file not found" in missing.stderr
