"""The host tier: one POSIX shared-memory arena, cut into fixed-size pages.

The daemon creates the arena file (under /dev/shm, mode 0600), sizes it to the
byte budget rounded down to whole pages, and prefaults it (fallocate: every
page allocated in tmpfs, so that no store pays for a page's first allocation;
none mapped in the daemon, which maps pages as it touches them and unmaps what
it only hashed, since what it keeps mapped it unmaps at exit). Local clients
map the same file (`map_arena`) and copy payloads directly; payload bytes never
cross the socket for them.

/dev/shm is shared by every user and the arena's name is predictable, so the
daemon never follows what it finds there: it creates the file with
O_CREAT|O_EXCL|O_NOFOLLOW, and removes a file already at the path only when it
is a regular file of its own user that no running daemon holds (a killed
daemon's); anything else (another user's file, a symlink) is refused (ArenaRefused).
The daemon holds an flock on its arena while it lives, which is how a stale
arena is told from a live one. Clients map with O_NOFOLLOW and, given the
daemon's uid, refuse a file that another user owns.

Persistent (`persistent=True`, the daemon's default: config `host.persistent`):
the arena and its placement index (tiers/host_index.py, `<arena>.index/`)
outlive the process. A clean stop leaves both; the next start re-adopts an
arena found at the path when it is a regular 0600 file of ours that no daemon
holds, of the configured size, whose index is ours, private, readable and
records the same geometry and the arena's inode: every record whose extents
check is a block again, the rest of the pages are free. The records are read
in a thread of their own (tiers/host_scan.py) while the daemon serves; until
they are, the arena has no free page (`scanning`, `scanned`), and the store
reads the record of a block a request names on its own (`peek`,
`adopted_early`: verified as the scan's blocks are; a page it frees stays
taken until the scan's result is in). No byte is read
at start (the arena is mapped, not prefaulted): each block's checksum is
verified before its bytes are first read (`verify`) or by the index's hasher
in the background, and a block that fails is reported lost (`failed_checks`,
`lost`) and dropped by the store, never served (tiers/host_index.py). Anything
that does not match starts empty, with a log line saying why. Not persistent:
the arena is removed at stop and a stale one at start (blocks then survive a
SIGTERM only by being written down to the disk tier).

A block occupies ceil(nbytes / page_bytes) pages, allocated as extents
(`[offset, length]` runs) by the shared `PageAllocator` (tiers/pages.py); on a
fresh or lightly fragmented arena a block is one extent, so a copy is one memcpy.

Invariants (see `check`): a page is either free or owned by exactly one
allocation; used + free == capacity; allocation never exceeds capacity; when
persistent, every committed block has a record whose checksum its bytes match
(`check_records`, after `flush`), and no other record exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
from typing import ContextManager, Sequence

import lmdb
import numpy as np

from kvstore.keys import key_text
from kvstore.tiers.arena import (  # noqa: F401  (map_arena, copy_*: also this module's names)
    ArenaRefused,
    _advise_hugepages,
    _describe,
    copy_bytes,
    copy_in,
    copy_out,
    copy_segments,
    map_arena,
)
from kvstore.tiers.base import BlockMeta, RecoveredBlock, Tier
from kvstore.tiers.host_folder import IndexRefused, index_path, remove_index
from kvstore.tiers.host_index import HostIndex, checksum, record_key
from kvstore.tiers.host_scan import HostScan
from kvstore.tiers.pages import Extents, PageAllocator
from kvstore.tiers.record_scan import BAD_RECORD
from kvstore.tiers.recovered import Recovered

log = logging.getLogger(__name__)

_OS_PAGE = mmap.PAGESIZE


class HostArena(Tier):
    """Owner side (the daemon): creates, prefaults, allocates and frees pages (tiers/base.py)."""

    name = "host"
    client_readable = True
    host_memory = True

    def __init__(self, path: str, capacity_bytes: int, page_bytes: int, prefault: bool = True,
                 persistent: bool = False) -> None:
        if page_bytes <= 0 or page_bytes % _OS_PAGE:
            raise ValueError(f"page_bytes must be a positive multiple of {_OS_PAGE}, got {page_bytes}")
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"host capacity {capacity_bytes} B is smaller than one page ({page_bytes} B)")
        self.path = path
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.capacity_bytes = num_pages * page_bytes
        self.persistent = persistent
        self.index: HostIndex | None = None
        self._settle_later = 0  # inside `settling_once`: allocations leave the queued deletions to its end
        self._scan: HostScan | None = None  # the kept records being read (a re-adopted arena)
        self._namespaces: list[tuple[str, dict]] = []  # the namespaces the re-adopted index kept
        self._num_records = 0  # the kept records found at open
        self.scan_s: float | None = None  # how long reading them took
        self._lost: dict[int, Extents] = {}  # the locations the last `failed_writes` reported, by id
        self.adopted_blocks = 0
        self.adopted = persistent and self._adopt()  # else a new, empty arena of ours
        if not self.adopted:
            self._create(prefault)

    def _create(self, prefault: bool) -> None:
        """A new, empty arena (and index, when persistent) at our path."""
        if not remove_stale_arena(self.path):
            raise OSError(f"the arena {self.path} is in use by a running kvstore daemon (same name?)")
        # A file object, not a bare fd: an arena dropped without close() (tests) still gives it back.
        self._file = os.fdopen(_create_private(self.path), "r+b", buffering=0)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX)  # held while we live: tells our arena from a stale one
            os.ftruncate(self._file.fileno(), self.capacity_bytes)
            self._mm = mmap.mmap(self._file.fileno(), self.capacity_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            self._file.close()
            raise
        _advise_hugepages(self._mm)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        if prefault:  # every page allocated in tmpfs now, none mapped here (see `_unmap`)
            os.posix_fallocate(self._file.fileno(), 0, self.capacity_bytes)
        if self.persistent:
            try:
                self.index = HostIndex(index_path(self.path), self.buf, self._geometry(), self._unmap)
            except BaseException:
                self.close(unlink=True)
                raise
        self.pages = PageAllocator(self.num_pages, self.page_bytes, label="host")

    def _unmap(self, extents) -> None:
        """Drop this process's mapping of the pages of `extents` (a block it only hashed): the bytes stay
        in the arena, a later access maps them again. A process unmaps at exit whatever it mapped, page
        by page (~40 ms per GiB here), so the pages the daemon keeps mapped are what its stop costs."""
        try:
            for offset, length in extents:
                self._mm.madvise(mmap.MADV_DONTNEED, offset, -(-length // _OS_PAGE) * _OS_PAGE)
        except (ValueError, OSError):  # closed meanwhile (the index's threads outlive nothing else)
            pass

    def _geometry(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "page_bytes": self.page_bytes,
                "arena_inode": os.fstat(self._file.fileno()).st_ino}

    def _adopt(self) -> bool:
        """Re-adopt the arena a previous daemon left at our path; False (and a log line saying why,
        unless there was none) when it must start empty instead. OSError when a daemon still holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # none there; a symlink or another user's file is refused by _create
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(f"the arena {self.path} is in use by a running kvstore daemon (same name?)") from None
        self._file = os.fdopen(fd, "r+b", buffering=0)
        why = self._open_adopted(st)
        if why is None:
            return True
        log.warning("host tier: starting empty, not re-adopting the arena %s: %s", self.path, why)
        self.close(unlink=False)
        return False

    def _open_adopted(self, st: os.stat_result) -> str | None:
        """Map the arena, open and load its index; None when adopted, else why not."""
        if stat.S_IMODE(st.st_mode) & 0o077:
            return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
        if st.st_size != self.capacity_bytes:
            return f"it holds {st.st_size} B, the configured host tier {self.capacity_bytes} B"
        if not os.path.isdir(index_path(self.path)):
            return f"no placement index beside it ({index_path(self.path)})"
        # Not populated: the pages exist in tmpfs already, and mapping them all would cost the start
        # ~0.1 s a GiB (a fault per page later costs less than a microsecond).
        self._mm = mmap.mmap(self._file.fileno(), self.capacity_bytes, flags=mmap.MAP_SHARED)
        _advise_hugepages(self._mm)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        try:
            self.index = HostIndex(index_path(self.path), self.buf, self._geometry(), self._unmap)
            self._namespaces = self.index.namespaces()
            self._num_records = self.index.num_records()
        except (ValueError, lmdb.Error, OSError) as exc:
            return f"its placement index is unusable: {exc}"
        # No free page until the records are read (`scanned`): nothing is written over a kept block.
        self.pages = PageAllocator.full(self.num_pages, self.page_bytes, label="host")
        self._scan = HostScan(self.index.env, self.index.blocks_db, self.capacity_bytes, self.page_bytes)
        log.info("host tier: re-adopting the arena %s: reading its %d records", self.path, self._num_records)
        return None

    @property
    def scanning(self) -> bool:
        return self._scan is not None

    @property
    def peekable(self) -> bool:
        return self._scan is not None

    def peek(self, key) -> tuple | None:
        """While its records are read: `key`'s record, read from the index alone and judged as the scan
        judges one (`Recovered.normal`'s fields; the scan finds whether another record claims its pages);
        None where there is none or an unusable one."""
        record = self._peek(key)
        return None if record is None else record[0]

    def peeks(self) -> ContextManager[None]:
        return self._scan.held() if self.peekable else contextlib.nullcontext()

    def adopted_early(self, key, location: Extents) -> None:
        """The store adopted `key`'s block at `location`, the extents `peek` gave, while the records are
        read: it is verified against its record's checksum before its first read, as a block the scan
        hands over is, and its record deleted when it leaves (tiers/host_index.py `early`)."""
        record = self._peek(key)
        if record is None or record[0][3] != location:  # (its record cannot change while the arena scans)
            raise RuntimeError(f"internal: the record of {key_text(key)} is not the one adopted")
        _, rec, rkey = record
        self.index.early(key, rkey, location, rec["n"], rec["x"])

    def _peek(self, key) -> tuple | None:
        scan = self._scan
        if scan is None:
            return None
        try:
            rkey = record_key(key)
            raw = scan.get(rkey)
            return None if raw is None else scan.parse(rkey, raw)[0]
        except (*BAD_RECORD, lmdb.Error):  # (the scan deletes it, or the arena starts over without it)
            return None

    def scanned(self, wait: bool = False) -> Recovered | list | None:
        """The blocks kept in the re-adopted arena (once; None while its records are read, unless `wait`).
        From then on the arena knows its free pages and allocates."""
        if self._scan is None:
            return []
        try:
            result = self._scan.result(wait)
        except (lmdb.Error, ValueError, OSError) as exc:
            self._scan = None
            self._start_over(f"its placement index is unusable: {exc}")
            return []
        if result is None:
            return None
        self._scan = None
        self.index.adopt(result)
        self.pages = result.pages
        self.adopted_blocks = len(result.blocks)
        self.scan_s = result.seconds
        log.info("host tier: re-adopted the arena %s: %d blocks, %d MiB (records read in %.3f s)", self.path,
                 len(result.blocks), int(result.taken.sum()) * self.page_bytes >> 20, result.seconds)
        return result.blocks

    def _start_over(self, why: str) -> None:
        """The kept records cannot be read: a new, empty index over the arena (every page free), the
        namespaces the old one held restored in it."""
        log.warning("host tier: starting empty, not re-adopting the arena %s: %s", self.path, why)
        self.index.close(flush=False)
        _remove_index(self.path)
        self.index = HostIndex(index_path(self.path), self.buf, self._geometry(), self._unmap)
        for ns_id, fields in self._namespaces:
            self.index.put_namespace(ns_id, fields)
        self.pages = PageAllocator(self.num_pages, self.page_bytes, label="host")

    # -- the store's tier interface (tiers/base.py) ----------------------------------
    def allocate(self, nbytes: int):
        if self.index is not None and self.index.has_deletes and not self._settle_later:
            self.index.settle()  # no record may point at pages we hand out
        return self.pages.allocate(nbytes)

    def allocate_many(self, nbytes: int, count: int) -> list:
        if self.index is not None and self.index.has_deletes and not self._settle_later:
            self.index.settle()
        return self.pages.allocate_many(nbytes, count)

    @contextlib.contextmanager
    def settling_once(self):
        """Allocations inside write the queued deletions of the records of freed pages once, at the end,
        instead of each before its pages are handed out (one index transaction for a reserve of many
        blocks into a full tier, not one a block). Only for code that writes nothing into the pages it
        allocates before the end (a reserve: its client writes after the reply)."""
        self._settle_later += 1
        try:
            yield
        finally:
            self._settle_later -= 1
            if not self._settle_later and self.index is not None and self.index.has_deletes:
                self.index.settle()

    def free_unused(self, allocations: Sequence) -> None:
        self.pages.free_unused(allocations)

    def free(self, location: Extents, key: tuple | None = None) -> None:
        """(While the records are read, the pages stay taken: the scan counts them its record's, and the
        store frees them again once it has the scan's rows: kvstore/recovery.py, blocks adopted early.)"""
        if key is not None and self.index is not None:
            self.index.forget(key)
        if self._scan is None:
            self.pages.free(location)

    @property
    def records_placed(self) -> bool:
        return self.index is not None

    def placed(self, location: Extents, meta: BlockMeta) -> None:
        self.placed_many([(location, meta)])

    def placed_many(self, blocks: Sequence[tuple[Extents, BlockMeta]]) -> None:
        if self.index is not None:
            self.index.record_many(blocks)

    def offer_checksum(self, location: Extents, key: tuple, x: int) -> None:
        """A pinned block's xxh3_64, taken by a reader of its bytes: the index need not hash it again."""
        if self.index is not None:
            self.index.offer_checksum(key, location, x)

    def busy(self) -> None:
        if self.index is not None:
            self.index.busy()

    @property
    def verifying(self) -> bool:
        return self.index is not None and self.index.has_unverified

    def verify(self, location: Extents, key: tuple) -> bool:
        return self.index is None or self.index.verify(key, location)

    def failed_checks(self) -> list[bytes]:
        """Adopted blocks the index's hasher found altered (their bytes are lost to the store)."""
        if self.index is None:
            return []
        corrupt = self.index.altered()
        if corrupt or self._lost:
            self._lost = {id(extents): extents for _, extents in corrupt}  # (the lists kept alive: ids stay theirs)
        return [key for key, _ in corrupt]

    def lost(self, location: Extents) -> bool:
        return self._lost.get(id(location)) is location

    def durable(self, location: Extents) -> bool:
        return self.index is not None and not self.index.pending(location)

    @property
    def num_kept_records(self) -> int:
        return self._num_records

    def recover(self) -> tuple[list[tuple[str, dict]], list[RecoveredBlock]]:
        """The namespaces; the blocks come from the background read of the records (`scanned`)."""
        return list(self._namespaces), []

    def persist_namespace(self, ns_id: str, fields: dict) -> None:
        if self.index is not None:
            self.index.put_namespace(ns_id, fields)

    def flush(self) -> None:
        if self.index is not None:
            self.index.flush()

    def check_records(self, placed: dict) -> list[str]:
        """The index against the committed host blocks (call after `flush`), each block's bytes
        against its record's checksum."""
        if self.index is None:
            return []
        problems = []
        records = self.index.records()
        for key, extents in placed.items():
            rec = records.pop(record_key(key), None)
            if rec is None:
                problems.append(f"host block {key_text(key)} has no index record")
            elif rec["e"] != extents or rec["n"] != sum(n for _, n in extents):
                problems.append(f"index record of host block {key_text(key)} disagrees with its pages")
            elif rec["x"] is None:
                problems.append(f"the index record of host block {key_text(key)} has no checksum after a flush")
            elif rec["x"] != checksum(self.buf, extents):
                problems.append(f"host block {key_text(key)} no longer matches its recorded checksum")
        if records:
            problems.append(f"{len(records)} host index records belong to no host block")
        return problems

    def stats(self) -> dict:
        out = super().stats()
        out["persistent"] = self.persistent
        if self.index is not None:
            idx = self.index
            out.update(scanning=self._scan is not None, scan_s=self.scan_s,
                       adopted_blocks=self.adopted_blocks, adopted_unchecked=idx.adopted_unchecked,
                       unverified_blocks=idx.num_unverified, verified_blocks=idx.verified_blocks,
                       corrupt_blocks=idx.corrupt_blocks,
                       pending_records=idx.num_pending, unchecked_records=idx.num_unchecked,
                       records_written=idx.records_written, checksums_written=idx.checksums_written,
                       checksums_offered=idx.checksums_offered)
        return out

    # -- bytes (the store's transfers, TCP inline payloads) ----------------------
    def segments(self, location: Extents) -> list[np.ndarray]:
        """The block's bytes in the arena, one view per extent (no copy)."""
        return [self.buf[o : o + n] for o, n in location]

    def write_from(self, alloc: Extents, src: Sequence[np.ndarray], meta=None) -> Extents:
        copy_segments(self.segments(alloc), src)
        return alloc

    def read_into(self, location: Extents, out: Sequence[np.ndarray]) -> bool:
        copy_segments(out, self.segments(location))
        return True

    def read(self, extents: Extents) -> bytes:
        return b"".join(self.buf[o : o + n].tobytes() for o, n in extents)

    def write(self, extents: Extents, data) -> None:
        copy_in(self.buf, extents, data)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap and let go. A persistent arena is kept (its pending records written first) unless
        `unlink`; any other is removed unless `unlink` is False."""
        unlink = not self.persistent if unlink is None else unlink
        self._stop_scan()
        if self.index is not None:
            self.index.close(flush=not unlink)
            self.index = None
        self.buf = None  # type: ignore[assignment]
        mm = getattr(self, "_mm", None)
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            _remove_index(self.path)
        self._file.close()  # after the unlink: no successor can take our live arena for a stale one meanwhile

    def _stop_scan(self) -> None:
        if self._scan is not None:
            self._scan.stop()
            self._scan = None

    def abandon(self) -> None:
        """Let go as a killed daemon would (tests): pending records unwritten, queued deletions
        uncommitted, nothing removed."""
        self._stop_scan()
        if self.index is not None:
            self.index.close(flush=False)
            self.index = None
        self.buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
        self._file.close()


def _remove_index(arena_path: str) -> None:
    try:
        remove_index(index_path(arena_path))
    except IndexRefused as exc:
        raise ArenaRefused(str(exc)) from None


def remove_stale_arena(path: str) -> bool:
    """Unlink a stopped or killed daemon's arena at `path`, and its placement index; True if the path
    is now free, False if a daemon holds it.

    Only a regular file of our own user is removed (in sticky /dev/shm nobody else can swap
    it between the lstat and the unlink); anything else at the path raises ArenaRefused.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _remove_index(path)  # an index without its arena is worth nothing
        return True
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise ArenaRefused(f"the arena path {path} is {_describe(st)}, not a stale arena of uid {os.geteuid()}: "
                             f"refusing to use or remove it (remove it yourself, or set host.shm_path)")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    os.unlink(path)
    _remove_index(path)
    return True


def _create_private(path: str) -> int:
    """A new 0600 file at `path`: never an existing one, never through a symlink."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise ArenaRefused(f"the arena path {path} was taken by someone else while the daemon started: "
                             f"refusing it ({_describe(os.lstat(path))})") from None
