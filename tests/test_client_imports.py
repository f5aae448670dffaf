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
