"""The `kvstore` command. Each subcommand lives in a module with `register(subparsers)`
and `run(args) -> int`; COMMANDS maps each command to its module. A command line that names one
imports only that module (`kvstore serve` does not load the proxy's or the replay's, a quarter of a
second of the daemon's start); help and errors load them all. Logging is configured here only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {"serve": "serve_cmd", "stats": "stats_cmd", "ls": "blocks_cmd", "evict": "blocks_cmd",
            "inspect": "inspect_cmd", "top": "top_cmd", "events": "events_cmd", "replay": "replay",
            "gen-trace": "gen_trace", "proxy": "proxy_cmd"}
COMMAND_MODULES = [f"kvstore.tools.{name}" for name in dict.fromkeys(COMMANDS.values())]


def version() -> str:
    """The installed distribution's version (a source checkout that was never installed says so)."""
    import importlib.metadata  # (here: ~25 ms that every other command line, a restart's too, need not pay)

    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _Version(argparse.Action):
    """`--version`, looked up when it is asked for, not when the parser is built."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str = "show the version and exit") -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"kvstore {version()}")  # (on stdout, as argparse's own version action)
        parser.exit()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: with only its command's subparser when its first word is a command
    (the options before it take no value), else with every command's."""
    parser = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache store for LLM inference engines.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    command = next((a for a in argv or () if not a.startswith("-")), None)
    modules = [f"kvstore.tools.{COMMANDS[command]}"] if command in COMMANDS else COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", None) or "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
