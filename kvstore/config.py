"""Configuration: one frozen dataclass tree, loaded once (defaults < TOML file < flags).

Every value is validated in `__post_init__` with a message a user can act on.
Environment variables are read here and nowhere else:

- KVSTORE_SOCKET: the daemon's Unix socket (clients and `kvstore serve`).
- XDG_RUNTIME_DIR / XDG_STATE_HOME: where the per-user socket and data folders go.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.protocol import metadata_frame_bytes
from kvstore.tokens import TokenScope, read_token_file, scope_from_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a string like "4GiB", "512M", "65536"."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
            return int(float(m.group(1)) * _UNITS[unit])
    raise ConfigError(f"{what}: expected a size such as 4GiB or 65536, got {value!r}")


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "kvstore" if base else Path(f"/tmp/kvstore-{os.getuid()}")


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "kvstore"


def default_socket_path() -> str:
    return os.environ.get("KVSTORE_SOCKET") or str(runtime_dir() / "kvstore.sock")


def instance_file(socket_path: str, name: str, suffix: str) -> str:
    """A file of the instance `name` beside its socket: `<name>.lock`, `<name>.admin-token`.

    The socket's folder is the daemon's private runtime folder (it refuses one that is not
    its own or that others may write), so nothing there can be planted by another user;
    /dev/shm and /tmp are shared and predictable names there can.
    """
    return os.path.join(os.path.dirname(socket_path) or ".", f"{name}{suffix}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_of(choice: str) -> str:
    """The event loop `server.event_loop` runs the daemon on: uvloop (libuv; "auto" where it is
    installed) or asyncio's own. uvloop answers a 32-block lookup 3-9% sooner here
    (docs/benchmarks.md, "The event loop")."""
    if choice == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise ConfigError('server.event_loop = "uvloop", but uvloop is not installed (pip install uvloop)')
        return "asyncio"
    return "uvloop"


@dataclass(frozen=True)
class ServerConfig:
    socket_path: str = field(default_factory=default_socket_path)
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None  # None: no TCP listener
    tcp_token: str | None = field(default=None, repr=False)  # legacy: one token granting everything
    tcp_tokens: tuple[TokenScope, ...] = ()  # scoped tokens (kvstore/tokens.py); --tcp-token-file adds one
    tcp_hello_timeout_s: float = 5.0  # a TCP peer that has not authenticated by then is closed
    tcp_hello_max_frame_bytes: int = 4 * KiB  # the largest frame read before a TCP peer authenticates
    tcp_max_unauthenticated: int = 64  # TCP peers past this many not yet authenticated are closed at once
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 8321  # None: no admin HTTP
    admin_token_file: str = ""  # the admin plane's bearer token, read from here (a Secret); "": a new one each start
    max_frame_bytes: int = 64 * MiB
    max_batch_blocks: int = 8192
    event_loop: str = "auto"  # "auto": uvloop where it is installed, else asyncio's; "uvloop"; "asyncio"

    def __post_init__(self) -> None:
        _require(isinstance(self.socket_path, str) and self.socket_path != "", "server.socket must be a path")
        _require(self.event_loop in EVENT_LOOPS,
                 f"server.event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        _require(len(self.socket_path.encode()) < 104, f"server.socket path too long for AF_UNIX: {self.socket_path}")
        for name in ("tcp_port", "admin_port"):
            port = getattr(self, name)
            _require(port is None or (_is_int(port) and 0 <= port < 65536), f"server.{name} must be 0..65535, got {port!r}")
        _require(_is_int(self.max_frame_bytes) and self.max_frame_bytes >= 4 * KiB, "server.max_frame_bytes must be >= 4KiB")
        _require(_is_int(self.max_batch_blocks) and self.max_batch_blocks >= 1, "server.max_batch_blocks must be >= 1")
        need = metadata_frame_bytes(self.max_batch_blocks)  # else a full batch of hashes could not be sent at all
        _require(self.max_frame_bytes >= need,
                 f"server.max_frame ({self.max_frame_bytes} B) cannot carry a batch of server.max_batch_blocks "
                 f"({self.max_batch_blocks}) hashes: raise max_frame to at least {need} B or lower max_batch_blocks")
        self._check_tcp()

    def _check_tcp(self) -> None:
        if self.tcp_port is not None:
            _require(
                isinstance(self.tcp_token, str) and len(self.tcp_token) >= 16 or bool(self.tcp_tokens),
                "server.tcp_token (at least 16 characters), --tcp-token-file or [[server.tcp_tokens]] "
                "is required when TCP is enabled",
            )
        _require(isinstance(self.tcp_tokens, tuple) and all(isinstance(t, TokenScope) for t in self.tcp_tokens),
                 "server.tcp_tokens must be a list of [[server.tcp_tokens]] tables")
        secrets = [t.token for t in self.token_scopes]
        _require(len(set(secrets)) == len(secrets), "server.tcp_tokens: two entries share a token; give each its own")
        t = self.tcp_hello_timeout_s
        _require(isinstance(t, (int, float)) and not isinstance(t, bool) and 0.1 <= t <= 300,
                 f"server.tcp_hello_timeout must be 0.1..300 seconds, got {t!r}")
        f = self.tcp_hello_max_frame_bytes
        _require(_is_int(f) and 2 * KiB <= f <= self.max_frame_bytes,
                 f"server.tcp_hello_max_frame must be 2KiB..server.max_frame, got {f!r}")
        n = self.tcp_max_unauthenticated
        _require(_is_int(n) and n >= 1, f"server.tcp_max_unauthenticated must be >= 1, got {n!r}")

    @property
    def token_scopes(self) -> tuple[TokenScope, ...]:
        """Every TCP token: the scoped ones, then the legacy `tcp_token` granting everything."""
        legacy = (TokenScope(token=self.tcp_token),) if self.tcp_token is not None else ()
        return self.tcp_tokens + legacy


@dataclass(frozen=True)
class HostConfig:
    capacity_bytes: int = 4 * GiB
    page_bytes: int = 256 * KiB
    shm_path: str = ""  # default: /dev/shm/kvstore-<uid>-<name>
    prefault: bool = True
    # The arena and its placement index outlive the daemon; a restart re-adopts them (tiers/host.py).
    # false: removed at stop, and a SIGTERM writes the host tier down to the disk tier instead.
    persistent: bool = True

    def __post_init__(self) -> None:
        _require(_is_int(self.page_bytes) and self.page_bytes >= 4 * KiB and self.page_bytes % (4 * KiB) == 0,
                 f"host.page_size must be a multiple of 4KiB, got {self.page_bytes!r}")
        _require(_is_int(self.capacity_bytes) and self.capacity_bytes >= self.page_bytes,
                 f"host.capacity must hold at least one page, got {self.capacity_bytes!r}")
        _require(isinstance(self.prefault, bool), "host.prefault must be true or false")
        _require(isinstance(self.persistent, bool), "host.persistent must be true or false")


@dataclass(frozen=True)
class DiskConfig:
    enabled: bool = True
    path: str = ""  # default: <state dir>/<name>/disk
    capacity_bytes: int = 8 * GiB
    page_bytes: int = 64 * KiB  # a new data file's; an existing one keeps the page size it was made with
    # The most blocks it holds (each is indexed in the daemon's memory): "auto" = what a quarter of the
    # host's (or the daemon's cgroup's) memory indexes (kvstore/chain.py `disk_max_blocks`).
    max_blocks: int | str = "auto"
    # Its plain chain blocks kept as rows of bytes, not objects (kvstore/resting.py): ~130 B a block, not ~385.
    rest_blocks: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "disk.enabled must be true or false")
        _require(isinstance(self.rest_blocks, bool), "disk.rest_blocks must be true or false")
        _require(self.max_blocks == "auto" or (_is_int(self.max_blocks) and self.max_blocks >= 1),
                 f"disk.max_blocks must be \"auto\" or a count >= 1, got {self.max_blocks!r}")
        _require(_is_int(self.capacity_bytes) and self.capacity_bytes >= 1 * MiB, "disk.capacity must be >= 1MiB")
        _require(_is_int(self.page_bytes) and self.page_bytes >= 4 * KiB and self.page_bytes % (4 * KiB) == 0,
                 f"disk.page_size must be a multiple of 4KiB, got {self.page_bytes!r}")


@dataclass(frozen=True)
class CompressionConfig:
    """Lossy storage (kvstore/compression.py). Off by default: it changes the KV an engine gets back.
    Applies only to namespaces whose engine opted in (`Namespace.codec` names a profile)."""

    disk: bool = False  # blocks demoted to the disk tier are stored compressed
    remote: bool = False  # blocks published to the remote tier are stored compressed (and found so)
    profile_dir: str = ""  # where `<name>.json` codec profiles are (built-in names need none)
    exact_when_busy: bool = True  # a block demoted while encoding it would hold the disk's writer up is stored exact
    # a GPU reader's encoded disk and remote blocks are expanded on the GPU (Triton) straight into the gpu tier,
    # where there is one; false: decoded on the CPU into the host arena, as for every other reader
    gpu_decode: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.disk, bool), "compression.disk must be true or false")
        _require(isinstance(self.exact_when_busy, bool), "compression.exact_when_busy must be true or false")
        _require(isinstance(self.remote, bool), "compression.remote must be true or false")
        _require(isinstance(self.gpu_decode, bool), "compression.gpu_decode must be true or false")
        _require(isinstance(self.profile_dir, str), "compression.profile_dir must be a path")
        _require(not self.profile_dir or os.path.isdir(self.profile_dir),
                 f"compression.profile_dir {self.profile_dir!r} is not a folder")


@dataclass(frozen=True)
class GpuConfig:
    """The VRAM tier above the host arena. Off by default: it takes `capacity` of each device's memory
    beside the engines. `devices` lists the CUDA devices that get a pool (default: `device`'s);
    `device = "cpu"` runs the same tier in shared memory (tests, CPU-only CI), one pool per entry of
    `devices`."""

    enabled: bool = False
    device: str = "cuda:0"
    devices: tuple = ()
    capacity_bytes: int = 2 * GiB  # per device
    page_bytes: int = 256 * KiB

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "gpu.enabled must be true or false")
        _require(isinstance(self.device, str) and re.fullmatch(r"cuda(:\d+)?|cpu", self.device) is not None,
                 f"gpu.device must be cuda, cuda:N or cpu (emulated), got {self.device!r}")
        devices = self.devices
        _require(isinstance(devices, (list, tuple)) and all(_is_int(d) and 0 <= d < 1024 for d in devices)
                 and len(set(devices)) == len(devices),
                 f"gpu.devices must be a list of distinct device numbers, got {devices!r}")
        object.__setattr__(self, "devices", tuple(devices))
        _require(_is_int(self.page_bytes) and self.page_bytes >= 4 * KiB and self.page_bytes % (4 * KiB) == 0,
                 f"gpu.page_size must be a multiple of 4KiB, got {self.page_bytes!r}")
        _require(_is_int(self.capacity_bytes) and self.capacity_bytes >= self.page_bytes,
                 f"gpu.capacity must hold at least one page, got {self.capacity_bytes!r}")

    def device_names(self) -> list[str]:
        """One torch device per pool: "cuda:N" for each of `devices` (or `device`), or "cpu" per emulated pool."""
        if self.device == "cpu":
            return ["cpu"] * max(1, len(self.devices))
        return [f"cuda:{d}" for d in self.devices] if self.devices else [self.device]


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
TOPIC_FIELDS = ("host", "model", "ns")


@dataclass(frozen=True)
class EventsConfig:
    """KV events in vLLM's format on a ZMQ PUB socket (server/events.py, docs/kv_events.md).
    Off unless `endpoint` is set."""

    endpoint: str | None = None  # e.g. "tcp://127.0.0.1:5557"; "ipc:///path" keeps them to who may open the path
    bind: bool = True  # bind the PUB socket (subscribers connect); false: connect to a subscriber that binds (llm-d)
    replay_endpoint: str | None = None  # a ROUTER socket (always bound) that serves buffered batches from a seq
    topic: str = "kv@{host}@{model}"  # per namespace: {host} (this host's name), {model}, {ns} (namespace id)
    encoding: str = "map"  # "map": events as maps with a "type" key (vLLM 0.32); "array": tagged arrays (older)
    token_ids: bool = True  # ask engines for each block's token ids and publish them (routers hash them)
    tenants: bool = False  # also publish the blocks of TCP tenants' namespaces (their token ids included)
    buffer_batches: int = 10_000  # batches kept for replay
    max_queue_events: int = 100_000  # events waiting for the publisher thread; past it, dropped and resynced
    hwm: int = 100_000  # ZMQ send high-water mark of the PUB socket

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, str) and value.startswith(_ZMQ_SCHEMES),
                     f"events.{name} must be a ZMQ address such as tcp://127.0.0.1:5557 or ipc:///path, got {value!r}")
        _require(self.replay_endpoint is None or self.endpoint is not None,
                 "events.replay_endpoint needs events.endpoint")
        for name in ("bind", "token_ids", "tenants"):
            _require(isinstance(getattr(self, name), bool), f"events.{name} must be true or false")
        _require(self.encoding in ("map", "array"), f"events.encoding must be map or array, got {self.encoding!r}")
        try:
            _require(isinstance(self.topic, str), "events.topic must be a string")
            self.topic.format(**{f: "x" for f in TOPIC_FIELDS})
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"events.topic {self.topic!r}: only {{host}}, {{model}} and {{ns}} may be filled in "
                              f"({type(exc).__name__}: {exc})") from None
        for name in ("buffer_batches", "max_queue_events", "hwm"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"events.{name} must be a positive integer, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


PUBLISH_POLICIES = ("committed", "evicted", "hit", "none")  # when blocks go to the remote tier (kvstore/sharing.py)


@dataclass(frozen=True)
class RemoteConfig:
    """The remote tier: a Mooncake Store cluster shared by the daemons of many hosts (tiers/remote.py,
    kvstore/sharing.py). Off unless `kind = "mooncake"` (or `kvstore serve --remote mooncake://host:port`)."""

    kind: str = ""  # "" (off) or "mooncake"
    master: str = ""  # the mooncake_master's RPC address, host:port or mooncake://host:port
    metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata, etcd://...
    local_hostname: str = ""  # the address peers reach this host's segment at; default: the one that reaches the master
    protocol: str = "tcp"  # tcp, or rdma where the hosts have it
    device_name: str = ""  # RDMA devices ("" = auto)
    segment_bytes: int = 1 * GiB  # DRAM this host contributes to the cluster's pool
    buffer_bytes: int = 64 * MiB  # Mooncake's own transfer buffer
    publish: str = "committed"  # one of PUBLISH_POLICIES
    timeout_s: float = 2.0  # an existence query
    transfer_timeout_s: float = 30.0  # one batch of gets or puts
    connect_timeout_s: float = 2.0  # reaching the master at start
    index_blocks: int = 65536  # remote blocks the local index remembers
    required: bool = True  # false: start without the remote tier (a warning) when the master cannot be used

    def __post_init__(self) -> None:
        _require(self.kind in ("", "mooncake"), f'remote.kind must be "mooncake" (or absent), got {self.kind!r}')
        if self.kind:
            from kvstore.tiers.remote import parse_master

            _require(isinstance(self.master, str) and self.master != "", "remote.master (host:port) is required")
            try:
                parse_master(self.master)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        _require(self.protocol in ("tcp", "rdma", "efa", "cxl"), f"remote.protocol: unknown {self.protocol!r}")
        _require(self.publish in PUBLISH_POLICIES, f"remote.publish must be one of {PUBLISH_POLICIES}, got {self.publish!r}")
        for name in ("timeout_s", "transfer_timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.01 <= v <= 600,
                     f"remote.{name[:-2]} must be 0.01..600 seconds, got {v!r}")
        _require(_is_int(self.segment_bytes) and self.segment_bytes >= 0, "remote.segment_size must be a size")
        _require(_is_int(self.buffer_bytes) and self.buffer_bytes >= 1 * MiB, "remote.buffer_size must be >= 1MiB")
        _require(_is_int(self.index_blocks) and self.index_blocks >= 1, "remote.index_blocks must be >= 1")
        _require(isinstance(self.required, bool), "remote.required must be true or false")

    @property
    def enabled(self) -> bool:
        return bool(self.kind)


@dataclass(frozen=True)
class Config:
    name: str = "default"
    policy: str = "attention"  # eviction/attention.py; lru, lfu, arc, s3fifo are the baselines
    log_level: str = "INFO"
    server: ServerConfig = field(default_factory=ServerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name) is not None,
                 f"name must be 1-64 of [A-Za-z0-9_.-], got {self.name!r}")
        _require(self.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), f"log_level: bad value {self.log_level!r}")
        from kvstore.eviction.base import policy_names

        _require(self.policy in policy_names(), f"policy must be one of {policy_names()}, got {self.policy!r}")

    @property
    def shm_path(self) -> str:
        return self.host.shm_path or f"/dev/shm/kvstore-{os.getuid()}-{self.name}"

    @property
    def lock_path(self) -> str:
        return instance_file(self.server.socket_path, self.name, ".lock")

    @property
    def admin_token_path(self) -> str:
        """Where the admin token is: `server.admin_token_file`, or the file the daemon writes at each start."""
        return self.server.admin_token_file or instance_file(self.server.socket_path, self.name, ".admin-token")

    @property
    def disk_path(self) -> str:
        return self.disk.path or str(state_dir() / self.name / "disk")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# TOML keys -> (section, dataclass field, converter)
_TOML_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "server": {
        "socket": ("socket_path", str),
        "tcp_host": ("tcp_host", str),
        "tcp_port": ("tcp_port", None),
        "tcp_token": ("tcp_token", None),
        "tcp_token_file": ("tcp_tokens", "token_file"),
        "tcp_tokens": ("tcp_tokens", "token_tables"),
        "tcp_hello_timeout": ("tcp_hello_timeout_s", None),
        "tcp_hello_max_frame": ("tcp_hello_max_frame_bytes", "size"),
        "tcp_max_unauthenticated": ("tcp_max_unauthenticated", None),
        "admin_host": ("admin_host", str),
        "admin_port": ("admin_port", None),
        "admin_token_file": ("admin_token_file", str),
        "max_frame": ("max_frame_bytes", "size"),
        "max_batch_blocks": ("max_batch_blocks", None),
        "event_loop": ("event_loop", str),
    },
    "gpu": {
        "enabled": ("enabled", None),
        "device": ("device", str),
        "devices": ("devices", None),
        "capacity": ("capacity_bytes", "size"),
        "page_size": ("page_bytes", "size"),
    },
    "host": {
        "capacity": ("capacity_bytes", "size"),
        "page_size": ("page_bytes", "size"),
        "shm_path": ("shm_path", str),
        "prefault": ("prefault", None),
        "persistent": ("persistent", None),
    },
    "disk": {
        "enabled": ("enabled", None),
        "path": ("path", str),
        "capacity": ("capacity_bytes", "size"),
        "page_size": ("page_bytes", "size"),
        "max_blocks": ("max_blocks", None),
        "rest_blocks": ("rest_blocks", None),
    },
    "remote": {
        "kind": ("kind", str),
        "master": ("master", str),
        "metadata_server": ("metadata_server", str),
        "local_hostname": ("local_hostname", str),
        "protocol": ("protocol", str),
        "device_name": ("device_name", str),
        "segment_size": ("segment_bytes", "size"),
        "buffer_size": ("buffer_bytes", "size"),
        "publish": ("publish", str),
        "timeout": ("timeout_s", None),
        "transfer_timeout": ("transfer_timeout_s", None),
        "connect_timeout": ("connect_timeout_s", None),
        "index_blocks": ("index_blocks", None),
        "required": ("required", None),
    },
    "compression": {"disk": ("disk", None), "remote": ("remote", None), "profile_dir": ("profile_dir", str),
                    "exact_when_busy": ("exact_when_busy", None), "gpu_decode": ("gpu_decode", None)},
    "events": {key: (key, None) for key in (
        "endpoint", "bind", "replay_endpoint", "topic", "encoding", "token_ids", "tenants", "buffer_batches",
        "max_queue_events", "hwm")},
}
_TOP_KEYS = {"name", "policy", "log_level"}


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then `overrides` ("section.key" or top-level key -> value)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        (raw.setdefault(section, {}) if section else raw)[key] = value
    return _build(raw)


def _token_scopes(kind: str, value: Any) -> tuple[TokenScope, ...]:
    if kind == "token_file":  # --tcp-token-file: one token granting everything, kept out of argv
        return (TokenScope(token=read_token_file(value, "server.tcp_token_file"), name="tcp_token_file"),)
    if not isinstance(value, list):
        raise ConfigError("server.tcp_tokens must be an array of tables: [[server.tcp_tokens]]")
    return tuple(scope_from_table(table, i) for i, table in enumerate(value))


def _build(raw: dict[str, Any]) -> Config:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {s: {} for s in _TOML_KEYS}
    for key, value in raw.items():
        if key in _TOML_KEYS:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            for sub, v in value.items():
                if sub not in _TOML_KEYS[key]:
                    raise ConfigError(f"unknown key {key}.{sub}; known: {', '.join(sorted(_TOML_KEYS[key]))}")
                fname, conv = _TOML_KEYS[key][sub]
                if conv in ("token_file", "token_tables"):  # both add to tcp_tokens
                    sections[key][fname] = sections[key].get(fname, ()) + _token_scopes(conv, v)
                else:
                    sections[key][fname] = parse_size(v, f"{key}.{sub}") if conv == "size" else v
        elif key in _TOP_KEYS:
            top[key] = value
        else:
            raise ConfigError(f"unknown config key {key!r}; known: {', '.join(sorted(_TOP_KEYS | set(_TOML_KEYS)))}")
    try:
        return Config(
            server=ServerConfig(**sections["server"]),
            gpu=GpuConfig(**sections["gpu"]),
            host=HostConfig(**sections["host"]),
            disk=DiskConfig(**sections["disk"]),
            remote=RemoteConfig(**sections["remote"]),
            events=EventsConfig(**sections["events"]),
            compression=CompressionConfig(**sections["compression"]),
            **top,
        )
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
