"""The files of a checkpoint or adapter directory, opened as if a stranger wrote them.

Every file the frontend (and the runtime, for a LoRA adapter) reads goes through `checkpoint_file`: a name from a
config or an index (`../../etc/passwd`, an absolute path) or a symlink
(`tokenizer.json -> /etc/passwd`, which would be copied into the artifact) must
not reach outside the model directory, and a FIFO or device must not be opened
(a FIFO blocks `open()` forever; `/dev/zero` is read until memory runs out).
Symlinks are followed only inside the model directory or, for a snapshot of the
Hugging Face hub cache (`models--org--name/snapshots/REV/`), into that repo's own
`blobs/` folder, where the hub keeps the files its snapshots link to.
JSON is parsed by `parse_json` alone, with sizes bounded and NaN refused.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ember.core.errors import ModelError

MAX_JSON_BYTES = 16 * 1024 * 1024  # config, generation, index and tokenizer_config files are a few KiB
MAX_TOKENIZER_BYTES = 512 * 1024 * 1024  # tokenizer.json of a 256k vocabulary is ~30 MB


def is_onnx_file(path: Path) -> bool:
    """Whether `path` names an ONNX file, by its suffix (the format has no magic number); here, where the CLI
    can check a path without importing the compiler."""
    return Path(path).suffix.lower() == ".onnx" and Path(path).is_file()


def checkpoint_file(model_dir: Path, name: str, listed_in: Path | None = None) -> Path:
    """`model_dir/name`, checked to be a regular file inside the checkpoint; `listed_in` names the file naming it."""
    path = Path(model_dir) / name
    where = f"{listed_in}: entry {short_repr(name)}" if listed_in else str(path)
    try:
        resolved = path.resolve()
        roots = _allowed_roots(Path(model_dir))
        if not any(resolved.is_relative_to(root) for root in roots):
            raise ModelError(f"{where}: resolves to {resolved}, "
                             f"outside the model directory {roots[0]}; refusing to read it")
        if not path.exists():
            dangling = f" (a link to {os.readlink(path)}, which does not exist)" if path.is_symlink() else ""
            raise ModelError(f"{where}: file not found{dangling}")
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte, a name too long
        raise ModelError(f"{where}: cannot resolve the path: {err}") from None
    _check_regular(path, where)
    return path


def optional_checkpoint_file(model_dir: Path, name: str) -> Path | None:
    """`checkpoint_file(model_dir, name)`, or None if nothing (not even a dangling link) is there."""
    return checkpoint_file(model_dir, name) if os.path.lexists(Path(model_dir) / name) else None


def _allowed_roots(model_dir: Path) -> list[Path]:
    root = model_dir.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return [root, root.parent.parent / "blobs"]
    return [root]


def _check_regular(path: Path, where: str) -> int:
    """The size of `path`, refused unless it is (or links to) a regular file: never open a FIFO or device."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise ModelError(f"{where}: cannot read: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a directory" if stat.S_ISDIR(info.st_mode) else
                "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device or socket")
        raise ModelError(f"{where}: is {kind}, not a regular file")
    return info.st_size


def check_file_size(path: Path, limit: int) -> None:
    """Refuse `path` unless it is a regular file of at most `limit` bytes."""
    size = _check_regular(path, str(path))
    if size > limit:
        raise ModelError(f"{path}: {size} bytes is larger than the {limit} bytes such a file may have")


def parse_json(text: bytes | str, where: str) -> Any:
    """Parse JSON, refusing NaN/Infinity and nesting too deep for Python, with one line naming `where`."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, and NaN from _refuse_constant
        raise ModelError(f"{where}: malformed JSON: {err}") from None
    except RecursionError:
        raise ModelError(f"{where}: malformed JSON: nested too deeply") from None


def short_repr(value: Any) -> str:
    """`repr(value)` cut to 60 characters: a hostile value may be megabytes long."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json_object(path: Path, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """Parse a JSON file, raising `ModelError` naming it if absent, too large, malformed or not an object."""
    if not os.path.lexists(path):
        raise ModelError(f"{path}: file not found (is this a Hugging Face checkpoint directory?)")
    check_file_size(path, limit)
    with open(path, "rb") as f:
        text = f.read(limit + 1)  # the file may have grown since it was measured
    if len(text) > limit:
        raise ModelError(f"{path}: larger than the {limit} bytes such a file may have")
    data = parse_json(text, str(path))
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
