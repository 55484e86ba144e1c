"""Writing an artifact directory without ever losing a user's files.

`ember compile -o OUT` assembles the artifact in a staging directory beside OUT
(`.OUT.partial-PID-XXXX`) and renames it into place when complete. What may be at OUT:

- nothing, or an empty directory: the artifact is put there;
- an ember artifact: replaced, but only if it provably is one: its manifest parses as
  ember's, and it holds nothing but the files that manifest lists (a user's notes saved
  inside an artifact make it a directory ember will not delete);
- anything else (a file, a link, a directory of other files): refused before any work,
  naming what is there.

A compile killed with kill -9 cannot clean up after itself; its staging directory (and
the `.OUT.old-PID-...` directory of a replacement it was in the middle of) carries its
process id, and the next compile to the same OUT removes those whose process is gone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.core.errors import EmberError
from ember.core.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES

log = logging.getLogger("ember")

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)-[^/]*")
_SHOWN = 5  # paths named in a refusal


def check_output_dir(output_dir: Path) -> None:
    """Refuse, before any work, an OUT that compiling would clobber or cannot write."""
    if output_dir.is_symlink():
        raise EmberError(f"-o {output_dir}: is a symbolic link; give the path of a directory to write")
    if output_dir.exists():
        if not output_dir.is_dir():
            raise EmberError(f"-o {output_dir}: exists and is not a directory; refusing to replace it")
        strangers = _files_not_in_artifact(output_dir)
        if strangers:
            raise EmberError(f"-o {output_dir}: exists and holds files that are not an ember artifact's "
                             f"({_list(strangers)}); refusing to replace it: choose another -o, or move them away")
    ancestor = output_dir.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EmberError(f"-o {output_dir}: {ancestor} is not a directory")


@contextmanager
def staging_dir(output_dir: Path) -> Iterator[Path]:
    """A new staging directory for OUT, made before the work starts (so an unwritable OUT fails
    at once), after removing what earlier compiles to OUT left behind when they were killed.

    Write the artifact into it and `replace_dir` it into place; if the block fails instead,
    the staging directory and any parent directories it created are removed.
    """
    remove_stale_leftovers(output_dir)
    created = [p for p in (output_dir.parent, *output_dir.parent.parents) if not p.exists()]
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-{os.getpid()}-", dir=output_dir.parent))
    except OSError as err:
        raise EmberError(f"-o {output_dir}: cannot write there ({err.strerror or err})") from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created:  # deepest first
            try:
                parent.rmdir()
            except OSError:
                break
        raise


def remove_stale_leftovers(output_dir: Path) -> list[Path]:
    """Remove `.OUT.partial-PID-*` / `.OUT.old-PID-*` directories of compiles that no longer run."""
    parent = output_dir.parent
    if not parent.is_dir():
        return []
    removed = []
    for path in parent.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if (match and match["name"] == output_dir.name and path.is_dir() and not path.is_symlink()
                and not _process_alive(int(match["pid"]))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.warning("removed %d directories left by interrupted compiles to %s: %s",
                    len(removed), output_dir, _list([p.name for p in removed]))
    return removed


def replace_dir(staging: Path, output_dir: Path) -> None:
    """Move the finished `staging` to OUT, replacing an older artifact there (checked again:
    files may have appeared in it while this compile ran)."""
    staging.chmod(0o777 & ~_umask())  # mkdtemp made it private; an artifact is as shareable as any new directory
    if not output_dir.exists():
        staging.rename(output_dir)
        return
    check_output_dir(output_dir)
    old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-{os.getpid()}-", dir=output_dir.parent))
    output_dir.rename(old / "artifact")
    staging.rename(output_dir)
    shutil.rmtree(old, ignore_errors=True)


def _files_not_in_artifact(directory: Path) -> list[str]:
    """Paths under `directory` that its manifest does not list; every path if it has no ember manifest."""
    present = sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))
    if not present:
        return []
    listed = _listed_files(directory / MANIFEST_NAME)
    if listed is None:
        return present
    parents = {str(parent) for name in listed for parent in Path(name).parents}
    strangers = []
    for name in present:
        path = directory / name
        if path.is_symlink() or (path.is_dir() and name not in parents) or \
                (not path.is_dir() and name not in listed and name != MANIFEST_NAME):
            strangers.append(name)
    return strangers


def _listed_files(manifest_path: Path) -> set[str] | None:
    """The relative paths an ember manifest lists, or None if `manifest_path` is not one."""
    if manifest_path.is_symlink() or not manifest_path.is_file() or manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        return None
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data.get("format_version") if isinstance(data, dict) else None, int) \
            or not isinstance(files, dict):
        return None
    return {name for name in files if isinstance(name, str)}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
