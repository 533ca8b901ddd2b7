"""Replace a file whole or not at all: the one way the kit writes a file.

The new content goes to a temporary file in the target's directory, is flushed to disk, then
renamed over the target (atomic on POSIX and Windows), and the directory entry is flushed too.
A failure at any point (full disk, no permission, a crash) leaves the old file as it was and no
temporary file behind, and is raised as :class:`~popart_kit.errors.FileWriteError` naming the file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ..errors import FileWriteError, short

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` atomically; returns the path.

    ``mode``: the new file's permission bits (default: an existing file's, else 0o666 less the
    umask, as ``open`` gives). Refuses a directory as target."""
    path = Path(os.fspath(path))
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise FileWriteError(f"cannot write {short(str(path))}: it is a directory. Fix: name a "
                             f"file.", rule="K-file-write")
    if mode is None:
        mode = _existing_mode(path)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
        tmp_name = None
        _sync_directory(folder)
    except OSError as err:
        reason = err.strerror or str(err)
        raise FileWriteError(
            f"cannot write {short(str(path))} ({len(payload)} bytes): {reason}. The file is "
            f"unchanged. Fix: free space or choose a writable location.", rule="K-file-write",
            errno=err.errno) from None
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    return path


def _existing_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where /proc allows (os.umask would race
    with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def _sync_directory(folder: Path) -> None:
    """Flush the rename to disk where the platform allows opening a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
