"""TCP token scopes: which models, tenants and operations a token grants.

Why a token is scoped, and why a tenant is more than a cache_salt
------------------------------------------------------------------
A block's key is its namespace and its chained hash. cache_salt is mixed into block
0's hash (kvstore/keys.py, `ExtraKeys`), so two tenants' chains never collide.
But the daemon only ever sees hashes: it cannot tell which salt a block was made
with, and whoever can name a hash (from a `blocks` listing, or by recomputing it
from a prompt and a salt that is not secret) could read or remove the block.
Salts separate; they do not authorise.

So the daemon keeps tenants apart itself. A TCP client presents a token and
declares a tenant label at hello; the token must list that label (or "*"). Every
namespace the session registers is stamped with the tenant (`Namespace.tenant`),
which is part of the namespace id: the same model's blocks of two tenants live
under two ids, and a session may only name namespaces of its own tenant whose
model its token lists. Knowing another tenant's hashes, salt or namespace id is
then worth nothing. Inside a tenant, cache_salt separates requests as before.

Operations come in three classes (server/auth.py maps each op to one):
`read` (register, lookup, get, release), `write` (register, put, commit, abort)
and `admin` (blocks, remove, stats: they reach across namespaces and tenants).

Invariants (checked in `TokenScope.__post_init__`):
- a token is 16..1024 characters, no control characters; no two scopes share one
  (ServerConfig checks that);
- `ops` is a non-empty subset of OPS; `namespaces` is a non-empty list of model
  patterns (fnmatch; "*" = any model);
- `tenants` is a non-empty list of labels, or ["*"]: any label, or none at all,
  which is the shared partition local engines use (a multi-tenant engine's token);
- a secret never shows in a repr; it comes from a file or the TOML file.
  `--tcp-token` (argv, visible in /proc/<pid>/cmdline) still works, with a warning.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from kvstore.errors import ConfigError

log = logging.getLogger(__name__)

OPS = ("read", "write", "admin")
ANY = "*"
_TOKEN = re.compile(r"[^\x00-\x1f\x7f]{16,1024}")  # no control characters (a file's newline is stripped)
_TENANT = re.compile(r"[A-Za-z0-9_.:@/+=-]{1,128}")
_TABLE_KEYS = {"name", "token", "token_file", "namespaces", "tenants", "ops"}


@dataclass(frozen=True)
class TokenScope:
    """One TCP token and what it grants. The defaults grant everything (the legacy `tcp_token`)."""

    token: str = field(repr=False)
    name: str = "tcp_token"
    namespaces: tuple[str, ...] = (ANY,)
    tenants: tuple[str, ...] = (ANY,)
    ops: tuple[str, ...] = OPS

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ConfigError(f"server.tcp_tokens: name must be a non-empty string, got {self.name!r}")
        what = f"server.tcp_tokens {self.name!r}"
        if not (isinstance(self.token, str) and _TOKEN.fullmatch(self.token)):
            raise ConfigError(f"{what}: a token must be 16 to 1024 characters, none of them control characters")
        _want_strings(self.namespaces, f"{what}: namespaces (model names or patterns such as \"llama-*\")")
        _want_strings(self.ops, f"{what}: ops (some of {', '.join(OPS)})")
        if not set(self.ops) <= set(OPS):
            raise ConfigError(f"{what}: unknown ops {sorted(set(self.ops) - set(OPS))}; known: {', '.join(OPS)}")
        _want_strings(self.tenants, f"{what}: tenants (labels, or [\"*\"] for any)")
        if ANY in self.tenants and len(self.tenants) > 1:
            raise ConfigError(f"{what}: tenants is either [\"*\"] or a list of labels, not both")
        bad = [t for t in self.tenants if t != ANY and not _TENANT.fullmatch(t)]
        if bad:
            raise ConfigError(f"{what}: tenant labels are 1-128 of [A-Za-z0-9_.:@/+=-], got {bad}")

    @property
    def any_tenant(self) -> bool:
        return self.tenants == (ANY,)

    def allows_model(self, model: str) -> bool:
        return any(fnmatchcase(model, pattern) for pattern in self.namespaces)

    def allows_tenant(self, tenant: str) -> bool:
        return self.any_tenant or tenant in self.tenants


def valid_tenant(label: Any) -> bool:
    return isinstance(label, str) and _TENANT.fullmatch(label) is not None


def _want_strings(values: Any, what: str) -> None:
    if not (isinstance(values, tuple) and values and all(isinstance(v, str) and v for v in values)):
        raise ConfigError(f"{what} must be a non-empty list of non-empty strings")


def read_token_file(path: Any, what: str) -> str:
    """The secret in `path` (surrounding whitespace dropped); warns when others may read the file."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{what}: expected a file path, got {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read token file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: token file {path} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(f"{what}: token file {path} is empty")
    if mode & 0o077:
        log.warning("%s: token file %s is readable by other users (mode %o); chmod 600 it", what, path, mode & 0o777)
    return secret


def scope_from_table(table: Any, index: int) -> TokenScope:
    """A `[[server.tcp_tokens]]` table: token or token_file, namespaces, ops (required); name, tenants."""
    what = f"server.tcp_tokens[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{what} must be a table ([[server.tcp_tokens]])")
    unknown = set(table) - _TABLE_KEYS
    if unknown:
        raise ConfigError(f"{what}: unknown keys {sorted(unknown)}; known: {', '.join(sorted(_TABLE_KEYS))}")
    if ("token" in table) == ("token_file" in table):
        raise ConfigError(f"{what}: give exactly one of token_file (preferred) or token")
    for key in ("namespaces", "ops"):  # no default: a scoped token says what it grants
        if key not in table:
            raise ConfigError(f"{what}: {key} is required (e.g. {key} = {['*'] if key == 'namespaces' else ['read']})")
    name = table.get("name", f"tcp_tokens[{index}]")
    token = read_token_file(table["token_file"], what) if "token_file" in table else table["token"]
    return TokenScope(token=token, name=name, namespaces=_as_tuple(table["namespaces"], f"{what}.namespaces"),
                      tenants=_as_tuple(table.get("tenants", [ANY]), f"{what}.tenants"),
                      ops=_as_tuple(table["ops"], f"{what}.ops"))


def _as_tuple(value: Any, what: str) -> tuple:
    if not isinstance(value, list):
        raise ConfigError(f"{what} must be a list, got {value!r}")
    return tuple(value)
