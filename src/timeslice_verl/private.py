"""Files only their user may touch: the agent's socket directory and state, the batch service's database and key.

One check for every such place, so nobody else can plant a file, a link or a socket where we read or write, and
nothing we write (a prompt, a key) is readable by another user. Each error names the setting that chose the path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotPrivate(ValueError):
    """A directory or file another user owns or may write (or a link where a file should be): named, refused."""


def _owned(st: os.stat_result, what: str, then: str) -> None:
    """This user's, and writable by nobody else."""
    if st.st_uid != os.getuid():
        raise NotPrivate(f"{what} belongs to uid {st.st_uid}, not to you: {then}")
    if st.st_mode & 0o022:
        raise NotPrivate(f"{what} is writable by others: {then}")


def private_directory(path: Path, key: str) -> None:
    """Create ``path`` (0700) or check that it is this user's and not writable by others."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as exc:
        raise NotPrivate(f"{key}: cannot create or read directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{key}: {path} is not a directory")
    _owned(st, f"{key}: directory {path}", "use a private directory")


def private_file(path: Path, key: str, *, readable_by_others: bool = True) -> bool:
    """Check an existing file we read back: this user's, writable by nobody else (and, with
    ``readable_by_others=False``, readable by nobody else). False when it does not exist."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise NotPrivate(f"{key}: {path} is a symbolic link; give the file's own path")
    if not stat.S_ISREG(st.st_mode):
        raise NotPrivate(f"{key}: {path} is not a regular file")
    _owned(st, f"{key}: {path}", "it will not be used")
    if not readable_by_others and st.st_mode & 0o044:
        raise NotPrivate(f"{key}: {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    return True


def create_private(path: Path, key: str, content: bytes = b"") -> bool:
    """Create ``path`` 0600 with ``content`` unless it exists (True: created). Never follows or replaces a link."""
    private_directory(path.parent, key)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        private_file(path, key)
        return False
    except OSError as exc:
        raise NotPrivate(f"{key}: cannot create {path}: {exc.strerror or exc}") from None
    try:
        os.write(fd, content)
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    return True


__all__ = ["NotPrivate", "create_private", "private_directory", "private_file"]
