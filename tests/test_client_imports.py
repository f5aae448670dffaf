"""An engine worker imports the client, never the daemon: `kvstore.client` loads only the wire
types, the protocol and the arena's client side (kvstore/wire.py, tiers/arena.py)."""

import json
import subprocess
import sys

from kvstore.tools.harness.daemon_proc import ROOT

DAEMON_ONLY = ("kvstore.store", "kvstore.index", "kvstore.placement", "kvstore.promotion", "kvstore.recovery",
               "kvstore.sharing", "kvstore.waits", "kvstore.chain", "eviction", "kvstore.tiers.base", "kvstore.tiers.host",
               "kvstore.tiers.host_index", "kvstore.tiers.disk", "kvstore.tiers.remote", "kvstore.tiers.gpu", "server", "lmdb", "torch")


def test_the_client_loads_no_daemon_module():
    code = "import json, sys, kvstore.client; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "kvstore.client" in loaded and "kvstore.wire" in loaded
    assert [m for m in loaded if m.startswith(DAEMON_ONLY)] == []


def _subcommands(parser) -> set[str]:
    return {name for action in parser._subparsers._group_actions for name in action.choices}


def test_every_command_is_mapped_to_the_module_that_registers_it():
    from kvstore.tools import cli

    assert _subcommands(cli.build_parser()) == set(cli.COMMANDS)  # help: every command
    for command, module in cli.COMMANDS.items():
        alone = _subcommands(cli.build_parser([command, "--help"]))
        assert command in alone, (command, module)
        assert alone == {c for c, m in cli.COMMANDS.items() if m == module}


def test_serve_loads_no_other_command():
    code = ("import json, sys; from kvstore.tools import cli; cli.build_parser(['serve', '--name', 'x']); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "kvstore.tools.serve_cmd" in loaded
    others = [m for m in loaded if m.startswith("kvstore.tools.") and m.endswith(
        ("stats_cmd", "blocks_cmd", "inspect_cmd", "top_cmd", "events_cmd", "replay", "gen_trace", "proxy_cmd"))]
    assert others == []
    assert "kvstore.server.pd_proxy" not in loaded and "aiohttp" not in loaded
    assert "importlib.metadata" not in loaded  # (the version is looked up for --version only)


def test_the_daemon_loads_its_admin_plane_only_when_it_serves_one():
    """aiohttp (the admin plane) is a seventh of a restart: a daemon without an admin port never loads it."""
    code = "import json, sys, kvstore.server.daemon; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "kvstore.server.daemon" in loaded
    assert "kvstore.server.admin" not in loaded and "aiohttp" not in loaded
