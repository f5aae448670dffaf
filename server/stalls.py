"""The event loop's stalls: how long a turn held it, and where.

Every request waits for the event loop, so a turn that holds it for long stalls every client at once, and
from outside that looks like the network or the clients. At millions of blocks a few steps take that long
whatever their code: a dictionary of millions of keys grows by rebuilding its table in one call (0.33 s
at 5.6 million keys on a 2-core VM, each time it doubles), and the loop serves nothing meanwhile.
`LoopStalls` sees a stall from both sides:

- a tick every `TICK_S` on the loop: how late each comes is how long the loop was held (`stats`: the
  stalls of at least `STALL_S`, their total and the longest);
- a watchdog thread, every `WATCH_S`: once the loop has not ticked for `LOG_S`, it takes the loop
  thread's stack and the other threads' (`sys._current_frames`) and logs where they are, once a stall,
  with the time so far. A stall in Python code is caught in the act (the interpreter hands the GIL to
  the watchdog within its switch interval); one in a C call that keeps the GIL (a table's rebuild) lets
  the watchdog in only when it returns, so the line it names is the one that made the call, or the
  next. A loop waiting for the GIL (its LMDB call returned while another thread holds it) is seen at
  that call, and the thread that held it at the line after its own.

The latest stalls past `LOG_S`, with where each was seen, are kept (`RECENT` of them) for `/stats`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
import threading
import time
from collections import deque

log = logging.getLogger("kvstore.daemon")

TICK_S = 0.01  # the loop's tick: ~100 callbacks a second, a few microseconds each
STALL_S = 0.05  # a tick this late or later counts as a stall
LOG_S = 0.1  # a stall this long is located and logged (a request waiting for it waits 1,000x a lookup's time)
WATCH_S = 0.05  # the watchdog's wake-ups (each takes the GIL for a few microseconds)
RECENT = 8  # the latest stalls past LOG_S kept for `stats`, with where each was seen
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the kvstore package: its frames first
_STDLIB = sysconfig.get_paths()["stdlib"]


def where(frame, depth: int = 4) -> str:
    """`frame`'s place, innermost first: its innermost frames of the kvstore package (up to `depth`), as
    `path:line function` joined by " < "; where none is the package's, its innermost frames outside the
    standard library, or else its innermost frame."""
    ours, others, first = [], [], None
    while frame is not None and len(ours) < depth:
        code = frame.f_code
        path = os.path.abspath(code.co_filename)
        text = f"{os.path.relpath(path, os.path.dirname(_HERE))}:{frame.f_lineno} {code.co_name}"
        first = first or text
        if path.startswith(_HERE):
            ours.append(text)
        elif not path.startswith(_STDLIB) and len(others) < depth:
            others.append(text)
        frame = frame.f_back
    return " < ".join(ours or others) or first or "?"


class LoopStalls:
    """The stalls of the running loop it is made on (`close` ends its tick and its watchdog)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ident = threading.get_ident()  # (made on the loop's thread)
        self.stalls = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self.recent: deque = deque(maxlen=RECENT)  # (ms, where, the other threads' places) past LOG_S, latest last
        self._seen: tuple | None = None  # where the watchdog saw the loop and the others in the stall under way
        self._last = time.monotonic()  # the latest tick
        self._handle = loop.call_later(TICK_S, self._tick)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kvstore-loop-watchdog", daemon=True)
        self._watchdog.start()

    def _tick(self) -> None:
        now = time.monotonic()
        late = now - self._last - TICK_S
        self._last = now
        if late >= STALL_S:
            self.stalls += 1
            self.total_s += late
            self.longest_s = max(self.longest_s, late)
            if late >= LOG_S:
                seen, self._seen = self._seen, None
                at, beside = seen or ("not seen (a C call that kept the GIL)", {})
                self.recent.append((round(late * 1e3, 1), at, beside))
                log.warning("event loop held %.0f ms (at %s)", late * 1e3, at)
        self._handle = self._loop.call_later(TICK_S, self._tick)

    def _watch(self) -> None:
        logged_for = None  # the tick whose stall was logged already
        while not self._stop.wait(WATCH_S):
            last = self._last
            held = time.monotonic() - last
            if held < LOG_S or logged_for == last:
                continue
            seen = self._places()
            if seen is None or self._last != last:  # (the stall ended meanwhile: the tick has counted it)
                continue
            self._seen, logged_for = seen, last
            log.warning("event loop held for %.0f ms so far, at %s; the other threads at: %s", held * 1e3, seen[0],
                        "; ".join(f"{name} {at}" for name, at in seen[1].items()) or "none")

    def _places(self) -> tuple[str, dict] | None:
        """Where the loop's thread is, and each other thread (their names): text only, so that no frame
        outlives the call (a frame kept keeps its locals, a finished scan's records among them)."""
        frames = sys._current_frames()
        frame = frames.get(self._ident)
        if frame is None:
            return None
        me = threading.get_ident()
        return where(frame), {t.name: where(frames[t.ident], 2) for t in threading.enumerate()
                              if t.ident in frames and t.ident not in (self._ident, me)}

    def stats(self) -> dict:
        return {"stalls": self.stalls, "total_s": round(self.total_s, 3), "longest_ms": round(self.longest_s * 1e3, 1),
                "recent": [{"ms": ms, "where": at, "threads": beside} for ms, at, beside in self.recent]}

    def close(self) -> None:
        self._handle.cancel()
        self._stop.set()
        self._watchdog.join()
