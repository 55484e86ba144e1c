"""A tuning database: meta_schedule's records in a directory, tagged with the CPU that measured them.

Layout of DIR:

    fingerprint.json              the machine the records were measured on (`cpu_fingerprint()`:
                                  architecture, CPU model, ISA extensions, cores)
    database_workload.json        meta_schedule's JSONDatabase: one line per workload (a kernel
    database_tuning_record.json   at its tuning shape) and one line per measured trial, appended
                                  as each trial finishes, so a job killed with kill -9 loses only
                                  the trials in flight and a rerun continues from the count on disk
    logs/                         meta_schedule's per-task logs

Timings are only meaningful on the CPU that took them. Tuning into a directory made on
another machine is refused (mixing machines would corrupt the ranking); compiling with
one is not an error but a notice, and the rules schedule everything.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ember.errors import TuningError
from ember.targets.hardware import cpu_fingerprint

log = logging.getLogger("ember")

FINGERPRINT_NAME = "fingerprint.json"


@dataclass
class TuningDatabase:
    """meta_schedule's JSONDatabase at `path`, measured on this machine."""

    path: Path
    records: ms.database.JSONDatabase

    @classmethod
    def for_tuning(cls, path: Path) -> TuningDatabase:
        """Open (or create) `path` to add records measured on this machine."""
        path = Path(path)
        here = cpu_fingerprint()
        theirs = _read_fingerprint(path)
        if theirs is None:
            try:
                path.mkdir(parents=True, exist_ok=True)
                (path / FINGERPRINT_NAME).write_text(json.dumps(here, indent=2))
            except OSError as err:
                raise TuningError(f"--db {path}: cannot write the tuning database ({err})") from None
        elif theirs != here:
            raise TuningError(f"--db {path} was made on {describe(theirs)}, not this machine ({describe(here)}); "
                              "tune into another directory")
        return cls(path, _json_database(path))

    @classmethod
    def for_compiling(cls, path: Path) -> TuningDatabase | None:
        """Open `path` to read records; None (with a notice) if another machine made it."""
        path = Path(path)
        theirs = _read_fingerprint(path)
        if theirs is None:
            raise TuningError(f"--tuning-db {path}: not a tuning database (no {FINGERPRINT_NAME}); "
                              "make one with `ember tune --db`")
        here = cpu_fingerprint()
        if theirs != here:
            log.warning("tuning database %s was made on %s; ignoring it", path, describe(theirs))
            return None
        return cls(path, _json_database(path))

    def trials(self, workload: tvm.IRModule) -> int:
        """How many trials of `workload` are on disk (failed builds and runs included)."""
        if not self.records.has_workload(workload):
            return 0
        entry = self.records.commit_workload(workload)
        return sum(1 for record in self.records.get_all_tuning_records() if record.workload.same_as(entry))

    def best(self, workload: tvm.IRModule, target: Target) -> ms.database.TuningRecord | None:
        """The fastest successful record of `workload` for `target`, if any."""
        if not self.records.has_workload(workload):
            return None
        return self.records.query_tuning_record(workload, target, "main")


def describe(fingerprint: dict[str, Any]) -> str:
    """A machine fingerprint in words."""
    isa = "/".join(fingerprint.get("isa", [])) or "no listed ISA extensions"
    cpu, machine, cores = (fingerprint.get(key, "?") for key in ("cpu", "machine", "cores"))
    return f"{cpu} ({machine}, {isa}, {cores} cores)"


def _read_fingerprint(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / FINGERPRINT_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise TuningError(f"{path / FINGERPRINT_NAME}: unreadable ({err}); delete the directory and tune again") \
            from None
    if not isinstance(data, dict):
        raise TuningError(f"{path / FINGERPRINT_NAME}: not a JSON object; delete the directory and tune again")
    return data


def _json_database(path: Path) -> ms.database.JSONDatabase:
    for name in ("database_workload.json", "database_tuning_record.json"):
        _drop_torn_line(path / name)
    try:
        return ms.database.JSONDatabase(work_dir=str(path), module_equality="structural")
    except Exception as err:  # TVM reports a damaged line as a bare TVMError
        raise TuningError(f"{path}: the tuning records are damaged ({err}); delete the directory and tune again") \
            from None


def _drop_torn_line(file: Path) -> None:
    """Cut a last line left half-written by a killed job (each record is one line, so the rest is whole)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return
    if data and not data.endswith(b"\n"):
        file.write_bytes(data[: data.rfind(b"\n") + 1])
