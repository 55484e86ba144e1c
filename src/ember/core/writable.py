"""Output paths checked before any work: a directory ember will create or fill must be one it can write.

Permission bits do not answer that (root ignores them; a read-only mount, an immutable directory, `/proc` and
`/sys` refuse root too), so the check does what the work will do: it creates a directory where the output goes
(inside the output if that exists, else in its nearest existing ancestor; beside it for an output that is staged
next to its place) and removes it at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ember.core.errors import EmberError


def check_writable(path: Path, option: str, beside: bool = False) -> None:
    """Refuse `path` (given as `option`, e.g. "--dump-ir") unless a directory can be made where it is or would be
    made, naming the reason; `beside`: where the work writes next to `path` (a staging directory) instead."""
    place = Path(os.path.abspath(path))
    place = place.parent if beside else place
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise EmberError(f"{option} {path}: {place} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ember-write-check-", dir=place))
    except OSError as err:
        raise EmberError(f"{option} {path}: cannot write in {place} ({err.strerror or err})") from None


def check_apart(first: Path, first_option: str, second: Path, second_option: str) -> None:
    """Refuse two output paths that are the same or one inside the other: each is replaced or filled whole."""
    a, b = (Path(os.path.realpath(p)) for p in (first, second))
    if a == b or a in b.parents or b in a.parents:
        inner, outer = ((first_option, first), (second_option, second)) if b in a.parents or a == b else (
            (second_option, second), (first_option, first))
        raise EmberError(f"{inner[0]} {inner[1]}: is {'the same as' if a == b else 'inside'} {outer[0]} "
                         f"{outer[1]}; give them separate directories")
