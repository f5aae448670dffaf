"""The exception tree. Callers never see integer status codes; a miss is `None`.

Every error that crosses the wire carries its class name, so the client
re-raises the same class the daemon raised (see `ERRORS_BY_NAME`).
"""


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class CapacityError(KVStoreError):
    """A tier cannot make room: everything left is pinned, uncommitted or not a leaf."""


class TierIOError(KVStoreError):
    """Reading or writing a tier's backing storage failed."""


class ConfigError(KVStoreError):
    """A configuration value is invalid; the message says which and why."""


class ProtocolError(KVStoreError):
    """A malformed frame or request: bad length, bad msgpack, unknown op, wrong types."""


class NamespaceError(KVStoreError):
    """An unknown namespace id, or a payload that does not fit the namespace."""


class AuthError(KVStoreError):
    """A TCP client presented no token or the wrong one."""


class PermissionDenied(AuthError):
    """The session's token does not grant this operation, model or tenant (kvstore/tokens.py)."""


class DaemonUnavailable(KVStoreError):
    """The daemon cannot be reached (not running, socket gone, timed out)."""


class ShuttingDown(DaemonUnavailable):
    """The daemon is draining (SIGTERM): the request was not served; retry on its successor."""


class OwnershipError(KVStoreError):
    """A socket folder, lock, arena or daemon belongs to another user, or others may write it:
    refused, never used. The message names the path (or peer), its owner and its mode."""


ERRORS_BY_NAME: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (
        KVStoreError,
        CapacityError,
        TierIOError,
        ConfigError,
        ProtocolError,
        NamespaceError,
        AuthError,
        PermissionDenied,
        DaemonUnavailable,
        ShuttingDown,
    )
}
