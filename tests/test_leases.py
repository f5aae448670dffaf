"""Pins are leases: a client killed with SIGKILL loses its pins and its reservations."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from kvstore.client import KVClient
from kvstore.keys import Namespace

from tests.conftest import ROOT
from tests.helpers import chain, wait_for

NS = Namespace("lease-model", "bfloat16", 4, 8, 128, 16, 4 << 20)  # 4 MiB blocks: 16 fill the 64 MiB arena


def chain_blocks(seed, n):
    """(hash, parent, payload) of an n-block chain, every byte of its payloads `seed`."""
    hs, ps = chain(seed, n, stride=1_000_000)
    return list(zip(hs, ps, [np.full(NS.block_bytes, seed, np.uint8)] * n))


def test_pins_of_a_killed_client_expire(daemon):
    held = chain_blocks(1, 8)
    with KVClient(daemon.socket_path) as c:
        ns = c.register(NS)
        assert c.put(ns, held) == 8
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kvstore.client import KVClient
        from tests.test_leases import NS, chain_blocks
        c = KVClient({daemon.socket_path!r})
        ns = c.register(NS)
        ext = c.acquire(ns, [h for h, _, _ in chain_blocks(1, 8)])
        assert all(e is not None for e in ext)
        # also leave a reservation open
        assert c.reserve(ns, [(b"\\x42" * 16, None)])[0] is not None
        print("pinned", flush=True)
        time.sleep(600)
    """)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "pinned"
        assert daemon.stats()["pinned_blocks"] == 8 and daemon.stats()["reserved_blocks"] == 1
        with KVClient(daemon.socket_path) as c:
            ns = c.register(NS)
            # The arena is full of pinned blocks plus one reservation: new blocks find little room.
            stored = c.put(ns, chain_blocks(2, 16))
            assert stored == 16 - 8 - 1
            assert c.lookup(ns, [h for h, _, _ in held]).hits == 8, "pinned blocks must survive"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert wait_for(lambda: daemon.stats()["pinned_blocks"] == 0), "pins did not expire"
        assert daemon.stats()["reserved_blocks"] == 0
        with KVClient(daemon.socket_path) as c:
            assert c.put(ns, chain_blocks(3, 16)) == 16, "the expired pins' blocks must be evictable again"
            assert c.lookup(ns, [h for h, _, _ in held]).hits == 0
        assert daemon.check() == []
        assert daemon.stats()["counters"]["leases_expired"] >= 1
    finally:
        holder.kill()
