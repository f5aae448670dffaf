"""`kvstore serve`: run the daemon with embedded defaults, a TOML file (--config) and flags.

Secrets do not belong in argv: every local user can read /proc/<pid>/cmdline.
`--tcp-token-file` (or `[[server.tcp_tokens]] token_file = ...` in the TOML file)
keeps the TCP token out of it; `--tcp-token` still works and logs a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvstore.config import event_loop_of, load_config, parse_size
from kvstore.errors import ConfigError, KVStoreError

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML file; flags override it")
    p.add_argument("--name", help="instance name (arena and data folder names)")
    p.add_argument("--socket", help="Unix socket path")
    p.add_argument("--host-bytes", help="host tier size, e.g. 4GiB")
    p.add_argument("--page-bytes", help="host tier page size, e.g. 256KiB")
    p.add_argument("--no-prefault", action="store_true", help="do not prefault the arena")
    p.add_argument("--no-persistent-host", action="store_true",
                   help="remove the arena at stop instead of keeping it for the next start (a SIGTERM then "
                        "writes the host tier down to the disk tier)")
    p.add_argument("--tcp-port", type=int, help="also listen on TCP (needs --tcp-token-file or [[server.tcp_tokens]])")
    p.add_argument("--tcp-host", help="TCP bind address (default 127.0.0.1)")
    p.add_argument("--tcp-token-file", help="file holding a token that grants TCP clients everything")
    p.add_argument("--tcp-token", help="like --tcp-token-file, but the secret shows in the process list (avoid)")
    p.add_argument("--admin-port", type=int, help="admin HTTP port (0 = any free port)")
    p.add_argument("--no-admin", action="store_true", help="no admin HTTP listener")
    p.add_argument("--disk-path", help="disk tier folder")
    p.add_argument("--disk-bytes", help="disk tier size, e.g. 8GiB")
    p.add_argument("--no-disk", action="store_true", help="no disk tier")
    p.add_argument("--gpu-bytes", help="turn the GPU tier on with this much VRAM per device, e.g. 8GiB")
    p.add_argument("--gpu-devices", help="CUDA devices that get a pool, e.g. 0,1 (default: cuda:0)")
    p.add_argument("--gpu-device", help="cuda, cuda:N, or cpu (the tier emulated in shared memory, for tests)")
    p.add_argument("--gpu-page-bytes", help="GPU tier page size, e.g. 256KiB")
    p.add_argument("--remote", metavar="mooncake://HOST:PORT",
                   help="share blocks with other hosts through this Mooncake master ([remote] in the config)")
    p.add_argument("--policy", help="eviction policy")
    p.add_argument("--events-endpoint", help="publish KV events on this ZMQ address, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--events-replay-endpoint", help="ZMQ ROUTER address serving missed KV-event batches")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--check-config", action="store_true",
                   help="validate the config file and flags, print the effective settings as JSON (secrets left "
                        "out) and what this host may lack for them, and start nothing (exit 2: a bad configuration)")
    p.set_defaults(run=run)


def overrides_from(args: argparse.Namespace) -> dict:
    size = lambda v, what: None if v is None else parse_size(v, what)  # noqa: E731
    return {
        "name": args.name,
        "policy": args.policy,
        "log_level": args.log_level,
        "server.socket": args.socket,
        "server.tcp_port": args.tcp_port,
        "server.tcp_host": args.tcp_host,
        "server.tcp_token": args.tcp_token,
        "server.tcp_token_file": args.tcp_token_file,
        "server.admin_port": args.admin_port,
        "host.capacity": size(args.host_bytes, "--host-bytes"),
        "host.page_size": size(args.page_bytes, "--page-bytes"),
        "host.prefault": False if args.no_prefault else None,
        "host.persistent": False if args.no_persistent_host else None,
        "gpu.enabled": True if args.gpu_bytes else None,
        "gpu.capacity": size(args.gpu_bytes, "--gpu-bytes"),
        "gpu.devices": _devices(args.gpu_devices),
        "gpu.device": args.gpu_device,
        "gpu.page_size": size(args.gpu_page_bytes, "--gpu-page-bytes"),
        "disk.path": args.disk_path,
        "disk.capacity": size(args.disk_bytes, "--disk-bytes"),
        "disk.enabled": False if args.no_disk else None,
        "remote.kind": "mooncake" if args.remote else None,
        "remote.master": args.remote,
        "events.endpoint": args.events_endpoint,
        "events.replay_endpoint": args.events_replay_endpoint,
    }


def _devices(text: str | None) -> list | None:
    if text is None:
        return None
    try:
        return [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise ConfigError(f"--gpu-devices takes device numbers like 0,1; got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides_from(args))
        if args.no_admin:
            import dataclasses

            config = dataclasses.replace(config, server=dataclasses.replace(config.server, admin_port=None))
    except ConfigError as exc:
        print(f"kvstore: bad configuration: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        return check_config(config)
    logging.getLogger().setLevel(config.log_level)
    if args.tcp_token is not None:
        log.warning("--tcp-token puts the secret in this process's command line (/proc/%d/cmdline), which every "
                    "local user can read; use --tcp-token-file or [[server.tcp_tokens]] token_file instead",
                    os.getpid())
    from kvstore.server.daemon import serve

    try:
        return serve(config)
    except (OSError, ValueError, KVStoreError) as exc:  # KVStoreError: e.g. a socket folder others can write
        print(f"kvstore: cannot start: {exc}", file=sys.stderr)
        return 1


def effective_settings(config) -> dict:
    """The configuration as the daemon would run it, with the paths it derives and no secret in it."""
    out = config.to_dict()
    server = out["server"]
    if server.get("tcp_token"):
        server["tcp_token"] = "(set)"
    server["tcp_tokens"] = [{k: v for k, v in scope.items() if k != "token"} for scope in server["tcp_tokens"]]
    out["derived"] = {"shm_path": config.shm_path, "disk_path": config.disk_path, "lock": config.lock_path,
                      "admin_token": config.admin_token_path}
    return out


def host_warnings(config) -> list[str]:
    """What this host lacks for the configuration (the daemon would fail or run short), without changing it."""
    from kvstore.tokens import read_token_file

    warnings = []
    folder = os.path.dirname(config.server.socket_path) or "."
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "/"
    if not os.access(parent, os.W_OK | os.X_OK):
        warnings.append(f"the socket folder {folder} cannot be created or written here (its nearest existing "
                        f"parent {parent} is not writable by this user)")
    shm = os.path.dirname(config.shm_path)
    if os.path.isdir(shm):
        free = os.statvfs(shm)
        if free.f_bavail * free.f_frsize < config.host.capacity_bytes and not os.path.exists(config.shm_path):
            warnings.append(f"{shm} has {free.f_bavail * free.f_frsize >> 20} MiB free, the host tier needs "
                            f"{config.host.capacity_bytes >> 20} MiB (a container's /dev/shm: a memory-backed volume)")
    else:
        warnings.append(f"{shm} does not exist: the host tier's arena cannot be made there")
    if config.disk.enabled:
        parent = config.disk_path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent) or "/"
        if not os.access(parent, os.W_OK | os.X_OK):
            warnings.append(f"the disk tier's folder {config.disk_path} cannot be made here ({parent} is not writable)")
    if config.server.admin_token_file and config.server.admin_port is not None:
        try:
            read_token_file(config.server.admin_token_file, "server.admin_token_file")
        except ConfigError as exc:
            warnings.append(str(exc))
    try:
        event_loop_of(config.server.event_loop)
    except ConfigError as exc:
        warnings.append(str(exc))
    return warnings


def check_config(config) -> int:
    """--check-config: the effective settings on stdout, what the host lacks on stderr; exit 0."""
    import json

    print(json.dumps(effective_settings(config), indent=1, default=str))
    for w in host_warnings(config):
        print(f"kvstore: warning: {w}", file=sys.stderr)
    return 0

