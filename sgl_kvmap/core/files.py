"""Folders and files written whole and read whole: atomic replacement, consistent reads, file
digests.

A writer fills a new sibling folder, syncs it to disk and only then swaps it into place in one
step (``renameat2(RENAME_EXCHANGE)`` on Linux), under a lock per destination, so at every
instant the destination holds either the whole old folder or the whole new one. A reader
opens the folder once and reads every file through that one directory handle, so it never
mixes files of two versions; if a writer removes the version it was reading, it reads again.
Debris of a killed writer (hidden siblings ``.{name}.kvmap-*``) is removed by the next writer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock

DEBRIS_TAG = "kvmap-"  # hidden siblings ".{name}.kvmap-*": staging folders and old versions
READ_ATTEMPTS = 5  # a reader retries this often when writers keep replacing the folder


def refuse_nothing(folder: Path) -> None:
    """A ``may_replace`` check that lets any existing folder be replaced."""


@contextlib.contextmanager
def replacing_folder(
    target: Path, may_replace: Callable[[Path], None] = refuse_nothing
) -> Iterator[Path]:
    """Yield an empty sibling folder to fill; on success it takes ``target``'s place at once.

    ``may_replace(target)`` runs first when ``target`` exists, under the lock, and raises to
    refuse. On any error the new folder is removed and ``target`` is left as it was.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        remove_debris(target)
        if target.exists() or target.is_symlink():
            may_replace(target)
        staging = _new_sibling(target, "staging")
        try:
            yield staging
            _sync_folder(staging)
            _swap_into_place(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # after a swap: the old version


@contextlib.contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """A staging path beside ``path`` to write the new file to; when the block ends without an
    error it replaces ``path`` in one rename (a reader sees the whole old file or the whole new
    one), and in any case nothing is left behind."""
    staging = Path(path).with_name(f".{Path(path).name}.partial")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def writable_place(target: Path) -> str | None:
    """Why ``replacing_folder`` could not write ``target`` (its nearest existing folder is not
    a folder, or this process may not create entries in it), or None. A check to run before
    long work, so it is not lost to an unwritable output."""
    ancestor = Path(target).absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None


def remove_debris(target: Path) -> None:
    """Remove what killed writers of ``target`` left beside it (their staging and old folders).

    Call only while holding ``target``'s lock: then no live writer owns any of them."""
    for debris in target.parent.glob(f".{target.name}.{DEBRIS_TAG}*"):
        shutil.rmtree(debris, ignore_errors=True)


class UnreadableFile(OSError):
    """A named file that is not a regular file (a folder, a FIFO, a device) or is too large."""


def read_folder(
    folder: Path, names: tuple[str, ...], max_bytes: dict[str, int] | None = None
) -> dict[str, bytes | None]:
    """The bytes of each named file of ``folder`` (None: absent), all from one version of it.
    Each must be a regular file (links to one are followed) of at most ``max_bytes[name]``
    bytes when a limit is given: a FIFO is never waited on, a device never read.

    Raises FileNotFoundError (or NotADirectoryError) when ``folder`` itself is missing, and
    UnreadableFile for a named file that breaks the rules."""
    limits = max_bytes or {}
    for _ in range(READ_ATTEMPTS):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            files = {name: _read_at(fd, name, limits.get(name)) for name in names}
            if None not in files.values() or _same_folder(fd, folder):
                return files
        finally:
            os.close(fd)
    return files  # replaced on every attempt: report what the last one found


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_at(dir_fd: int, name: str, limit: int | None) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO or device"
        raise UnreadableFile(f"{name} is {kind}, not a file")
    with open(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise UnreadableFile(f"{name} is larger than {limit:,} bytes")
    return data


def _same_folder(dir_fd: int, folder: Path) -> bool:
    """Whether ``folder`` still names the directory open as ``dir_fd`` (no writer swapped it)."""
    try:
        now, then = os.stat(folder), os.fstat(dir_fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino)


def _sibling(target: Path, role: str) -> Path:
    """A fresh hidden path beside ``target`` (``remove_debris`` finds it)."""
    return target.parent / f".{target.name}.{DEBRIS_TAG}{role}-{secrets.token_hex(4)}"


def _new_sibling(target: Path, role: str) -> Path:
    """A new empty hidden folder beside ``target``, with the umask's ordinary permissions."""
    path = _sibling(target, role)
    path.mkdir()
    return path


def _sync_folder(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself to disk."""
    for path in folder.iterdir():
        _fsync(path, os.O_RDONLY)
    _fsync(folder, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Put ``staging`` at ``target``; an existing ``target`` ends up at ``staging``."""
    if not (target.exists() or target.is_symlink()):
        os.rename(staging, target)
    elif not _exchange(staging, target):
        # No atomic exchange here (not Linux, or a file system without it): move the old
        # version aside first, leaving a moment in which ``target`` is absent.
        os.rename(target, aside := _sibling(target, "old"))
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(aside, target)
            raise
        os.rename(aside, staging)  # the caller removes the old version from there
    _fsync(target.parent, os.O_RDONLY | os.O_DIRECTORY)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, f"could not swap {a} into place: {os.strerror(code)}", str(b))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
