"""Shared fixtures: a real daemon in its own process, and clients for it; stores and arenas in process.

`store_factory` and `arena_factory` build the object under test over real tiers (an arena in /dev/shm,
a disk tier under the test's tmp_path) and, at teardown, close whatever the test left open and remove
every arena they named, so no /dev/shm file outlives a test, even one that fails.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostArena, remove_stale_arena
from kvstore.tools.harness.daemon_proc import ROOT, DaemonProc, start_daemon  # noqa: F401  (start_daemon: used by tests)


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon(tmp_path)
    yield d
    if d.alive():
        assert d.stop() == 0
    d.cleanup()


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def make(*extra: str, **kw) -> DaemonProc:
        d = start_daemon(tmp_path, *extra, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.alive():
            d.stop(signal.SIGTERM, timeout=30)  # kills it if it does not exit in time
        d.cleanup()


@pytest.fixture
def arena_factory():
    """`make(capacity_bytes, page_bytes, path=None, prefault=True, persistent=False)`: a `HostArena` at
    `path`, or at a new unique path in /dev/shm. Teardown closes the arenas still mapped (a store's
    close unmaps its arena) and removes every path, kept ones too."""
    arenas: list[HostArena] = []
    paths: list[str] = []

    def make(capacity_bytes: int, page_bytes: int, path: str | None = None, prefault: bool = True,
             persistent: bool = False) -> HostArena:
        path = path or f"/dev/shm/kvtest-{uuid.uuid4().hex}"
        paths.append(path)  # before the arena exists: a half-made one is removed too
        arena = HostArena(path, capacity_bytes, page_bytes, prefault=prefault, persistent=persistent)
        arenas.append(arena)
        return arena

    yield make
    for arena in arenas:
        if arena.buf is not None:
            arena.close()
    for path in dict.fromkeys(paths):
        remove_stale_arena(path)


@pytest.fixture
def store_factory(arena_factory, tmp_path):
    """`make(capacity_bytes, page_bytes, *, arena=None, prefault=True, persistent=False, disk_bytes=None,
    disk_page_bytes=None, staging_bytes=None, gpu=None, **store_kw)`: a `TieredStore` over a host arena
    (`arena_factory`: a new one, or the one kept at path `arena`), a disk tier in tmp_path/disk where
    `disk_bytes` is given (the same folder each time: a store made again reopens it; its page size
    `page_bytes` unless given) and the test's own gpu tier where it passes one. `store_kw` are
    `TieredStore`'s keywords (policy, clock, recover_in_background, ...). The tiers are
    `store.host`, `store.disk`, `store.tiers`. Teardown closes every store the test did not close."""
    stores: list[TieredStore] = []

    def make(capacity_bytes: int, page_bytes: int, *, arena: str | None = None, prefault: bool = True,
             persistent: bool = False, disk_bytes: int | None = None, disk_page_bytes: int | None = None,
             staging_bytes: int | None = None, gpu: Tier | None = None, **store_kw) -> TieredStore:
        host = arena_factory(capacity_bytes, page_bytes, arena, prefault, persistent)
        disk = None
        try:
            if disk_bytes is not None:
                sizes = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
                disk = DiskTier(str(tmp_path / "disk"), disk_bytes, disk_page_bytes or page_bytes, **sizes)
            store = TieredStore([t for t in (gpu, host, disk) if t is not None], **store_kw)
        except BaseException:
            if disk is not None:  # the arena is closed by arena_factory's teardown
                disk.close()
            raise
        stores.append(store)
        return store

    yield make
    for store in stores:
        if store.host.buf is not None:  # its arena is still mapped: the test did not close it
            store.close(persist=False)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA and `vllm` tests without vLLM, saying why."""
    import importlib.util

    have_vllm = importlib.util.find_spec("vllm") is not None
    have_cuda = False
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        pass
    for item in items:
        if "vllm" in item.keywords and not have_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed (pip install -e .[vllm])"))
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))


os.environ.setdefault("PYTHONPATH", str(ROOT))
