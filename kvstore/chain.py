"""Build the store's chain of tiers from a `Config`: `[gpu]`, `[host]`, `[disk]`, `[remote]`.

The host arena is always in the chain. Any other tier that is absent (not
enabled, no CUDA, no torch) is simply left out, and the reason is kept for the
stats (`stats()["tiers"][name]["absent"]`); the daemon runs either way. A remote
tier that is configured but cannot be used (Mooncake not installed, master
unreachable) stops the start with a clear error, unless `[remote] required =
false`: then it is left out with a warning.
"""

from __future__ import annotations

import logging
import os

from kvstore.compression import Compression, decode_into
from kvstore.config import Config
from kvstore.errors import ConfigError, OwnershipError
from kvstore.sharing import SharingOptions
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.host import ArenaRefused, HostArena

log = logging.getLogger(__name__)

# What the daemon's memory holds of a block it indexes, at most (bench_scale.py: 183 B a block at 10^7 and 355
# at 10^6 with the disk's blocks at rest, kvstore/resting.py, 409-598 as objects; a restarted daemon 373 at
# 10^7 and 482 at 10^6 while it recovers), and the share of the host's memory the disk tier's blocks may
# take by default (`[disk] max_blocks`).
INDEX_BYTES_PER_BLOCK = 600
INDEX_MEMORY_SHARE = 0.25


def memory_limit(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The memory this process may use: the host's (MemTotal), or less where its cgroup (v2, or v1's
    memory controller) sets a limit on the way up to the root; None where neither can be read."""
    limits = []
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
        with open(os.path.join(proc, "self", "cgroup")) as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f]
    except (OSError, ValueError):
        groups = []
    for _, controllers, path in groups:
        if controllers == "":  # cgroup v2: memory.max of each group up to the root
            folder, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            folder, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(folder, *parts[:depth], name)) as f:
                    value = f.read().strip()
            except OSError:
                continue
            if value.isdigit():  # ("max": none)
                limits.append(int(value))
    return min(limits) if limits else None


def disk_max_blocks(config: Config, limit: int | None = None) -> int | None:
    """The disk tier's `max_blocks`: the config's, or ("auto") what INDEX_MEMORY_SHARE of `limit` (default:
    `memory_limit()`) indexes at INDEX_BYTES_PER_BLOCK; None (no cap) where no limit is known."""
    if config.disk.max_blocks != "auto":
        return config.disk.max_blocks
    limit = memory_limit() if limit is None else limit
    return None if limit is None else max(1, int(limit * INDEX_MEMORY_SHARE) // INDEX_BYTES_PER_BLOCK)


def gpu_tier(config: Config) -> tuple[Tier | None, str]:
    """The GPU tier the config asks for (one pool per device, allocated now for the daemon's life),
    or (None, why not)."""
    gc = config.gpu
    if not gc.enabled:
        return None, "disabled in the config ([gpu] enabled = false)"
    try:
        from kvstore.tiers.gpu import CudaUnavailable, GpuPool, GpuTier
    except ImportError as exc:  # pragma: no cover - the module itself imports nothing heavy
        return None, f"the gpu tier cannot be imported: {exc}"
    pools: list = []
    try:
        for k, device in enumerate(gc.device_names()):
            shm = f"{config.shm_path}.gpu{k}" if device == "cpu" else None
            pools.append(GpuPool(device, gc.capacity_bytes, gc.page_bytes, shm_path=shm))
    except (CudaUnavailable, ImportError, RuntimeError, OSError) as exc:
        for pool in pools:
            pool.close()
        return None, str(exc)
    if gc.device == "cpu":
        log.warning("gpu tier emulated in shared memory (%d pool(s)): for tests, no GPU is used", len(pools))
    return GpuTier(pools), ""


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
    try:
        if gpu is not None and gpu.device.type == "cuda":
            from kvstore.tiers.gpu import pin_host

            pinned = pin_host(host.buf)  # gpu <-> host copies become asynchronous DMA; pageable if it fails
            if not pinned.pinned:
                log.warning("host arena not pinned for the gpu tier: %s", pinned.reason)
        if config.disk.enabled:
            from kvstore.tiers.disk import DiskTier  # lmdb: only where the disk tier is used

            disk = DiskTier(config.disk_path, config.disk.capacity_bytes, config.disk.page_bytes,
                            decoder=decode_into, max_blocks=disk_max_blocks(config))
            chain.append(disk)
            if disk.max_blocks < disk.num_pages:  # (small blocks: its pages hold more than the memory indexes)
                log.info("disk tier: at most %d blocks (their index ~%.1f GiB of memory); [disk] max_blocks sets it",
                         disk.max_blocks, disk.max_blocks * INDEX_BYTES_PER_BLOCK / 2**30)
        else:
            absent["disk"] = "disabled in the config ([disk] enabled = false, or --no-disk)"
        remote, why = remote_tier(config, host)
        if remote is None:
            absent["remote"] = why
        else:
            chain.append(remote)
        for name, reason in absent.items():
            log.info("%s tier not in the chain: %s", name, reason)
        rc = config.remote
        sharing = SharingOptions(rc.publish, rc.timeout_s, rc.transfer_timeout_s)
        return TieredStore(chain, policy=config.policy, absent=absent, sharing=sharing,
                           compression=Compression(config.compression), recover_in_background=True,
                           rest=config.disk.rest_blocks)
    except BaseException:
        _give_back(chain, host)
        raise


def _give_back(chain: list[Tier], host: HostArena) -> None:
    """A start that failed after its tiers were opened (a required remote out of reach, a disk
    refused): close them, and remove a host arena this start created. It never held a block, and
    prefaulted it would keep its whole size of RAM in /dev/shm; an adopted one is kept for the next
    start, as a stop would keep it."""
    for tier in reversed(chain):
        try:
            if tier is host:
                host.close(unlink=not host.adopted)
            else:
                tier.close()
        except Exception:  # the start's own error is the one to report
            log.exception("closing the %s tier after a failed start", tier.name)


def remote_tier(config: Config, host: HostArena) -> tuple[Tier | None, str]:
    """The Mooncake tier the config asks for, or (None, why not); raises ConfigError when it is
    required and cannot be had."""
    rc = config.remote
    if not rc.enabled:
        return None, "not configured"
    from kvstore.tiers.remote import MooncakeTier, RemoteUnavailable

    try:
        return MooncakeTier(rc.master, host, metadata_server=rc.metadata_server, local_hostname=rc.local_hostname,
                            protocol=rc.protocol, device_name=rc.device_name, segment_bytes=rc.segment_bytes,
                            buffer_bytes=rc.buffer_bytes, index_blocks=rc.index_blocks,
                            connect_timeout_s=rc.connect_timeout_s, decoder=decode_into), ""
    except RemoteUnavailable as exc:
        if rc.required:
            raise ConfigError(f"remote tier: {exc} (set [remote] required = false to start without it)") from None
        log.warning("remote tier left out: %s", exc)
        return None, str(exc)
