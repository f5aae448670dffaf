"""SIGKILL while a compressing disk tier demotes, encodes and compacts: nothing acknowledged is lost, and
every block served is its exact bytes or the codec's image of them, never anything else.

A block promoted from disk goes back to its kept encoded copy, but a full disk that can evict nothing drops
that copy, and the block is then encoded again from its image (the codec is not idempotent): a block may be
served as its exact bytes or as any of the first IMAGES images.

A real daemon (a 1 MiB host arena over a 4 MiB disk tier of 4 KiB pages, `[compression] disk = true`,
`exact_when_busy` on as by default) serves a namespace opted into `k4v2`. Each round: restart on the same
folder, verify the previous rounds' acknowledged, prefix-closed blocks (tests/test_disk_crash.py), run a
storm of puts and reads (demotions encoded inline or stored exact while the encoders are busy, then
compacted in place when the tier idles; promotions delete records; the small disk evicts and reuses
pages), and SIGKILL the daemon after a random number of acknowledged puts.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvstore.codec import BlockLayout, Budget, decode, encode, from_float32
from kvstore.keys import Namespace
from kvstore.tools.harness.daemon_proc import start_daemon
from tests.helpers import poll
from tests.test_disk_crash import Storm, acknowledged, verify

LAYOUT = BlockLayout(2, 2, 16, 64, "bfloat16", "HKTVND")  # what "cpu/LBHNC" is to the codec
NS = Namespace("crash-lossy", "bfloat16", 2, 2, 64, 16, LAYOUT.block_bytes, layout="cpu/LBHNC", codec="k4v2")
BLOCK = LAYOUT.block_bytes  # 16 KiB: 4 disk pages exact, 1 encoded


def payload(h: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return from_float32(rng.standard_normal(BLOCK // 2).astype(np.float32), "bfloat16")


IMAGES = 16  # how many times a block may have been encoded again (see `images`)
_images: dict[bytes, list[bytes]] = {}


def images(h: bytes) -> list[bytes]:
    """What a block may be served as: its bytes, and the codec's image of them, and of that, ... The codec is
    not idempotent: a block promoted from disk (decoded) whose encoded copy was dropped (a full disk that
    could evict no block) is encoded anew when demoted, from the image."""
    if h not in _images:
        y, out = payload(h), []
        for _ in range(IMAGES + 1):
            out.append(y.tobytes())
            y = decode(encode(y, LAYOUT, Budget.uniform(LAYOUT, 4, 2)), LAYOUT)
        _images[h] = out
    return _images[h]


def served_right(h: bytes, data: np.ndarray) -> bool:
    return data.tobytes() in images(h)


@pytest.mark.slow
def test_kill_9_while_compressing_demotions_and_compactions_then_restart(tmp_path):
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\ncapacity = "4MiB"\npage_size = "4KiB"\n'
                      "[compression]\ndisk = true\n")
    rng = random.Random(77)
    must_serve: list[bytes] = []
    chains: list[list[bytes]] = []
    encoded = compacted = 0
    for round_no in range(4):
        d = start_daemon(tmp_path, "--config", str(config), host_bytes="1MiB", page_bytes="16KiB", disk=True)
        try:
            verify(d.socket_path, must_serve, chains, NS, served_right)
            assert d.check() == []
            stats = d.stats()
            assert stats["tiers"]["disk"]["checksum_failures"] == 0, "a torn block reached the index"
            storm = Storm(d.socket_path, 1000 * (round_no + 1), list(chains), NS, payload, served_right)
            target = rng.randint(30, 120)
            poll(lambda: storm.acked >= target or storm.error is not None, 60, f"{target} acknowledged puts")
            assert storm.error is None, storm.error
            stats = d.stats()
            encoded += sum(r["blocks"] for r in stats["tiers"]["disk"].get("compressed", {}).values())
            compacted += stats["counters"].get("disk_compacted", 0)
            if round_no == 0:  # what `kvstore stats` shows of it
                human = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "stats", "--socket", d.socket_path],
                                       capture_output=True, text=True, timeout=60).stdout
                assert "compressed k4v2@" in human and "stored exact while the encoders were busy:" in human
            d.proc.send_signal(signal.SIGKILL)
            assert d.proc.wait(timeout=30) == -signal.SIGKILL
            storm.thread.join(timeout=30)
            storm.client.close()
            assert storm.wrong == [], "wrong bytes served during the storm"
        finally:
            if d.alive():
                d.stop(signal.SIGKILL)
            d.cleanup()
        chains += storm.chains
        _, must_serve = acknowledged(str(tmp_path / "disk"), NS.id)
        print(f"round {round_no}: {storm.acked} puts, {storm.reads} reads; {len(must_serve)} servable records")
    assert encoded > 0 and must_serve, "the storms never stored an encoded block: the test proves nothing"
    print(f"encoded blocks seen {encoded}, compacted {compacted}")
