"""The host placement index's folder beside the arena (`<arena>.index/`, tiers/host_index.py): its path, made
private, and removed only where it is ours."""

from __future__ import annotations

import os
import shutil
import stat


class IndexRefused(PermissionError):
    """The index folder is another user's, or a symbolic link: neither used nor removed."""


def index_path(arena_path: str) -> str:
    return arena_path + ".index"


def remove_index(path: str) -> None:
    """Remove an index folder of ours (a stale one, or one that does not match its arena)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid() or stat.S_ISLNK(st.st_mode):
        raise IndexRefused(f"the host index path {path} belongs to uid {st.st_uid} or is a symbolic link: "
                           f"refusing to use or remove it (remove it yourself, or set host.shm_path)")
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def private_dir(path: str) -> None:
    """Create the index folder 0700, or check that the existing one is ours and closed to others."""
    try:
        os.mkdir(path, 0o700)  # never follows a symlink at `path`
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"{path} is not a private folder of uid {os.geteuid()} (uid {st.st_uid}, "
                         f"mode {stat.S_IMODE(st.st_mode):04o})")
