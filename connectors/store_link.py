"""A connector's link to the daemon: one KVClient, dropped on failure, reconnected later.

The engine must never fail because the store does. Every call goes through
`StoreLink.run(fn)`: if the daemon is down, times out or answers with an error,
the call returns None (the caller treats it as a miss / skipped save), a
warning is logged once per outage, and the client is discarded. The next call
after `retry_s` builds a fresh client, which maps the (possibly new) arena and
re-registers the namespace; on success an info line says the store is back.

A fresh client per connection matters: a restarted daemon creates a new arena,
and extents handed out by the old one must never be read from the new mapping.
Extents are only ever used on the connection that produced them (the worker
pins what it copies with its own client), so a stale mapping is never read.

No vLLM imports here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from kvstore.client import SPIN_US, KVClient
from kvstore.errors import DaemonUnavailable, KVStoreError
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from kvstore.connectors.vllm_meta import ConnectorConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreLink:
    def __init__(
        self,
        socket_path: str,
        namespaces: list[Namespace],
        timeout_s: float,
        retry_s: float,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        spin_us: float = SPIN_US,
    ) -> None:
        self.socket_path = socket_path
        self.spin_us = spin_us  # KVClient's: how long a call polls for its reply before it sleeps
        self.namespaces = namespaces
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.name = name
        self._clock = clock
        self._client: KVClient | None = None
        self.ns_ids: list[str] = []
        self._next_try = 0.0
        self._down = False  # an outage was reported and not yet recovered
        self.generation = 0  # bumped per new connection: pins belong to one generation
        self.num_failures = 0
        self._posted: list[tuple[int, str, KVClient]] = []  # requests sent whose replies are read later

    @classmethod
    def of(cls, config: "ConnectorConfig", namespaces: list[Namespace], name: str) -> "StoreLink":
        """A connector side's link, as its config says: socket, timeout, retry and spin."""
        return cls(config.socket_path, namespaces, config.timeout_s, config.retry_s, name, spin_us=config.spin_us)

    # -- connection -----------------------------------------------------------------
    def client(self) -> KVClient | None:
        """A connected client with namespaces registered, or None while the daemon is away."""
        if self._client is not None:
            return self._client
        if self._clock() < self._next_try:
            return None
        try:
            client = KVClient(self.socket_path, timeout_s=self.timeout_s, name=self.name, spin_us=self.spin_us)
            try:
                self.ns_ids = [client.register(ns) for ns in self.namespaces]
            except BaseException:
                client.close()
                raise
        except KVStoreError as exc:
            self._failed(exc)
            return None
        self._client = client
        self.generation += 1
        if self._down:
            log.warning("kvstore: daemon at %s is back; %s uses the store again", self.socket_path, self.name)
            self._down = False
        return client

    def run(self, what: str, fn: Callable[[KVClient], T]) -> T | None:
        """fn(client), or None if the daemon is away or the call failed.

        A failure that closed the connection (daemon gone, timeout, bad frame)
        drops the client; an error reply on a live connection keeps it (and
        with it this connection's pins).
        """
        client = self.client()
        if client is None:
            return None
        try:
            self._drain(client)
            return fn(client)
        except KVStoreError as exc:
            if client.connected and not isinstance(exc, DaemonUnavailable):
                self.num_failures += 1
                log.warning("kvstore: %s failed (%s: %s)", what, type(exc).__name__, exc)
            else:
                self._failed(exc, what)
            return None

    def post(self, what: str, op: str, **args) -> None:
        """Send a request whose reply nobody waits for now (a release at a step's end): the reply is read,
        and an error logged, before the next call on this connection. Nothing is sent while the daemon is away."""
        client = self.client()
        if client is None:
            return
        try:
            self._posted.append((client.send(op, **args), what, client))
        except KVStoreError as exc:
            self._failed(exc, what)

    def _drain(self, client: KVClient) -> None:
        posted, self._posted = self._posted, []
        for msgid, what, sent_on in posted:
            if sent_on is not client:
                continue  # that connection is gone, and its reply with it
            try:
                client.wait(msgid)
            except KVStoreError as exc:
                if not client.connected or isinstance(exc, DaemonUnavailable):
                    raise
                self.num_failures += 1
                log.warning("kvstore: %s failed (%s: %s)", what, type(exc).__name__, exc)

    def _failed(self, exc: KVStoreError, what: str = "connect") -> None:
        self.num_failures += 1
        if self._client is not None:
            self._client.close()
        self._client = None
        self._next_try = self._clock() + self.retry_s
        if not self._down:
            self._down = True
            log.warning(
                "kvstore: daemon unavailable (%s: %s: %s); %s computes without the store and retries every %g s",
                what, type(exc).__name__, exc, self.name, self.retry_s,
            )

    @property
    def wants_tokens(self) -> bool:
        """Whether the daemon publishes KV events with token ids (then commits should carry them)."""
        events = self._client.server_info.get("events") if self._client is not None else None
        return bool(events and events.get("token_ids"))

    @property
    def arena(self):
        return None if self._client is None else self._client.arena

    def close(self) -> None:
        if self._client is not None:
            try:
                self._drain(self._client)
            except KVStoreError:
                pass  # closing anyway
            self._client.close()
        self._client = None
