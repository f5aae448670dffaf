"""The daemon's own files, kept where no other user can plant, hold or replace them.

- The runtime folder is the socket's folder (default: `$XDG_RUNTIME_DIR/kvstore` or
  /tmp/kvstore-<uid>). It is created 0700; one that already exists must belong to the
  daemon's user and must not be writable by group or others (what ssh-agent and
  gpg-agent require), else another user could replace the socket or the files below.
  A symlink to it is accepted only if our user or root made it.
- `<name>.lock` there: flock'd while the daemon lives, so one daemon runs per name
  and folder. Opened with O_NOFOLLOW, and it must be a regular 0600 file of ours.
  (It used to live in /dev/shm, where another user could plant a symlink the root
  daemon followed, or hold the lock and keep the daemon from starting.)
- `<name>.admin-token` there: the admin plane's bearer token, new at each start,
  created with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, while the lock is held (so a
  file already there is a killed daemon's), removed at a clean stop.

The arena in /dev/shm is checked by tiers/host.py (it has to be in a shared folder
for clients to map it). It and its placement index outlive the daemon on purpose
(host.persistent): the next start re-adopts them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import secrets
import stat

from kvstore.errors import OwnershipError
from kvstore.tiers.host import remove_stale_arena

PRIVATE_FILE_MODE = 0o600


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def ensure_private_dir(folder: str) -> None:
    """Create the runtime folder 0700, or check that an existing one is ours and closed to others."""
    folder = folder or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st, lst = os.stat(folder), os.lstat(folder)
    euid = os.geteuid()
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (euid, 0):
        raise OwnershipError(f"the socket folder {folder} is a symbolic link owned by {_user(lst.st_uid)}: "
                             f"refused (another user could point it elsewhere); use a folder of your own")
    if st.st_uid != euid or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise OwnershipError(
            f"the socket folder {folder} is owned by {_user(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}: "
            f"refused, it must belong to {_user(euid)} and not be writable by group or others, or another "
            f"user could replace the socket (chmod 700 it, or choose another folder with --socket)")


def _check_private_file(fd: int, path: str, what: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
        raise OwnershipError(f"the {what} {path} is owned by {_user(st.st_uid)} with mode "
                             f"{stat.S_IMODE(st.st_mode):04o}: refused, it must be a regular file of "
                             f"{_user(os.geteuid())} with mode 0600 (remove it if no daemon runs)")


def _open_private(path: str, what: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OwnershipError(f"the {what} {path} is a symbolic link: refused") from None
        raise


def lock_instance(path: str, name: str) -> int:
    """Hold the instance lock while the daemon lives (the fd is kept open); OSError if one runs."""
    fd = _open_private(path, "instance lock", os.O_RDWR | os.O_CREAT)
    try:
        _check_private_file(fd, path, "instance lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"another kvstore daemon named {name!r} is running (lock {path})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_admin_token(path: str) -> str:
    """A new bearer token in a new 0600 file. The caller holds the instance lock, so a file
    already at `path` is a killed daemon's: in the private folder only our user can put one."""
    unlink_quietly(path)
    token = secrets.token_urlsafe(32)
    fd = _open_private(path, "admin token file", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return token


def read_admin_token(path: str) -> str:
    """The token a running daemon wrote (the owner's tools read it; nobody else can)."""
    fd = _open_private(path, "admin token file", os.O_RDONLY)
    try:
        _check_private_file(fd, path, "admin token file")
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)


def remove_stale_instance(shm_path: str, lock_path: str, token_path: str, keep_arena: bool = False) -> bool:
    """Remove the lock and token of an instance whose daemon is gone (killed), and its arena and the
    arena's index unless `keep_arena` (a successor re-adopts them); False if a daemon still runs."""
    try:
        fd: int | None = _open_private(lock_path, "instance lock", os.O_RDWR)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not keep_arena and not remove_stale_arena(shm_path):
            return False
        unlink_quietly(token_path)
        if fd is not None:
            unlink_quietly(lock_path)
        return True
    except BlockingIOError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
