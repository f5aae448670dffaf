"""The deployment examples (docs/deploy/): their exact daemon command lines, with `--check-config`, accept
the example configuration and print the settings the daemon would run with; a broken config is refused
with exit 2 and changes nothing. The daemon reads its admin token from `server.admin_token_file` and
answers /healthz to any peer (a Kubernetes probe comes from the node)."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import yaml

from tests.conftest import ROOT

DEPLOY = os.path.join(ROOT, "docs", "deploy")
CONFIG_IN_EXAMPLES = "/etc/kvstore/kvstore.toml"


def daemon_commands() -> dict[str, list[str]]:
    """The daemon's argv in each example (Kubernetes pod, systemd unit, compose file)."""
    with open(os.path.join(DEPLOY, "pod.yaml")) as f:
        pod = yaml.safe_load(f)
    with open(os.path.join(DEPLOY, "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(os.path.join(DEPLOY, "kvstore.service"))
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "kvstore"]
    return {"pod": container["command"], "compose": compose["services"]["kvstore"]["command"],
            "systemd": shlex.split(unit["Service"]["ExecStart"])}


def check(argv: list[str], config: str) -> subprocess.CompletedProcess:
    """Run an example's daemon command (its `kvstore` binary as this interpreter's module) with --check-config."""
    assert os.path.basename(argv[0]) == "kvstore" and argv[1] == "serve", argv
    args = [config if a == CONFIG_IN_EXAMPLES else a for a in argv[2:]]
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", *args, "--check-config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("example", ["pod", "compose", "systemd"])
def test_each_example_s_command_line_checks_its_config(example):
    argv = daemon_commands()[example]
    assert CONFIG_IN_EXAMPLES in argv
    r = check(argv, os.path.join(DEPLOY, "kvstore.toml"))
    assert r.returncode == 0, r.stderr
    settings = json.loads(r.stdout)
    assert settings["server"]["socket_path"] == "/run/kvstore/sock/kvstore.sock"
    assert settings["server"]["admin_token_file"] == "/etc/kvstore/secrets/admin-token"
    assert settings["derived"]["admin_token"] == "/etc/kvstore/secrets/admin-token"
    assert settings["host"]["capacity_bytes"] == 16 << 30 and settings["derived"]["disk_path"] == "/var/lib/kvstore/disk"
    # this machine is not the deployment's host: what it lacks is said, not fatal
    assert "cannot read token file /etc/kvstore/secrets/admin-token" in r.stderr


def test_check_config_leaves_secrets_out_and_refuses_a_bad_config(tmp_path):
    token = tmp_path / "tcp.token"
    token.write_text("s3cret-token-0123456789")
    token.chmod(0o600)
    good = tmp_path / "good.toml"
    good.write_text(f'[server]\nsocket = "{tmp_path}/s/k.sock"\ntcp_port = 9322\n'
                    f'[[server.tcp_tokens]]\ntoken_file = "{token}"\nnamespaces = ["*"]\nops = ["read"]\n')
    r = check(["kvstore", "serve", "--config", CONFIG_IN_EXAMPLES], str(good))
    assert r.returncode == 0, r.stderr and "s3cret" not in r.stdout
    assert json.loads(r.stdout)["server"]["tcp_tokens"][0]["ops"] == ["read"]
    assert not (tmp_path / "s").exists()  # started nothing, made nothing
    bad = tmp_path / "bad.toml"
    bad.write_text('[host]\ncapacity = "12 parsecs"\n')
    r = check(["kvstore", "serve", "--config", CONFIG_IN_EXAMPLES], str(bad))
    assert r.returncode == 2 and "bad configuration" in r.stderr and not r.stdout


def test_the_admin_token_comes_from_a_file_and_healthz_answers_any_peer(daemon_factory, tmp_path):
    token = "admin-token-from-a-secret-0123"
    path = tmp_path / "admin-token"
    path.write_text(token + "\n")
    path.chmod(0o400)
    config = tmp_path / "k.toml"
    config.write_text(f'[server]\nadmin_token_file = "{path}"\nadmin_host = "0.0.0.0"\n')
    d = daemon_factory("--config", str(config), admin=True)

    def status(host: str, path: str, bearer: str | None = None) -> int:
        headers = {"Host": "localhost", **({"Authorization": f"Bearer {bearer}"} if bearer else {})}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{d.admin_port}{path}", headers=headers),
                                        timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("127.0.0.1", "/stats", token) == 200 and status("127.0.0.1", "/stats", "wrong-" + token) == 401
    assert not os.path.exists(os.path.join(os.path.dirname(d.socket_path), f"{d.name}.admin-token"))
    # a peer that is not loopback (the host's own address): /healthz answers, /metrics needs the token
    addr = _own_address()
    if addr is None:
        pytest.skip("this host has no address but loopback")
    assert status(addr, "/healthz") == 200
    assert status(addr, "/metrics") == 401 and status(addr, "/metrics", token) == 200
    d.stop()
    assert path.read_text().strip() == token  # the daemon leaves a token file it was given alone


def _own_address() -> str | None:
    """An address of this host that is not loopback (the one a UDP socket would send from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # nothing is sent: connect only picks the source address
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr
