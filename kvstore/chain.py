"""Build the store's chain of tiers from a `Config`: `[gpu]`, `[host]`, `[disk]` (later `[remote]`).

The host arena is always in the chain. Any other tier that is absent (not
enabled, no CUDA, no torch) is simply left out, and the reason is kept for the
stats (`stats()["tiers"][name]["absent"]`); the daemon runs either way.
"""

from __future__ import annotations

import logging

from kvstore.config import Config
from kvstore.store import TieredStore
from tiers.base import Tier
from kvstore.errors import OwnershipError
from tiers.host import ArenaRefused, HostArena

log = logging.getLogger(__name__)


def gpu_tier(config: Config) -> tuple[Tier | None, str]:
    """The GPU pool the config asks for, or (None, why not)."""
    gc = config.gpu
    if not gc.enabled:
        return None, "disabled in the config ([gpu] enabled = false)"
    try:
        from tiers.gpu import CudaUnavailable, GpuPool
    except ImportError as exc:  # pragma: no cover - the module itself imports nothing heavy
        return None, f"the gpu tier cannot be imported: {exc}"
    try:
        pool = GpuPool(gc.device, gc.capacity_bytes, gc.page_bytes)
    except (CudaUnavailable, ImportError, RuntimeError) as exc:
        return None, str(exc)
    if pool.device.type != "cuda":
        log.warning("gpu tier on %s: an emulated device (for tests); engines cannot map it", pool.device)
    return pool, ""


def open_store(config: Config) -> TieredStore:
    """The daemon's store: the tiers the config enables, fastest first."""
    absent: dict[str, str] = {}
    chain: list[Tier] = []
    gpu, why = gpu_tier(config)
    if gpu is None:
        absent["gpu"] = why
    else:
        chain.append(gpu)
    hc = config.host
    try:
        host = HostArena(config.shm_path, hc.capacity_bytes, hc.page_bytes, hc.prefault, persistent=hc.persistent)
    except ArenaRefused as exc:
        raise OwnershipError(str(exc)) from None
    chain.append(host)
    if gpu is not None and gpu.device.type == "cuda":
        from tiers.gpu import pin_host

        pinned = pin_host(host.buf)  # gpu <-> host copies become asynchronous DMA; pageable if it fails
        if not pinned.pinned:
            log.warning("host arena not pinned for the gpu tier: %s", pinned.reason)
    if config.disk.enabled:
        from tiers.disk import DiskTier  # lmdb: only where the disk tier is used

        chain.append(DiskTier(config.disk_path, config.disk.capacity_bytes))
    else:
        absent["disk"] = "disabled in the config ([disk] enabled = false, or --no-disk)"
    absent["remote"] = "not configured"
    for name, reason in absent.items():
        log.info("%s tier not in the chain: %s", name, reason)
    return TieredStore(chain, policy=config.policy, absent=absent)
