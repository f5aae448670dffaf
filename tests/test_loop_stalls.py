"""The event loop's stalls (server/stalls.py `LoopStalls`): counted by a tick on the loop, located by a
watchdog thread, on a loop in this process."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from types import FrameType

from kvstore.server import stalls as stalls_mod
from kvstore.server.stalls import LoopStalls


def _hold_the_loop(seconds: float) -> None:
    """A turn that keeps the loop (and the GIL, but for the interpreter's switches) for `seconds`."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def test_a_turn_that_holds_the_loop_is_counted_and_located_and_short_ones_are_not(caplog):
    """A turn of 0.4 s is one stall of ~0.4 s, and the watchdog names the function that held the loop,
    and where the other threads were, in the log (while it held it) and in the stats; turns of a few
    milliseconds count for nothing."""

    done = threading.Event()

    def waits_beside() -> None:
        done.wait()

    beside = threading.Thread(target=waits_beside, name="beside-the-loop")
    beside.start()

    async def run() -> dict:
        stalls = LoopStalls(asyncio.get_running_loop())
        try:
            for _ in range(10):  # short turns: under STALL_S
                _hold_the_loop(0.005)
                await asyncio.sleep(0.02)
            assert stalls.stalls == 0 and stalls.recent == type(stalls.recent)()
            _hold_the_loop(0.4)
            await asyncio.sleep(0.05)  # (the tick after it)
            frame = sys._current_frames()[stalls._watchdog.ident]  # (waiting for its next wake-up)
            while frame.f_code.co_name != "_watch":
                frame = frame.f_back
            watching = frame.f_locals
            del frame
            kept = [v for v in watching.values() if isinstance(v, FrameType)
                    or isinstance(v, dict) and any(isinstance(x, FrameType) for x in v.values())]
            assert not kept, "the watchdog keeps frames (and so their locals) after a stall"
            return stalls.stats()
        finally:
            stalls.close()

    with caplog.at_level(logging.WARNING, logger="kvstore.daemon"):
        try:
            got = asyncio.run(run())
        finally:
            done.set()
            beside.join()
    assert got["stalls"] == 1 and 380 <= got["longest_ms"] < 1000 and got["total_s"] >= 0.38
    (stall,) = got["recent"]
    assert stall["ms"] == got["longest_ms"] and "_hold_the_loop" in stall["where"], stall
    assert "tests/test_loop_stalls.py" in stall["where"]
    assert "waits_beside" in stall["threads"]["beside-the-loop"]  # (and where the other threads were)
    assert "event loop held for" in caplog.text and "_hold_the_loop" in caplog.text


def test_a_stall_the_watchdog_cannot_see_into_is_counted_all_the_same(monkeypatch):
    """A turn the watchdog does not see (here: it looks only past 10 s) is still counted by the tick,
    and its place is given as not seen."""
    monkeypatch.setattr(stalls_mod, "LOG_S", 0.2)
    monkeypatch.setattr(stalls_mod, "WATCH_S", 10.0)

    async def run() -> dict:
        stalls = LoopStalls(asyncio.get_running_loop())
        try:
            _hold_the_loop(0.3)
            await asyncio.sleep(0.05)
            return stalls.stats()
        finally:
            stalls.close()

    got = asyncio.run(run())
    assert got["stalls"] == 1 and got["recent"][0]["where"].startswith("not seen")


def test_where_names_the_package_s_frames_first():
    """`where` gives the innermost frames of the kvstore package, innermost first (here the store's clock,
    which called the test's); a stack without any gives its innermost frames outside the standard
    library."""
    import sys

    from kvstore.entry import BurstClock

    def here() -> str:
        return stalls_mod.where(sys._getframe())

    assert here().startswith("tests/test_loop_stalls.py:") and " here < tests/test_loop_stalls.py:" in here()
    seen = BurstClock(here)()
    assert seen.startswith("kvstore/entry.py:") and seen.endswith(" __call__") and "tests/" not in seen, seen


def test_bench_gil_times_the_loop_s_transaction_alone_and_beside_a_hashing_thread(capsys):
    """tools/bench/bench_gil.py runs small: the transaction alone, then beside a thread that yields the GIL
    never or every HASH_YIELD_EVERY blocks, at CPython's interval and the daemon's."""
    from kvstore.tools.bench.bench_gil import main

    assert main(["--rounds", "2", "--deletes", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and "alone" in lines[1] and all("x alone" in line for line in lines[1:])
    assert sum("blocks/s" in line for line in lines) == 4
