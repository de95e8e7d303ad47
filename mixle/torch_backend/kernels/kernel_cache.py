"""A private, verified cache of compiled kernel libraries: only what this user built is loaded.

Each build is recorded next to its library in a JSON record that maps the build's key (source
bytes, compiler command, flags, CPU features, platform) to the library's file name, size and
sha256. The cache directory and every file in it must be owned by this user and writable by no
one else; a library is loaded only when its bytes (read through the one descriptor that is then
handed to ``dlopen``) match its record. Anything else (a planted or truncated library, a foreign
or loosely-permissioned record) is never loaded: the caller rebuilds. A recorded build is found
without running the compiler, so it is used even with no compiler on PATH.

The configured directory (``MIXLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixle`` or
``~/.cache/mixle``) is created 0700. When it exists but is owned by someone else or writable by
group or others (e.g. ``/tmp``), the cache lives in its per-user 0700 subdirectory
``mixle-<uid>`` instead, which must itself be private.
"""

import ctypes
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["cache_dir", "private_dir", "build_key", "find", "build", "load"]

_RECORD_VERSION = 1
_verified = {}  # library path -> (size, sha256) checked by find/build in this process


def cache_dir():
    """The configured cache directory (not yet checked or created).

    >>> cache_dir().name in ("mixle",) or "MIXLE_CACHE_DIR" in os.environ
    True
    """
    root = os.environ.get("MIXLE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixle"


def _is_private(info):
    """A directory or file this user owns and no one else may write."""
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def private_dir(root=None):
    """The directory to build into: ``root`` when private, else its per-user subdirectory.

    Creates what is missing with mode 0700. Raises RuntimeError when neither is private.

    >>> import tempfile
    >>> oct(private_dir(Path(tempfile.mkdtemp()) / "cache").stat().st_mode & 0o777)
    '0o700'
    """
    root = cache_dir() if root is None else Path(root)
    try:
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        info = root_info = os.stat(root)
    except OSError as error:
        raise RuntimeError(f"cannot create the kernel cache directory {root} ({error})") from None
    if stat.S_ISDIR(info.st_mode) and _is_private(info):
        return root
    sub = root / f"mixle-{os.getuid()}"
    try:
        os.mkdir(sub, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise RuntimeError(f"the kernel cache directory {root} is not private (owner uid {root_info.st_uid}, mode "
                           f"{stat.S_IMODE(root_info.st_mode):o}) and its per-user subdirectory {sub.name} cannot be "
                           f"created ({error}); point MIXLE_CACHE_DIR at a directory only you can write") from None
    info = os.lstat(sub)
    if not (stat.S_ISDIR(info.st_mode) and _is_private(info) and not stat.S_IMODE(info.st_mode) & 0o077):
        raise RuntimeError(f"the kernel cache directory {root} is not private (owner uid {root_info.st_uid}, mode "
                           f"{stat.S_IMODE(root_info.st_mode):o}) and its subdirectory {sub} is not this user's "
                           f"private directory (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); "
                           f"point MIXLE_CACHE_DIR at a directory only you can write")
    return sub


def _cpu_signature():
    """What -march=native depends on: the CPU's feature flags (a shared cache may span machines)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def build_key(source, compiler, flags):
    """The cache key of one build: source bytes, compiler command, flags, CPU and platform.

    The compiler is named, not run, so a recorded build is found without a compiler on PATH.

    >>> len(build_key(b"int f();", "c++", ("-O2",)))
    20
    """
    parts = [source, compiler.encode(), " ".join(flags).encode(), _cpu_signature().encode(), sys.platform.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _open_private(path):
    """``(fd, stat)`` of a regular file this user owns and no one else may write, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and _is_private(info):
        return fd, info
    os.close(fd)
    return None


def _digest(fd):
    digest, size = hashlib.sha256(), 0
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _record_path(directory, stem, key):
    return directory / f"{stem}_{key}.json"


def find(directory, stem, key):
    """The recorded library of ``key`` when its record and bytes check out, else None."""
    opened = _open_private(_record_path(directory, stem, key))
    if opened is None:
        return None
    fd, info = opened
    try:
        record = json.loads(os.read(fd, min(info.st_size, 1 << 16)))
        name, size, sha256 = record["library"], record["size"], record["sha256"]
        ok = (record.get("version") == _RECORD_VERSION and isinstance(name, str) and name == Path(name).name
              and name.startswith(f"{stem}_{key}_") and type(size) is int and isinstance(sha256, str))
    except (ValueError, KeyError, TypeError, OSError):
        ok = False
    finally:
        os.close(fd)
    if not ok:
        return None
    library = directory / name
    opened = _open_private(library)
    if opened is None:
        return None
    fd, info = opened
    try:
        if info.st_size != size or _digest(fd) != (size, sha256):
            return None
    finally:
        os.close(fd)
    _verified[str(library)] = (size, sha256)
    return library


def _write_private(path, data):
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def build(directory, source, compiler, flags, key):
    """Compile ``source`` into ``directory`` and record it; the library's path.

    Raises:
        RuntimeError: the compiler is missing or fails (with its last error line).
    """
    stem = Path(source).stem
    fd, partial = tempfile.mkstemp(prefix=f".{stem}_{key}.", suffix=".so", dir=directory)  # mode 0600
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *flags, "-o", partial, str(source)], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"no working C++ compiler {compiler!r} ({error})") from None
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(f"{compiler} failed: {error}")
        os.chmod(partial, 0o600)
        fd = os.open(partial, os.O_RDONLY)
        try:
            size, sha256 = _digest(fd)
        finally:
            os.close(fd)
        # Named by content: concurrent builders never overwrite a library another one recorded.
        library = directory / f"{stem}_{key}_{sha256[:16]}.so"
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    record = {"version": _RECORD_VERSION, "library": library.name, "size": size, "sha256": sha256,
              "source": str(source), "compiler": compiler, "flags": list(flags)}
    _write_private(_record_path(directory, stem, key), json.dumps(record, indent=1).encode())
    _verified[str(library)] = (size, sha256)
    return library


_held_descriptors = []


def load(path):
    """``ctypes.CDLL`` of a library that ``find`` or ``build`` verified, re-checked on the very
    descriptor ``dlopen`` reads (so it cannot be swapped in between).

    Raises:
        RuntimeError: the library was not verified here, or its bytes changed since.
    """
    expected = _verified.get(str(path))
    opened = _open_private(path) if expected else None
    if opened is None:
        raise RuntimeError(f"{path} is not a library this user built and recorded; refusing to load it")
    fd, _ = opened
    try:
        if _digest(fd) != expected:
            raise RuntimeError(f"{path} changed since it was verified; refusing to load it")
        via = f"/proc/self/fd/{fd}"
        library = ctypes.CDLL(via if os.path.exists(via) else str(path))
    except BaseException:
        os.close(fd)
        raise
    # The descriptor stays open for the life of the process: the dynamic loader knows the library
    # by the name "/proc/self/fd/N", and a later dlopen of a reused N would get this library back.
    _held_descriptors.append(fd)
    return library


SWITCH = "MIXLE_FUSED_KERNELS"
_deciding = threading.Lock()


def decide_once(loaded, key, make, what, without):
    """``loaded[key]``, decided once per process: ``make(compiler)`` (the bound library), or None
    when ``MIXLE_FUSED_KERNELS=0``, or when it cannot be built, then with one RuntimeWarning naming
    ``what`` could not be built, saying ``without`` (what runs instead, what it costs) and the fixes.
    """
    found = loaded.get(key, False)
    if found is not False:
        return found
    with _deciding:
        if key not in loaded:
            library = None
            if os.environ.get(SWITCH, "1") != "0":
                try:
                    library = make(os.environ.get("CXX", "c++"))
                except (RuntimeError, OSError) as error:
                    warnings.warn(
                        f"mixle could not build {what} ({error}); {without}. Install a C++ compiler (e.g. "
                        f"`apt install g++`), or set {SWITCH}=0 to use that path without this warning.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            loaded[key] = library
    return loaded[key]
