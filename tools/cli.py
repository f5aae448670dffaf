"""The `kvstore` command. Each subcommand lives in a module with `register(subparsers)`
and `run(args) -> int`; COMMAND_MODULES lists them. Logging is configured here only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

COMMAND_MODULES = [f"kvstore.tools.{name}" for name in ("serve_cmd", "stats_cmd", "blocks_cmd", "inspect_cmd", "top_cmd",
                                                          "events_cmd", "replay", "gen_trace", "proxy_cmd")]


def version() -> str:
    """The installed distribution's version (a source checkout that was never installed says so)."""
    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache store for LLM inference engines.")
    parser.add_argument("--version", action="version", version=f"kvstore {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", None) or "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
