"""`kvstore top`: a live view of the daemon, refreshed every second, from its admin plane's /stats.

Shows the hit ratio (last 10 s and since start) overall and per tier, blocks
and bytes per tier against capacity, requests per second by op, evictions,
demotions and promotions per second, sessions, and the busiest namespaces.
Rates are taken over the samples of the last WINDOW_S seconds. `q` quits
(the terminal is put in cbreak mode while it runs, and restored). Works
against a remote daemon: `--url http://host:port --token-file F` (the daemon
answers Host names of loopback and its configured admin_host only).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
import urllib.error
import urllib.request
from collections import deque

from kvstore.config import default_socket_path, instance_file
from kvstore.server.instance import read_admin_token

WINDOW_S = 10.0
TOP_NAMESPACES = 5


class TopError(Exception):
    """The admin plane cannot be asked: one line for the user."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="live view of hits, tiers, ops and namespaces (q quits)")
    p.add_argument("--url", default="http://127.0.0.1:8321", help="the daemon's admin URL")
    p.add_argument("--token-file", help="admin token file (default: <socket folder>/<name>.admin-token)")
    p.add_argument("--name", default="default", help="the daemon's instance name, for the default token file")
    p.add_argument("--socket", help="the daemon's socket path, for the default token file's folder")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one view (two samples, --interval apart) and exit")
    p.set_defaults(run=run)


class Source:
    """GET /stats with the bearer token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/") + "/stats"
        self.token = token

    def fetch(self) -> dict:
        req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=3) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                body = json.loads(body).get("message", body)
            except ValueError:
                pass
            raise TopError(f"the admin plane at {self.url} answered {exc.code}: {body}") from None
        except (OSError, ValueError) as exc:
            raise TopError(f"cannot reach the admin plane at {self.url}: {getattr(exc, 'reason', exc)}") from None


# -- numbers -------------------------------------------------------------------------------------
def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(samples: deque) -> dict:
    """What the view shows, from (monotonic time, /stats) samples, oldest first."""
    t1, now = samples[-1]
    t0, old = samples[0]
    dt = t1 - t0

    def rate(get) -> float | None:
        return (get(now) - get(old)) / dt if dt > 0 else None

    c = lambda s, k: s["counters"].get(k, 0)  # noqa: E731
    asked = lambda s: c(s, "hit_blocks") + c(s, "miss_blocks")  # noqa: E731
    d_asked = asked(now) - asked(old)
    tiers = {}
    for name, t in now["tiers"].items():
        if "absent" in t:
            continue
        before = old["tiers"].get(name, t)
        tiers[name] = {
            "blocks": t["blocks"], "bytes": t["bytes"], "capacity": t.get("capacity_bytes"),
            "hit_recent": _ratio(t["hits"] - before["hits"], d_asked), "hit_total": _ratio(t["hits"], asked(now)),
            "evictions": rate(lambda s, n=name: s["tiers"][n]["evictions"]),
            "demotions": rate(lambda s, n=name: s["tiers"][n].get("demotions_in", 0)),
            "promotions": rate(lambda s, n=name: s["tiers"][n].get("promotions_in", 0)),
        }
    ops = {op: rate(lambda s, o=op: s.get("ops", {}).get(o, 0)) for op in now.get("ops", {})}
    busiest = []
    for ns_id, ns in now.get("by_namespace", {}).items():
        was = old.get("by_namespace", {}).get(ns_id, {"counters": {}})
        delta = lambda k: ns["counters"].get(k, 0) - was["counters"].get(k, 0)  # noqa: E731
        moved = delta("hit_blocks") + delta("miss_blocks") + delta("put_blocks")
        busiest.append((moved, ns_id, ns, {k: delta(k) / dt if dt > 0 else None
                                           for k in ("hit_blocks", "miss_blocks", "put_blocks")}))
    busiest.sort(key=lambda x: (-x[0], -sum(x[2]["blocks"].values())))
    return {
        "hit_recent": _ratio(c(now, "hit_blocks") - c(old, "hit_blocks"), d_asked),
        "hit_total": _ratio(c(now, "hit_blocks"), asked(now)),
        "asked_per_s": d_asked / dt if dt > 0 else None, "window_s": dt, "tiers": tiers, "ops": ops,
        "namespaces": busiest[:TOP_NAMESPACES], "sessions": now.get("sessions", 0), "policy": now.get("policy"),
        "chain": now.get("chain", []), "blocks": now.get("blocks", 0),
    }


# -- rendering ------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _per_s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def render(view: dict, url: str, error: str | None = None):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"kvstore top  {url}  policy {view['policy']}  chain {' -> '.join(view['chain'])}  "
                f"blocks {view['blocks']}  sessions {view['sessions']}  window {view['window_s']:.0f} s", style="bold")
    hits = Table(title="hit ratio (blocks asked for)", title_justify="left")
    for col in ("", "last 10 s", "total"):
        hits.add_column(col, justify="right")
    hits.add_row("all tiers", _pct(view["hit_recent"]), _pct(view["hit_total"]))
    for name, t in view["tiers"].items():
        hits.add_row(name, _pct(t["hit_recent"]), _pct(t["hit_total"]))
    hits.add_row("asked/s", _per_s(view["asked_per_s"]), "")
    tiers = Table(title="tiers", title_justify="left")
    for col in ("tier", "blocks", "bytes", "capacity", "used", "evict/s", "demote in/s", "promote in/s"):
        tiers.add_column(col, justify="right")
    for name, t in view["tiers"].items():
        used = _pct(t["bytes"] / t["capacity"]) if t["capacity"] else "-"
        tiers.add_row(name, f"{t['blocks']:,}", _size(t["bytes"]), _size(t["capacity"]), used,
                      _per_s(t["evictions"]), _per_s(t["demotions"]), _per_s(t["promotions"]))
    ops = Table(title="requests/s", title_justify="left")
    ranked = sorted(view["ops"].items(), key=lambda x: -(x[1] or 0))
    for op, _ in ranked:
        ops.add_column(op, justify="right")
    ops.add_row(*(_per_s(r) for _, r in ranked))
    spaces = Table(title="busiest namespaces", title_justify="left")
    for col in ("model", "namespace", "blocks", "hits/s", "misses/s", "puts/s"):
        spaces.add_column(col, justify="right" if col not in ("model", "namespace") else "left")
    for _, ns_id, ns, r in view["namespaces"]:
        spaces.add_row(ns["model"][-40:], ns_id, f"{sum(ns['blocks'].values()):,}", _per_s(r["hit_blocks"]),
                       _per_s(r["miss_blocks"]), _per_s(r["put_blocks"]))
    parts = [head, hits, tiers, ops, spaces, Text("q quits", style="dim")]
    if error:
        parts.insert(1, Text(f"stale: {error}", style="bold red"))
    return Group(*parts)


# -- the loop -------------------------------------------------------------------------------------
def _token(args: argparse.Namespace) -> str:
    path = args.token_file or instance_file(args.socket or default_socket_path(), args.name, ".admin-token")
    try:
        return read_admin_token(path)
    except Exception as exc:  # missing, or not private: read_admin_token says which
        raise TopError(f"cannot read the admin token {path}: {exc} (give --token-file)") from None


class Keys:
    """Single key presses on a terminal (cbreak mode, restored on exit); nothing when stdin is not one."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self._saved = None

    def __enter__(self) -> "Keys":
        if self.fd is not None:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait(self, timeout_s: float) -> str:
        """Sleep up to timeout_s; the keys pressed meanwhile."""
        if self.fd is None:
            time.sleep(timeout_s)
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        return os.read(self.fd, 32).decode(errors="ignore") if ready else ""


def run(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("kvstore: `kvstore top` needs rich (pip install 'kvstore[tools]')", file=sys.stderr)
        return 1
    try:
        source = Source(args.url, _token(args))
        samples: deque = deque([(time.monotonic(), source.fetch())])
        if args.once:
            time.sleep(args.interval)
            samples.append((time.monotonic(), source.fetch()))
            Console().print(render(summarize(samples), args.url))
            return 0
        return _live(args, source, samples, Console(), Live)
    except TopError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _live(args: argparse.Namespace, source: Source, samples: deque, console, Live) -> int:
    error = None
    with Keys() as keys, Live(render(summarize(samples), args.url), console=console, auto_refresh=False) as live:
        next_at = time.monotonic() + args.interval
        while True:
            if "q" in keys.wait(next_at - time.monotonic()).lower():
                return 0
            if time.monotonic() < next_at:
                continue
            next_at = max(next_at + args.interval, time.monotonic())
            try:
                samples.append((time.monotonic(), source.fetch()))
                error = None
            except TopError as exc:
                error = str(exc)
            while len(samples) > 2 and samples[-1][0] - samples[1][0] >= WINDOW_S:
                samples.popleft()
            live.update(render(summarize(samples), args.url, error), refresh=True)
