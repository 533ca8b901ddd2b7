"""The persistent compilation cache: compiled programs kept on disk, trusted only when proven.

A second process skips compiling a step the first one compiled. Environment variables:

``POPART_KIT_COMPILATION_CACHE``
    The cache directory (default ``$XDG_CACHE_HOME/popart_kit/xla``, ``~/.cache/popart_kit/xla``,
    created mode 0o700), or ``off``. A cache directory the user gave JAX is left as it is.
``POPART_KIT_COMPILATION_CACHE_MAX_BYTES``
    The bound on the entries' total size (default 1 GiB: thousands of CPU steps of 10-60 kB,
    dozens of large GPU programs; -1: none). Writing an entry first deletes the least recently
    used ones until it fits; an entry larger than the bound is not kept. Sets JAX's
    ``jax_compilation_cache_max_size``.
``POPART_KIT_COMPILATION_CACHE_MIN_COMPILE_SECONDS``
    Programs that compile faster are not kept (default 0.1 s: trivial programs compile in 5 to
    80 ms, steps and stages in 0.06 to 0.5 s and more; below 0.1 s a hit saves little next to
    starting a process, while JAX's default of 1 s would skip most steps). Sets JAX's
    ``jax_persistent_cache_min_compile_time_secs``.

What the cache refuses. As ssh does with its files, a directory or an entry in it that is not
owned by the current user (or root), or that is group- or world-writable, is never used: another
user could plant executables there. The whole cache is then off for the process, with one
:class:`~popart_kit._base.problems.PopartKitWarning` naming the directory, what was found and the
fix. Every entry carries the key it was written for and a SHA-256 digest of its payload; an entry
whose key or digest does not match (copied over another program's, swapped, truncated, empty,
or of an older format) is deleted and compiled afresh, never run. Entries are written whole
(temporary file, then rename), so neither a concurrent reader nor a full disk sees half a one.
XLA's own GPU caches, which JAX would keep unverified in the same directory, stay off.

The entries are those of JAX's persistent cache, read and written by :class:`VerifiedCache`.
It relies on JAX's private API (checked with JAX 0.10.2): ``jax._src.compilation_cache``
builds its cache by calling its module function ``get_file_cache(path)`` (returning
``(cache, path)``) once, and the cache implements
``jax._src.compilation_cache_interface.CacheInterface`` (``get(key)``, ``put(key, value)``).
Where that hook is missing the cache stays off, with one warning. JAX's own ``LRUCache`` is not
used: it writes in place, never rewrites an entry it finds, and bounds its size only with the
``filelock`` package (not a dependency of the kit).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

import jax

from ..._base.atomic import write_atomic
from ..._base.problems import warn

try:
    from jax._src import compilation_cache as _jax_cache
    from jax._src.compilation_cache_interface import CacheInterface
except ImportError:  # a JAX without these private modules: the hook is missing, the cache off
    _jax_cache, CacheInterface = None, object

__all__ = ["CACHE_VARIABLE", "MAX_BYTES_VARIABLE", "MIN_SECONDS_VARIABLE", "VerifiedCache",
           "use_compilation_cache"]

#: Environment variable: the cache directory, or "off".
CACHE_VARIABLE = "POPART_KIT_COMPILATION_CACHE"
#: Environment variable: the bound on the cache's size in bytes (-1: none).
MAX_BYTES_VARIABLE = "POPART_KIT_COMPILATION_CACHE_MAX_BYTES"
#: Environment variable: programs compiling faster than this many seconds are not kept.
MIN_SECONDS_VARIABLE = "POPART_KIT_COMPILATION_CACHE_MIN_COMPILE_SECONDS"
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MIN_SECONDS = 0.1

_MAGIC = b"popart_kit xla cache entry 1\n"
_SUFFIX = "-cache"  # JAX's: entries it wrote before are found, refused and rewritten
_DIGEST = hashlib.sha256().digest_size
_warned: set[str] = set()  # what was warned about: each once per process


def use_compilation_cache() -> str | None:
    """Turn on the verified persistent compilation cache (see the module docs); returns the
    directory in use, or None where the cache is off, refused or cannot be created."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    setting = os.environ.get(CACHE_VARIABLE, "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    directory = Path(setting) if setting else _default_directory()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: compile every time rather than fail
    problem = _untrusted(directory)
    if problem:
        _warn_once(str(directory), f"the compilation cache {directory} is not used: {problem}; "
                   f"another user could plant programs there that sessions would run. Fix: "
                   f"make it yours and writable by you alone (chown -R $USER {directory}; "
                   f"chmod -R go-w {directory}), or set {CACHE_VARIABLE} to such a directory. "
                   f"Compiling without the cache.")
        return None
    if not _hook_available():
        _warn_once("hook", f"the compilation cache is off: this JAX ({jax.__version__}) lacks "
                   f"the private hook the kit verifies cache entries through "
                   f"(jax._src.compilation_cache.get_file_cache). Fix: use a JAX version the "
                   f"kit supports, or set {CACHE_VARIABLE}=off to silence this.")
        return None
    _jax_cache.get_file_cache = _verified_file_cache  # JAX's private hook: see the module docs
    jax.config.update("jax_compilation_cache_max_size",
                      int(_number(MAX_BYTES_VARIABLE, DEFAULT_MAX_BYTES)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      _number(MIN_SECONDS_VARIABLE, DEFAULT_MIN_SECONDS))
    # XLA's own GPU caches (autotuning, kernels) would write unverified files into the directory
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    return str(directory)


class VerifiedCache(CacheInterface):
    """JAX's persistent cache in a directory, bounded to ``max_bytes`` (-1: unbounded), whose
    entries prove the key they were written for and the digest of their payload.

    ``get`` refuses (deletes, and answers a miss for) an entry that fails either proof or is not
    a regular file owned by the user and writable by the user alone; ``put`` writes atomically
    and evicts the least recently used entries to make room."""

    def __init__(self, path: str | os.PathLike, max_bytes: int) -> None:
        self._path = Path(path)
        self.max_bytes = max_bytes

    def get(self, key: str) -> bytes | None:
        file = self._file(key)
        try:
            payload = _read_entry(file, key)
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            if payload is None:
                os.unlink(file)  # the compiled program replaces it
            else:
                os.utime(file)  # its last use, for eviction
        return payload

    def put(self, key: str, value: bytes) -> None:
        entry = _pack(key, value)
        if 0 <= self.max_bytes < len(entry):
            return
        self._evict(room=len(entry))
        write_atomic(self._file(key), entry, mode=0o600)

    def _file(self, key: str) -> Path:
        """The entry of ``key``; refuses a key that would name a file elsewhere."""
        if not key or os.sep in key or key.startswith("."):
            raise ValueError(f"not a cache key: {key!r}")
        return self._path / f"{key}{_SUFFIX}"

    def _evict(self, room: int) -> None:
        """Delete least recently used entries until ``room`` more bytes fit the bound."""
        if self.max_bytes < 0:
            return
        entries = sorted(_entries(self._path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total + room <= self.max_bytes:
                return
            with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                os.unlink(path)
            total -= size


def _default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "popart_kit" / "xla"


def _number(variable: str, default: float) -> float:
    """The number in environment variable ``variable``; ``default`` (with a warning) where it
    is not one."""
    text = os.environ.get(variable, "")
    try:
        return float(text) if text else default
    except ValueError:
        _warn_once(variable, f"{variable}={text!r} is not a number; using {default}. Fix: set "
                   f"it to a number or unset it.")
        return default


def _warn_once(topic: str, message: str) -> None:
    """Warn ``message`` the first time this process warns about ``topic``."""
    if topic not in _warned:
        _warned.add(topic)
        warn(message)


def _hook_available() -> bool:
    """Whether JAX still builds its cache through ``get_file_cache`` (see the module docs)."""
    initialize = getattr(_jax_cache, "_initialize_cache", None)
    return (hasattr(_jax_cache, "get_file_cache") and initialize is not None
            and "get_file_cache" in initialize.__code__.co_names)


def _verified_file_cache(path: str) -> tuple[VerifiedCache, str]:
    """Stands in for ``jax._src.compilation_cache.get_file_cache``."""
    return VerifiedCache(path, jax.config.jax_compilation_cache_max_size), path


def _owner_problem(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` cannot be trusted: not the user's (nor root's), or
    writable by group or others; None where it can."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & 0o022:
        return f"mode {stat.S_IMODE(st.st_mode):#o} lets group or others write it"
    return None


def _untrusted(directory: Path) -> str | None:
    """What makes ``directory`` or an entry in it untrustworthy; None where nothing does."""
    problem = _owner_problem(directory.stat())
    if problem:
        return f"it is {problem}"
    with os.scandir(directory) as found:
        for entry in found:
            with contextlib.suppress(FileNotFoundError):
                problem = _owner_problem(entry.stat(follow_symlinks=False))
                if problem:
                    return f"its entry {entry.name} is {problem}"
    return None


def _entries(directory: Path) -> list[tuple[int, int, str]]:
    """(last use, size, path) of every cache entry in ``directory``."""
    found = []
    with os.scandir(directory) as listing:
        for entry in listing:
            if entry.name.endswith(_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, st.st_size, entry.path))
    return found


def _read_entry(file: Path, key: str) -> bytes | None:
    """The payload of entry ``file`` if it was written for ``key`` and is whole; None where
    not, or where the file is not a regular file owned by the user and writable by them alone."""
    head = _head(key)
    with open(file, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or _owner_problem(st) or f.read(len(head)) != head:
            return None
        digest, payload = f.read(_DIGEST), f.read()
    return payload if hashlib.sha256(payload).digest() == digest else None


def _head(key: str) -> bytes:
    return _MAGIC + key.encode() + b"\n"


def _pack(key: str, payload: bytes) -> bytes:
    """An entry: the format, the key, the payload's digest, the payload."""
    return b"".join((_head(key), hashlib.sha256(payload).digest(), payload))
