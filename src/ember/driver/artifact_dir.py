"""Writing an output directory (an artifact, a package) without ever losing a user's files.

`ember compile -o OUT` assembles the artifact in a staging directory beside OUT and moves it into
place when complete. What may be at OUT:

- nothing, or an empty directory: the artifact is put there;
- an ember artifact: replaced, but only if it provably is one (`check_ember_artifact`): its manifest
  carries ember's identity fields and the seal over its content, and the directory holds exactly
  the files it lists, with their hashes (a user's notes saved inside make it one ember will not delete);
- anything else (a file, a link, a directory of other files): refused before any work, naming
  what is there, without walking it.

The staging directory `.OUT.partial-PID-XXXX` holds a marker ember writes (`STAGING_MARKER`: the
output's name, the process id and its start time) and the new directory as `new/`. Only a directory
with that marker, of a process that is gone, is ever removed as a leftover; a user's directory of the
same name is never touched. Replacing is one atomic exchange (`renameat2(RENAME_EXCHANGE)`): at every
instant OUT is the old or the new artifact. Where the filesystem cannot exchange, the old one is moved
into the staging directory as `old/` first, and a compile that finds no OUT but such an `old/` of a dead
process puts it back. The replacing itself, and the removal of leftovers, hold a lock on OUT's parent
directory (`flock`), so concurrent compiles to one OUT each finish, one after the other.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.core.errors import ArtifactError, EmberError
from ember.core.manifest import MANIFEST_NAME, check_ember_artifact
from ember.core.writable import check_writable

log = logging.getLogger("ember")

STAGING_MARKER = ".ember-staging.json"
_NEW, _OLD = "new", "old"
_SHOWN = 5  # paths named in a refusal
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def check_output_dir(output_dir: Path) -> None:
    """Refuse, before any work, an OUT that compiling would clobber or cannot write."""
    _check_place(output_dir)
    if output_dir.exists():
        entries = _some_entries(output_dir)
        if not entries:
            return
        if not os.path.lexists(output_dir / MANIFEST_NAME):
            raise EmberError(f"-o {output_dir}: exists and holds files that are not an ember artifact's "
                             f"({_list(entries)}); refusing to replace it: choose another -o, or move them away")
        try:
            check_ember_artifact(output_dir)
        except ArtifactError as err:
            raise EmberError(f"-o {output_dir}: exists and is not an ember artifact as ember wrote it ({err}); "
                             "refusing to replace it: choose another -o, or move its files away") from None


def check_new_dir(output_dir: Path) -> None:
    """Refuse an OUT that exists and is not an empty directory (`ember package`'s)."""
    _check_place(output_dir)
    if output_dir.exists() and _some_entries(output_dir):
        raise EmberError(f"-o {output_dir}: exists and is not an empty directory; choose a new one")


@contextmanager
def staging_dir(output_dir: Path) -> Iterator[Path]:
    """A new staging directory for OUT, made before the work starts (so an unwritable OUT fails at once),
    after putting back an artifact and removing what earlier compiles to OUT left when they were killed.

    Write the new directory into it and `replace_dir` it into place; if the block fails instead, or
    SIGINT, SIGTERM or SIGHUP arrive, the staging directory and any parent directories it created are removed.
    """
    target = _absolute(output_dir)
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    holder = None
    with _signals_interrupt():
        try:
            # Held until `holder` names the new directory, so an interrupt finds it in the clean-up below.
            with _signals_blocked():
                holder = _new_holder(target, output_dir)
            yield holder / _NEW
        except BaseException:
            if holder is not None:
                _put_back(holder, target)
                shutil.rmtree(holder, ignore_errors=True)
            for parent in created:  # deepest first
                try:
                    parent.rmdir()
                except OSError:
                    break
            raise
        shutil.rmtree(holder, ignore_errors=True)


def _new_holder(target: Path, output_dir: Path) -> Path:
    """A marked staging directory beside `target`, made under the lock after clearing stale leftovers."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent):
            remove_stale_leftovers(target)
            holder = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
            try:
                # Written whole, then named: a compile killed at any point leaves no empty marker, which would
                # read as not ember's and keep its directory forever.
                unnamed = holder / f"{STAGING_MARKER}.writing"
                unnamed.write_text(json.dumps(
                    {"output": target.name, "pid": os.getpid(), "started": _start_time(os.getpid())}))
                os.rename(unnamed, holder / STAGING_MARKER)
                (holder / _NEW).mkdir()
            except BaseException:  # a full disk: no unmarked directory left behind
                shutil.rmtree(holder, ignore_errors=True)
                raise
    except OSError as err:
        raise EmberError(f"-o {output_dir}: cannot write there ({err.strerror or err})") from None
    return holder


def replace_dir(staging: Path, output_dir: Path, check: Callable[[Path], None] = check_output_dir) -> None:
    """Move the finished `staging` (from `staging_dir`) to OUT, replacing what is there if `check` (run
    again under the lock: files may have appeared while this compile ran) lets it. Atomic where the
    filesystem can exchange two names; else recoverable by the next compile to OUT."""
    staging.chmod(0o777 & ~_umask())  # mkdtemp made the holder private; the output is as shareable as any new dir
    target = _absolute(output_dir)
    with _locked(target.parent), _signals_blocked():
        check(output_dir)
        try:
            if not os.path.lexists(target):
                os.rename(staging, target)
            elif not _exchange(staging, target):
                os.rename(target, staging.parent / _OLD)
                try:
                    os.rename(staging, target)
                except BaseException:
                    _put_back(staging.parent, target)
                    raise
        except OSError as err:
            raise EmberError(f"-o {output_dir}: cannot put the result there ({err.strerror or err})") from None


def remove_stale_leftovers(output_dir: Path) -> list[Path]:
    """Remove the staging directories (ember's marker inside) of compiles to OUT that no longer run, first
    putting back an artifact one of them had moved aside where OUT is missing; returns those removed."""
    target = _absolute(output_dir)
    removed = []
    try:
        candidates = [entry for entry in os.scandir(target.parent)
                      if entry.name.startswith(f".{target.name}.") and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for entry in candidates:
        holder = Path(entry.path)
        marker = _read_marker(holder)
        if marker is None or marker.get("output") != target.name or _owner_alive(marker):
            continue
        _put_back(holder, target)
        shutil.rmtree(holder, ignore_errors=True)
        removed.append(holder)
    if removed:
        log.warning("removed %d directories left by interrupted compiles to %s: %s",
                    len(removed), output_dir, _list([p.name for p in removed]))
    return removed


def _put_back(holder: Path, target: Path) -> None:
    """Move the artifact a replace without an exchange had set aside in `holder` back to OUT, if OUT is missing."""
    old = holder / _OLD
    if not os.path.lexists(target) and old.is_dir() and not old.is_symlink():
        os.rename(old, target)
        log.warning("restored %s, which an interrupted compile had moved to %s", target, old)


def _check_place(output_dir: Path) -> None:
    """Refuse an OUT that is a link, not a directory, the root, or under something that is not a directory."""
    if output_dir.is_symlink():
        raise EmberError(f"-o {output_dir}: is a symbolic link; give the path of a directory to write")
    target = _absolute(output_dir)
    if target == target.parent:
        raise EmberError(f"-o {output_dir}: is the root directory; give a directory of its own")
    if output_dir.exists() and not output_dir.is_dir():
        raise EmberError(f"-o {output_dir}: exists and is not a directory; refusing to replace it")
    ancestor = target.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EmberError(f"-o {output_dir}: {ancestor} is not a directory")
    check_writable(output_dir, "-o", beside=True)


def _absolute(path: Path) -> Path:
    """`path` made absolute without resolving links, `.` and `..` folded, so `-o .` stages beside the directory."""
    return Path(os.path.abspath(path))


def _some_entries(directory: Path) -> list[str]:
    """Up to `_SHOWN + 1` names in `directory`, without listing the rest (`-o /` must not walk the disk)."""
    names = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) > _SHOWN:
                    break
    except OSError as err:
        raise EmberError(f"-o {directory}: cannot be read ({err.strerror or err})") from None
    return sorted(names)


def _exchange(new: Path, old: Path) -> bool:
    """Swap the names `new` and `old` in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(old))


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `directory` (nothing is left behind, unlike a lock file)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without locks (some network mounts): go on unserialized
            log.info("cannot lock %s (%s); concurrent writes to it are not serialized", directory, err.strerror)
        yield
    finally:
        os.close(fd)


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP end the work as Ctrl-C does (KeyboardInterrupt), so it cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends (they are then delivered), so the steps of a replace
    are not cut apart by this process's own clean-up.

    Masking them is not enough: a signal sent to the process may land on another of its threads (TVM's, a
    library's), and Python then runs the handler in the main thread at once. So in the main thread the handlers
    are also swapped for one that notes the signal, which is raised again once the block ends."""
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        return
    noted: list[int] = []
    # A handler installed outside Python reads as None and cannot be put back: those signals keep only the mask.
    previous = {signum: signal.signal(signum, lambda signum, _frame: noted.append(signum)) for signum in held
                if signal.getsignal(signum) is not None}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        if noted:
            signal.raise_signal(noted[0])


def _read_marker(holder: Path) -> dict | None:
    """The marker ember wrote in a staging directory, or None if there is none (then it is not ember's)."""
    path = holder / STAGING_MARKER
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > 4096:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _owner_alive(marker: dict) -> bool:
    """Whether the process that wrote `marker` still runs (the same process: its start time matches)."""
    pid = marker["pid"]
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process; a pid no process can have
        return pid > 0
    started = _start_time(pid)
    return started is None or marker.get("started") in (None, started)


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), so a reused pid is told apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (" and more" if len(names) > _SHOWN else "")
