"""The `kvstore` command. Each subcommand lives in a module with `register(subparsers)`
and `run(args) -> int`; COMMAND_MODULES lists them. Logging is configured here only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = ["tools.serve_cmd", "tools.stats_cmd", "tools.blocks_cmd", "tools.inspect_cmd", "tools.top_cmd",
                   "tools.events_cmd", "tools.replay", "tools.gen_trace", "tools.proxy_cmd"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache store for LLM inference engines.")
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
