"""`kvstore proxy`: the prefill/decode disaggregation proxy, or with --engine a router, in front of
vLLM engines that share the store (the service: server/pd_proxy.py)."""

from __future__ import annotations

import argparse
import logging

from kvstore.server.pd_proxy import ProxyConfig, serve

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", default=[], help="a prefill engine's base URL (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="a decode engine's base URL (repeatable)")
    p.add_argument("--engine", action="append", default=[],
                   help="router mode: an engine's base URL (repeatable; instead of --prefill/--decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=["parallel", "sequential"], default="parallel")
    p.add_argument("--health-interval-s", type=float, default=2.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--connect-timeout-s", type=float, default=3.0,
                   help="connect timeout to an engine, and the time a health check may take")
    p.add_argument("--load-bound", type=float, default=1.25,
                   help="affinity with bounded loads: a session moves off its engine while that engine has more "
                        "than this factor times its share of the requests in flight (0: never)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.mode, args.health_interval_s,
                          connect_timeout_s=args.connect_timeout_s, request_timeout_s=args.request_timeout_s,
                          engines=tuple(args.engine), load_bound=args.load_bound)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    serve(cfg, args.host, args.port)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="prefill/decode disaggregation proxy (or, with --engine, a router) for "
                                     "vLLM engines sharing the store")
    add_arguments(p)
    p.set_defaults(run=run)
