"""What many tests share: a test namespace, hash chains and payloads, waiting for a condition, raw frames.

(Fixtures for a daemon in its own process are in tests/conftest.py; what benchmarks share with the
tests is in tools/harness/.)
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable, Sequence

import msgpack
import numpy as np

from kvstore.keys import Namespace, hash_blocks
from kvstore.tools.harness.remote_env import free_port  # noqa: F401  (a test helper too)

KiB = 1024


def namespace(model: str = "test-model", block_bytes: int = 64 * KiB, dtype: str = "bfloat16",
              block_tokens: int = 16) -> Namespace:
    """The shape most tests use (2 layers, 2 KV heads of 64); a test names its model and block size."""
    return Namespace(model, dtype, 2, 2, 64, block_tokens, block_bytes)


def chain_hashes(seed: int, n: int, stride: int = 100_000, block_tokens: int = 16) -> list[bytes]:
    """The block hashes of an n-block prompt whose tokens start at seed * stride: distinct seeds give
    distinct chains (while n * block_tokens < stride)."""
    return hash_blocks(np.arange(n * block_tokens) + seed * stride, block_tokens)


def parents(hashes: Sequence[bytes]) -> list[bytes | None]:
    """Each block's parent in a chain: None for the root."""
    return [None, *hashes[:-1]]


def chain(seed: int, n: int, stride: int = 100_000) -> tuple[list[bytes], list[bytes | None]]:
    """(hashes, parents) of a chain (`chain_hashes`)."""
    hs = chain_hashes(seed, n, stride)
    return hs, parents(hs)


def payload_for(h: bytes, nbytes: int) -> np.ndarray:
    """A block's payload, derived from its hash: what a reader must get back."""
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Whether `cond()` came true within `timeout_s` (asked every 50 ms, and once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def poll(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait (every 5 ms) until `cond()`; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def frame(obj) -> bytes:
    """A data-plane frame as the protocol has it (kvstore/protocol.py), built by hand."""
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def payload_bytes(h: bytes, nbytes: int) -> bytes:
    """`payload_for`, as bytes (what a tier's `read` returns)."""
    return payload_for(h, nbytes).tobytes()


def put_one_by_one(store, ns_id: str, hashes: Sequence[bytes], nbytes: int, parent: bytes | None = None,
                   owner: str = "w") -> int:
    """A chain put into a `TieredStore` one block per reserve and commit (a tiny host tier evicts on each),
    each block's `payload_bytes` written; how many were stored."""
    stored, prev = 0, parent
    for h in hashes:
        (e,) = store.reserve(ns_id, [(h, prev)], owner)
        prev = h
        if e is not None:
            store.host.write(e.location, payload_bytes(h, nbytes))
            store.commit(ns_id, [h], owner)
            stored += 1
    return stored


def hold_scans(monkeypatch, scan_class: type) -> threading.Event:
    """Make each record scan of `scan_class` (tiers/record_scan.py) wait until the returned event is set
    (at most 30 s): a test's store serves while a tier's records are being read."""
    event = threading.Event()
    scan = scan_class._scan

    def held(self):
        event.wait(30)
        return scan(self)

    monkeypatch.setattr(scan_class, "_scan", held)
    return event
