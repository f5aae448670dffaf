"""Who may do what on a data-plane connection: the `Grant` a session gets at hello.

A Unix-socket session is granted everything: the socket is mode 0600, so its
peers run as the daemon's user. A TCP session is granted the scope of the token
it presented (kvstore/tokens.py says why scopes name models and tenants) and
works in the tenant it declared. Before hello a session is granted nothing.

Invariants:
- every op is in OP_CLASS, or it is refused to a scoped session (fail closed: a
  new op is unreachable over TCP until someone decides its class);
- a scoped session names only namespaces whose model its token lists, and, when
  it declared a tenant, only that tenant's namespaces;
- every namespace a session with a tenant registers carries that tenant;
- a token check compares against every configured token in constant time, so
  timing says nothing about which token came close.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvstore.errors import AuthError, PermissionDenied
from kvstore.keys import Namespace
from kvstore.tokens import TokenScope, valid_tenant

# op -> the classes any one of which allows it; () = every authenticated session
OP_CLASS: dict[str, tuple[str, ...]] = {
    "hello": (), "ping": (),
    "register": ("read", "write"),
    "lookup": ("read",), "acquire": ("read",), "release": ("read",), "get": ("read",),
    "wait": ("read",), "expect": ("write",), "withdraw": ("write",),
    "reserve": ("write",), "commit": ("write",), "abort": ("write",), "put": ("write",),
    "stats": ("admin",), "blocks": ("admin",), "remove": ("admin",), "describe": ("admin",),
}


@dataclass(frozen=True, slots=True)
class Grant:
    scope: TokenScope | None  # None: everything (a Unix-socket peer)
    tenant: str | None  # None: no tenant declared (the shared partition, or every one for a "*" scope)

    @property
    def unrestricted(self) -> bool:
        return self.scope is None and self.tenant is None

    def check_op(self, op: str) -> None:
        if self.scope is None:
            return
        classes = OP_CLASS.get(op)
        if classes is None or classes and not set(classes) & set(self.scope.ops):
            need = " or ".join(classes) if classes else "a class for it"
            raise PermissionDenied(f"token {self.scope.name!r} does not grant {op} (needs {need}; it has "
                                   f"{', '.join(self.scope.ops)})")

    def may_use(self, ns: Namespace) -> bool:
        if self.tenant is not None and ns.tenant != self.tenant:
            return False
        return self.scope is None or self.scope.allows_model(ns.model)

    def check_namespace(self, ns: Namespace) -> None:
        if self.tenant is not None and ns.tenant != self.tenant:
            raise PermissionDenied(f"namespace {ns.id} belongs to another tenant than this session's ({self.tenant!r})")
        if self.scope is not None and not self.scope.allows_model(ns.model):
            raise PermissionDenied(f"token {self.scope.name!r} does not grant model {ns.model!r}")

    def stamp(self, fields: dict) -> dict:
        """A namespace's fields as this session registers them: in its tenant, whatever it asked for."""
        asked = fields.get("tenant", "")
        if self.tenant is None:
            return fields  # a "*" scope (or a Unix peer) may name any tenant's partition
        if asked not in ("", self.tenant):
            raise PermissionDenied(f"this session is tenant {self.tenant!r}; it cannot register for {asked!r}")
        return {**fields, "tenant": self.tenant}


def unix_grant(tenant: str | None) -> Grant:
    return Grant(None, _checked_tenant(tenant))


def authenticate(scopes: tuple[TokenScope, ...], token: str | None, tenant: str | None) -> Grant:
    """The grant for a TCP hello; AuthError when the token or the tenant is not allowed."""
    match = None
    presented = (token or "").encode()
    for scope in scopes:  # no early exit: every comparison runs whether or not one matched
        if hmac.compare_digest(presented, scope.token.encode()) and token is not None:
            match = scope
    if match is None:
        raise AuthError("bad or missing token")
    tenant = _checked_tenant(tenant)
    if tenant is None and not match.any_tenant:
        raise AuthError(f"token {match.name!r} is for tenants {list(match.tenants)}; declare one at hello (tenant=...)")
    if tenant is not None and not match.allows_tenant(tenant):
        raise AuthError(f"token {match.name!r} does not grant tenant {tenant!r}")
    return Grant(match, tenant)


def _checked_tenant(tenant: str | None) -> str | None:
    if tenant is not None and not valid_tenant(tenant):
        raise AuthError("a tenant label is 1-128 of [A-Za-z0-9_.:@/+=-]")
    return tenant
