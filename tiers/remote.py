"""The remote tier: blocks shared between hosts through a Mooncake Store cluster.

Each daemon is one Mooncake client (`mooncake.store.MooncakeDistributedStore`):
it contributes `segment_bytes` of its DRAM to the cluster's pool and reads and
writes objects anywhere in it, over TCP on CPU hosts (RDMA where present). The
cluster's `mooncake_master` owns placement, leases and eviction (approximate
LRU at a 0.90 high watermark); this tier never evicts remote objects, it only
forgets what it knew of them.

What this module does, all of it blocking (kvstore/sharing.py calls it from
its own threads, never from the event loop):
- names objects: `kvstore/v1/<namespace id>/<block hash hex>`. The namespace id
  already digests model, dtype, layout, TP rank and tenant (kvstore/keys.py),
  so two hosts with the same model share and nothing else does;
- frames values: a 64-byte header (magic, version, flags, payload length,
  xxh3_64 of the payload, a digest of the namespace id, the block's hash and its
  parent's hash) followed by the payload. A value whose header or checksum does
  not match what the reader expects (torn, foreign, an older layout) is a miss;
- stores a block compressed where the store hands it a codec
  (`[compression] remote = true`, kvstore/compression.py): the value is the
  encoded block (flag ENCODED), under its own key, the exact key with the codec
  profile's digest appended (`.../<hash hex>.<digest>`), so a reader asks for
  exactly the blocks it can decode and an exact block and a lossy one are never
  one object. The put thread encodes (on up to ENCODE_THREADS threads); the get
  thread verifies the encoded bytes, then `decoder` expands them into the
  arena's pages. Encoded values travel through registered bounce buffers;
- moves bytes zero-copy between the host arena and the cluster
  (`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` on the
  arena's page extents, the arena and a header region registered once);
- keeps the store's bookkeeping of *remote entries*: blocks another host
  published that a lookup found here (`kvstore/sharing.py`). They take no local
  bytes; `index_blocks` bounds how many the index remembers (its policy evicts
  the rest, which only forgets them).

The tier is last in the chain and takes no demotions (`accepts_demotions`):
what reaches the cluster is decided by the publish policy, not by local
eviction (kvstore/sharing.py).

Loading: the wheel's shared objects need libibverbs (even for TCP). Where the
system lacks it, `tools/dev setup` unpacks the Debian packages into
`.cache/sysroot`; `load_mooncake` preloads them from there or from
$KVSTORE_MOONCAKE_LIBS (folders, colon-separated) before importing mooncake.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import socket
import struct
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

import numpy as np
import xxhash

from kvstore.tiers.base import ENCODE_THREADS, CompressedTally, Tier

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
HEADER = struct.Struct("<4sHHQQQ16s16s")  # magic, version, flags, nbytes, checksum, ns digest, hash, parent
HEADER_BYTES = HEADER.size  # 64
MAGIC, VERSION = b"KVSR", 1
ENCODED = 1  # header flag: the payload is an encoded block (kvstore/codec.py), not the block's bytes
NO_PARENT = bytes(16)
BOUNCE_BYTES = 32 << 20  # a registered buffer for encoded values, per kind of call (grown for a bigger block)
ALREADY_EXISTS = -705  # Mooncake's code for a put of a key someone else put first: the block is there
_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")  # dependency order


class RemoteUnavailable(RuntimeError):
    """The remote tier cannot be used: not installed, master unreachable, setup refused, or an
    operation that failed or timed out."""


@dataclass(frozen=True, slots=True)
class RemoteRef:
    """Where a remote entry's bytes are: its object key, and what its header must say. `codec` is the
    tag (`name@digest`) of the codec its value is encoded with, `stored` the value's size and
    `logical` the block's; None, 0 and 0 for an exact block."""

    key: str
    ns_id: str
    hash: bytes
    parent: bytes | None
    codec: str | None = None
    stored: int = 0
    logical: int = 0  # an encoded block's decoded size


def object_key(ns_id: str, block_hash: bytes, codec_digest: str = "") -> str:
    """The block's object name; an encoded block's ends with its codec profile's digest."""
    key = f"kvstore/v1/{ns_id}/{bytes(block_hash).hex()}"
    return f"{key}.{codec_digest}" if codec_digest else key


def _ns_digest(ns_id: str) -> int:
    return xxhash.xxh3_64_intdigest(ns_id.encode())


def pack_header(ref: RemoteRef, nbytes: int, checksum: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, ENCODED if ref.codec else 0, nbytes, checksum, _ns_digest(ref.ns_id),
                       bytes(ref.hash), bytes(ref.parent) if ref.parent is not None else NO_PARENT)


def header_checksum(raw, ref: RemoteRef, nbytes: int) -> int | None:
    """The payload checksum the header announces, or None when the header is not this block's."""
    magic, version, flags, n, checksum, ns, h, parent = HEADER.unpack(bytes(raw[:HEADER_BYTES]))
    want_parent = bytes(ref.parent) if ref.parent is not None else NO_PARENT
    want = (MAGIC, VERSION, ENCODED if ref.codec else 0, nbytes, _ns_digest(ref.ns_id), bytes(ref.hash), want_parent)
    if (magic, version, flags, n, ns, h, parent) != want:
        return None
    return checksum


def payload_checksum(segments: Sequence[np.ndarray]) -> int:
    hasher = xxhash.xxh3_64()
    for seg in segments:
        hasher.update(seg)
    return hasher.intdigest()


# -- locating the wheel's parts ------------------------------------------------------
def library_dirs() -> list[str]:
    """Folders holding libibverbs and its dependencies when the system lacks them."""
    env = os.environ.get("KVSTORE_MOONCAKE_LIBS")
    if env:
        return [d for d in env.split(":") if d]
    sysroot = ROOT / ".cache" / "sysroot"
    return [str(p) for p in (sysroot / "usr/lib/x86_64-linux-gnu", sysroot / "lib/x86_64-linux-gnu") if p.is_dir()]


def subprocess_env() -> dict:
    """An environment for the wheel's binaries (`mooncake_master`) that finds the libraries."""
    env = dict(os.environ)
    dirs = library_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join(dirs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    return env


def master_binary() -> str:
    """The `mooncake_master` the wheel installs beside this interpreter's scripts."""
    for cand in (os.path.join(sysconfig.get_path("scripts"), "mooncake_master"), shutil.which("mooncake_master")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RemoteUnavailable("mooncake_master not found: pip install 'kvstore[remote]' (the Mooncake wheel ships it)")


_load_lock = threading.Lock()


def load_mooncake():
    """`mooncake.store`, with libibverbs preloaded from `library_dirs()` where the system has none."""
    with _load_lock:
        for name in _LIBS:
            for folder in library_dirs():
                path = os.path.join(folder, name)
                if os.path.exists(path):
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    break
        try:
            from mooncake import store as mc_store
        except ImportError as exc:
            raise RemoteUnavailable(
                f"the Mooncake client cannot be loaded ({exc}); install it with pip install 'kvstore[remote]' "
                "(CPU hosts: mooncake-transfer-engine-non-cuda; it needs libibverbs: apt install libibverbs1, "
                "or run tools/dev setup)") from None
        return mc_store


def parse_master(url: str) -> tuple[str, int]:
    """`mooncake://host:port` or `host:port` -> (host, port)."""
    text = url if "://" in url else f"mooncake://{url}"
    parts = urlsplit(text)
    if parts.scheme != "mooncake" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"remote master must look like mooncake://host:port, got {url!r}")
    try:
        port = parts.port or 50051
    except ValueError:
        raise ValueError(f"remote master {url!r} has a bad port") from None
    return parts.hostname, port


def probe(host: str, port: int, timeout_s: float) -> str:
    """Connect to the master once; returns the local address that reached it (our hostname for the
    cluster), or raises RemoteUnavailable. Mooncake's own setup retries for ~90 s on a dead master."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            return s.getsockname()[0]
    except OSError as exc:
        raise RemoteUnavailable(f"cannot reach the Mooncake master at {host}:{port}: {exc}") from None


class MooncakeTier(Tier):
    name = "remote"
    accepts_demotions = False

    def __init__(self, master: str, arena, *, metadata_server: str = "P2PHANDSHAKE", local_hostname: str = "",
                 protocol: str = "tcp", device_name: str = "", segment_bytes: int = 1 << 30,
                 buffer_bytes: int = 64 << 20, index_blocks: int = 65536, max_batch: int = 1024,
                 connect_timeout_s: float = 2.0,
                 decoder: Callable[[np.ndarray, Sequence[np.ndarray]], bool] | None = None) -> None:
        host, port = parse_master(master)
        reached_from = probe(host, port, connect_timeout_s)
        mc = load_mooncake()
        self.master = f"{host}:{port}"
        self.local_hostname = local_hostname or reached_from
        self.protocol = protocol
        self.index_blocks = index_blocks
        self.max_batch = max_batch
        self.held = 0  # remote entries the store indexes
        self.decoder = decoder  # expands an encoded value into host memory (kvstore/compression.py)
        self.compressed = CompressedTally()  # the remote entries indexed here whose values are encoded
        self.capacity_bytes = self.page_bytes = 0
        self._mc = mc.MooncakeDistributedStore()
        rc = self._mc.setup(self.local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, device_name,
                            self.master)
        if rc != 0:
            raise RemoteUnavailable(f"Mooncake setup against {self.master} failed (code {rc}); see the log above")
        self._closed = False
        # One replica, in this host's own segment where it has room: publishing is a local copy, and
        # readers on other hosts pull it over the network. (Mooncake falls back to other segments.)
        self._put_cfg = mc.ReplicateConfig()
        self._put_cfg.replica_num = 1
        self._put_cfg.prefer_alloc_in_same_node = True
        self._register(arena.buf)
        # Header slots: one region per kind of call, each used by one thread at a time (sharing.py).
        self._headers = mmap.mmap(-1, 2 * max_batch * HEADER_BYTES)
        self._hbuf = np.frombuffer(self._headers, dtype=np.uint8)
        self._register(self._hbuf)
        self._staging: np.ndarray | None = None
        self._bounce: dict[str, tuple[mmap.mmap, np.ndarray]] = {}  # "get"/"put" -> registered buffer for encoded values
        # encodes and decodes of the put and get threads (threads start at the first use)
        self._codec_pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="kvstore-remote-codec")
        log.info("remote tier: Mooncake client %s of master %s (%s), segment %d MiB", self.local_hostname,
                 self.master, protocol, segment_bytes >> 20)

    def _register(self, buf: np.ndarray) -> None:
        rc = self._mc.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RemoteUnavailable(f"Mooncake refused to register {buf.nbytes} B of host memory (code {rc})")

    def staging(self, nbytes: int) -> np.ndarray:
        """A registered buffer for blocks published after they leave the arena (publish = "evicted")."""
        if self._staging is None:
            self._staging_map = mmap.mmap(-1, nbytes)
            self._staging = np.frombuffer(self._staging_map, dtype=np.uint8)
            self._register(self._staging)
        return self._staging

    # -- the store's bookkeeping of remote entries (tiers/base.py) ------------------
    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def free_bytes(self) -> int:
        return 0

    def pages_for(self, nbytes: int) -> int:
        return 1

    def fits(self, nbytes: int) -> bool:
        return self.index_blocks > 0

    def shortfall(self, nbytes: int) -> int:
        return (self.held + 1 - self.index_blocks) * max(nbytes, 1)

    def allocate(self, nbytes: int):
        if self.held >= self.index_blocks:
            return None
        self.held += 1
        return "remote"  # the entry's location (a RemoteRef) is set by the caller

    def free(self, location, key=None) -> None:
        self.held -= 1
        if isinstance(location, RemoteRef) and location.codec is not None:
            self.count_compressed(location, -1)

    def count_compressed(self, ref: RemoteRef, sign: int) -> None:
        """An entry of an encoded value indexed (+1) or forgotten (-1)."""
        self.compressed.count(ref.codec, sign, ref.logical, ref.stored)  # type: ignore[arg-type]

    def check(self, locations) -> list[str]:
        n = len(list(locations))
        return [] if n == self.held else [f"remote tier counts {self.held} entries, the store holds {n}"]

    def read_blocks(self, location) -> bool:
        return True

    def stored_encoded(self, location: RemoteRef) -> int:
        return location.stored if location.codec is not None else 0

    def read_into(self, location: RemoteRef, out: Sequence[np.ndarray]) -> bool:
        return self.get_into([(location, list(out))])[0]

    # -- blocking cluster operations (called from sharing.py's threads) -------------
    def exists(self, keys: list[str]) -> list[int]:
        """1 present, 0 absent, < 0 an error, per key (one batched query)."""
        return list(self._mc.batch_is_exist(keys))

    def get_into(self, items: list[tuple[RemoteRef, list[np.ndarray]]]) -> list[bool]:
        """Fetch blocks straight into host-memory views (an encoded one through the bounce buffer,
        then decoded into them); True where header and checksum verify (and the value decodes)."""
        out: list[bool] = []
        for chunk in self._chunks(items):
            bounce = self._bounce_buffer("get", sum(ref.stored for ref, _ in chunk))
            targets, pos = [], 0
            for ref, views in chunk:
                targets.append(views if ref.codec is None else [bounce[pos : pos + ref.stored]])
                pos += ref.stored
            oks = self._get_chunk([ref for ref, _ in chunk], targets)
            decode = [(i, target[0], views) for i, ((ref, views), target, ok) in enumerate(zip(chunk, targets, oks))
                      if ok and ref.codec is not None]
            for (i, _, _), ok in zip(decode, self._map(self._decode, decode)):  # in this thread and the encoders'
                oks[i] = ok
            out.extend(oks)
        return out

    def get_encoded(self, refs: list[RemoteRef]) -> list[np.ndarray | None]:
        """Fetch encoded values as stored, for a reader that decodes them itself (the GPU tier's expander,
        kvstore/gpu_decode.py): per ref its bytes (header and checksum verified), or None."""
        out: list[np.ndarray | None] = []
        for chunk in self._chunks([(ref,) for ref in refs]):
            bounce = self._bounce_buffer("get", sum(ref.stored for ref, in chunk))
            targets, pos = [], 0
            for ref, in chunk:
                targets.append([bounce[pos : pos + ref.stored]])
                pos += ref.stored
            oks = self._get_chunk([ref for ref, in chunk], targets)
            out.extend(target[0].copy() if ok else None for target, ok in zip(targets, oks))
        return out

    def _get_chunk(self, refs: list[RemoteRef], targets: list[list[np.ndarray]]) -> list[bool]:
        """One batched fetch of `refs`' values into `targets` (registered memory); per block whether its
        header and checksum verify."""
        heads = [self._hbuf[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(len(refs))]
        ptrs = [[h.ctypes.data] + [v.ctypes.data for v in views] for h, views in zip(heads, targets)]
        sizes = [[HEADER_BYTES] + [v.nbytes for v in views] for views in targets]
        got = self._mc.batch_get_into_multi_buffers([ref.key for ref in refs], ptrs, sizes)
        oks = []
        for ref, target, head, n, size in zip(refs, targets, heads, got, sizes):
            nbytes = sum(size) - HEADER_BYTES
            checksum = header_checksum(head, ref, nbytes) if n == HEADER_BYTES + nbytes else None
            oks.append(checksum is not None and payload_checksum(target) == checksum)
        return oks

    def _decode(self, job) -> bool:
        _, blob, views = job
        return self.decoder is not None and self.decoder(blob, views)

    def _map(self, fn, jobs: list) -> list:
        """fn over jobs, on ENCODE_THREADS threads where there are several (the codec's loops release the GIL)."""
        if len(jobs) < 2:
            return [fn(job) for job in jobs]
        return list(self._codec_pool.map(fn, jobs))

    def put_from(self, items: list[tuple[RemoteRef, list[np.ndarray], object]],
                 checksums: list | None = None) -> list[int]:
        """Publish blocks from host-memory views (header + payload), each encoded first where it comes
        with a codec (kvstore.compression.StoredCodec; its ref then names that codec); 0 (or
        ALREADY_EXISTS) = stored, < 0 failed. `checksums`, where given, gets each exact block's
        xxh3_64 (the header's), None for an encoded one."""
        codes: list[int] = []
        base = self.max_batch * HEADER_BYTES  # the second header region: puts
        for chunk in self._chunks(items):
            blobs = self._encode_all(chunk)
            bounce = self._bounce_buffer("put", sum(ref.stored for ref, *_ in chunk))
            keys, ptrs, sizes, failed, pos = [], [], [], {}, 0
            for i, ((ref, views, _), blob) in enumerate(zip(chunk, blobs)):
                if ref.codec is not None:
                    if not isinstance(blob, np.ndarray) or blob.size != ref.stored:
                        log.warning("remote tier: encoding %s failed: %s", ref.key, blob)
                        failed[i] = -1
                        if checksums is not None:
                            checksums.append(None)
                        continue
                    views = [bounce[pos : pos + ref.stored]]
                    views[0][:] = blob
                    pos += ref.stored
                head = self._hbuf[base + i * HEADER_BYTES : base + (i + 1) * HEADER_BYTES]
                x = payload_checksum(views)
                if checksums is not None:
                    checksums.append(None if ref.codec is not None else x)
                head[:] = np.frombuffer(pack_header(ref, sum(v.nbytes for v in views), x), dtype=np.uint8)
                keys.append(ref.key)
                ptrs.append([head.ctypes.data] + [v.ctypes.data for v in views])
                sizes.append([HEADER_BYTES] + [v.nbytes for v in views])
            put = iter(self._mc.batch_put_from_multi_buffers(keys, ptrs, sizes, self._put_cfg) if keys else [])
            codes.extend(failed[i] if i in failed else next(put) for i in range(len(chunk)))
        return codes

    def _chunks(self, items: list):
        """`items` ((ref, ...) tuples) in runs of at most max_batch blocks whose encoded values fit one
        bounce buffer."""
        start = 0
        while start < len(items):
            end, stored = start, 0
            while end < len(items) and end - start < self.max_batch:
                stored += items[end][0].stored
                if stored > BOUNCE_BYTES and end > start:
                    break
                end += 1
            yield items[start:end]
            start = end

    def _encode_all(self, chunk: list) -> list:
        """Each (ref, views, codec) block's encoded value (or what encoding raised), None without a codec."""
        def one(i: int):
            _, views, codec = chunk[i]
            try:
                return codec.encode(views[0] if len(views) == 1 else np.concatenate([v.reshape(-1) for v in views]))
            except Exception as exc:  # noqa: BLE001 - a block that cannot be encoded is not published
                return exc

        todo = [i for i, (_, _, codec) in enumerate(chunk) if codec is not None]
        blobs: list = [None] * len(chunk)
        for i, blob in zip(todo, self._map(one, todo)):
            blobs[i] = blob
        return blobs

    def _bounce_buffer(self, op: str, nbytes: int) -> np.ndarray:
        """The registered buffer encoded values of `op` ("get", "put") pass through, at least `nbytes`."""
        held = self._bounce.get(op)
        if nbytes == 0 or (held is not None and held[1].nbytes >= nbytes):
            return held[1] if held is not None else self._hbuf[:0]
        if held is not None:
            self._mc.unregister_buffer(held[1].ctypes.data)
        region = mmap.mmap(-1, max(nbytes, BOUNCE_BYTES))
        buf = np.frombuffer(region, dtype=np.uint8)
        self._register(buf)
        self._bounce[op] = (region, buf)
        return buf

    def put_raw(self, key: str, data: bytes) -> int:
        """Store arbitrary bytes under a key (tests: a foreign or corrupt value)."""
        return self._mc.put(key, data)

    def healthy(self) -> bool:
        return self._mc.health_check() == 0

    def stats(self) -> dict:
        return {"master": self.master, "local_hostname": self.local_hostname, "protocol": self.protocol,
                "index_blocks": self.index_blocks, "entries": self.held, "compressed": self.compressed.stats()}

    def close(self, timeout_s: float = 5.0) -> None:
        """Unmount this host's segment from the cluster; bounded, so an unreachable master cannot hold
        up the daemon's exit."""
        if self._closed:
            return
        self._closed = True
        self._codec_pool.shutdown(wait=False)

        def unmount() -> None:
            try:
                self._mc.close()
            except Exception as exc:  # noqa: BLE001 - a dead master must not fail the shutdown
                log.warning("remote tier: close failed: %s", exc)

        t = threading.Thread(target=unmount, name="kvstore-remote-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("remote tier: the cluster did not answer the unmount within %s s; leaving it", timeout_s)

