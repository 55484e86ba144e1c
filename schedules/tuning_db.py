"""A tuning database: meta_schedule's records in a directory, tagged with the CPU that measured them.

Layout of DIR:

    fingerprint.json              the machine the records were measured on (`cpu_fingerprint()`:
                                  architecture, CPU model, ISA extensions, cores), as that machine
                                  reports it: this one, or a farm device (`ember tune --rpc-tracker`)
    database_workload.json        meta_schedule's JSONDatabase: one line per workload (a kernel
    database_tuning_record.json   at its tuning shape) and one line per measured trial, appended
                                  as each trial finishes, so a job killed with kill -9 loses only
                                  the trials in flight and a rerun continues from the count on disk
    checks.json                   one line per best record checked against the rule (on the CPU that
                                  measured it): whether it agreed, by workload hash and knobs
    logs/                         meta_schedule's per-task logs

Timings are only meaningful on the CPU that took them. Tuning into a directory made on
another machine is refused (mixing machines would corrupt the ranking); compiling with
one of this machine's architecture is not an error but a notice, and the rules schedule
everything. A database a device of another architecture measured (`ember tune
--rpc-tracker`) applies to compiles for that device's target, and since its kernels cannot
run here, only the records checked against the rule on the device (`checks.json`) are used.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ember.core.errors import TuningError
from ember.core.writable import check_writable
from ember.targets.hardware import cpu_fingerprint

log = logging.getLogger("ember")

FINGERPRINT_NAME = "fingerprint.json"
CHECKS_NAME = "checks.json"
_TABLES = ("database_workload.json", "database_tuning_record.json")
LOGS_NAME = "logs"  # meta_schedule's per-task logs
_OWN_NAMES = {FINGERPRINT_NAME, CHECKS_NAME, LOGS_NAME, *_TABLES}


@dataclass
class TuningDatabase:
    """meta_schedule's records of the database at `path`, measured on the CPU of `fingerprint`: the
    JSONDatabase itself when tuning, an in-memory copy when compiling."""

    path: Path
    records: ms.database.Database
    fingerprint: dict[str, Any] = field(default_factory=cpu_fingerprint)
    # (structural hash of a workload, knobs) -> whether that record agreed with the rule where it was measured
    checks: dict[tuple[int, tuple[int, ...]], bool] = field(default_factory=dict)

    @property
    def measured_here(self) -> bool:
        """Whether this machine measured the records (else a device of another architecture did, over RPC)."""
        return self.fingerprint == cpu_fingerprint()

    def record_check(self, workload: tvm.IRModule, knobs: list[int], agrees: bool, max_error: float) -> None:
        """Note that the record of `knobs` did (or did not) agree with the rule on the CPU that measured it:
        what a compile for a device of another architecture, which cannot run the kernels, goes by."""
        key = (tvm_ffi.structural_hash(workload), tuple(knobs))
        self.checks[key] = agrees
        line = {"workload": key[0], "knobs": list(knobs), "agrees": agrees, "max_error": max_error}
        try:
            with open(self.path / CHECKS_NAME, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as err:
            raise TuningError(f"--db {self.path}: cannot write the tuning database ({err})") from None

    def checked(self, workload: tvm.IRModule, knobs: list[int]) -> bool | None:
        """Whether the record of `knobs` agreed with the rule where it was measured (None: never checked)."""
        return self.checks.get((tvm_ffi.structural_hash(workload), tuple(knobs)))

    @classmethod
    def for_tuning(cls, path: Path, fingerprint: dict[str, Any] | None = None) -> TuningDatabase:
        """Open (or create) `path` to add records measured on the CPU of `fingerprint` (default: this machine's;
        a farm device's as it reports it over RPC)."""
        path = Path(path)
        fingerprint = fingerprint or cpu_fingerprint()
        if check_for_tuning(path, fingerprint) is None:
            try:
                path.mkdir(parents=True, exist_ok=True)
                (path / FINGERPRINT_NAME).write_text(json.dumps(fingerprint, indent=2))
            except OSError as err:
                raise TuningError(f"--db {path}: cannot write the tuning database ({err})") from None
        for name in _TABLES:
            _drop_torn_line(path / name)
        return cls(path, _json_database(path, "--db"), fingerprint, _read_checks(path))

    @classmethod
    def for_compiling(cls, path: Path) -> TuningDatabase | None:
        """Open `path` to read records, writing nothing there; None (with a notice) if another machine made it."""
        path = Path(path)
        theirs = _read_fingerprint(path, "--tuning-db")
        if theirs is None:
            raise TuningError(f"--tuning-db {path}: not a tuning database (no {FINGERPRINT_NAME}); "
                              "make one with `ember tune --db`")
        here = cpu_fingerprint()
        if theirs != here and theirs.get("machine") == here["machine"]:
            log.warning("tuning database %s was made on %s; ignoring it", path, describe(theirs))
            return None
        # A device of another architecture (tuned with --rpc-tracker): its records apply to compiles for it.
        # meta_schedule's JSONDatabase opens its tables for appending: load a private copy of their whole
        # lines into memory, so a read-only (or shared) database stays untouched.
        with tempfile.TemporaryDirectory(prefix="ember-tuning-db-") as copy:
            for name in _TABLES:
                try:
                    data = (path / name).read_bytes()
                except FileNotFoundError:
                    data = b""
                except OSError as err:
                    raise TuningError(f"--tuning-db {path / name}: unreadable ({err.strerror or err})") from None
                (Path(copy) / name).write_bytes(data[: data.rfind(b"\n") + 1])
            on_disk = _json_database(Path(copy), "--tuning-db", shown=path)
        in_memory = ms.database.MemoryDatabase(module_equality="structural")
        for record in on_disk.get_all_tuning_records():
            entry = in_memory.commit_workload(record.workload.mod)
            in_memory.commit_tuning_record(ms.database.TuningRecord(
                record.trace, entry, record.run_secs, record.target, record.args_info))
        return cls(path, in_memory, theirs, _read_checks(path))

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


def check_for_tuning(path: Path, fingerprint: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Refuse a `--db` that is no tuning database directory or was made on another CPU than the one of
    `fingerprint` (default: this machine's), before minutes of work; its fingerprint, or None where there
    is no database yet."""
    theirs = _read_fingerprint(Path(path), "--db")
    _check_only_own_files(Path(path), theirs is not None)
    check_writable(Path(path), "--db")
    here = fingerprint or cpu_fingerprint()
    if theirs is not None and theirs != here:
        whose = "this machine" if fingerprint is None else "the devices measuring"
        raise TuningError(f"--db {path} was made on {describe(theirs)}, not {whose} ({describe(here)}); "
                          "tune into another directory")
    return theirs


def describe(fingerprint: dict[str, Any]) -> str:
    """A machine fingerprint in words."""
    isa = "/".join(fingerprint.get("isa", [])) or "no listed ISA extensions"
    cpu, machine, cores = (fingerprint.get(key, "?") for key in ("cpu", "machine", "cores"))
    return f"{cpu} ({machine}, {isa}, {cores} cores)"


def _read_fingerprint(path: Path, option: str) -> dict[str, Any] | None:
    """The fingerprint in the database directory `path` (given as `option`); None if there is none yet."""
    if path.exists() and not path.is_dir():
        raise TuningError(f"{option} {path}: not a directory (a tuning database is a directory `ember tune` writes)")
    fingerprint = path / FINGERPRINT_NAME
    if fingerprint.exists() and not fingerprint.is_file():
        raise TuningError(f"{option} {fingerprint}: not a regular file")
    try:
        data = json.loads(fingerprint.read_text(encoding="utf-8")) if fingerprint.exists() else None
    except (OSError, ValueError, RecursionError) as err:
        raise TuningError(f"{option} {fingerprint}: unreadable ({err}); tune into a new directory") from None
    if data is not None and not isinstance(data, dict):
        raise TuningError(f"{option} {fingerprint}: not a JSON object; tune into a new directory")
    return data


def _check_only_own_files(path: Path, has_fingerprint: bool) -> None:
    """Refuse a --db directory that holds anything but what `ember tune` writes (a user's files would be
    overwritten or mixed with records), or that holds some of it without the fingerprint that starts a database."""
    try:
        with os.scandir(path) as entries:
            names = sorted(entry.name for entry in entries)
    except FileNotFoundError:
        return
    except OSError as err:
        raise TuningError(f"--db {path}: cannot be read ({err.strerror or err})") from None
    strangers = [name for name in names if name not in _OWN_NAMES]
    if strangers or (names and not has_fingerprint):
        shown = ", ".join((strangers or names)[:5]) + (" and more" if len(strangers or names) > 5 else "")
        raise TuningError(f"--db {path}: exists and is not a tuning database of `ember tune` (holds {shown}); "
                          "give a new or empty directory, or one `ember tune --db` made")


def _read_checks(path: Path) -> dict[tuple[int, tuple[int, ...]], bool]:
    """The checks of records against the rule in `path` (`record_check`), the last of each kept; a torn or
    damaged line is skipped (its record then counts as unchecked)."""
    checks = {}
    try:
        lines = (path / CHECKS_NAME).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return checks
    except (OSError, UnicodeDecodeError) as err:
        raise TuningError(f"{path / CHECKS_NAME}: unreadable ({err})") from None
    for line in lines:
        try:
            check = json.loads(line)
            checks[(int(check["workload"]), tuple(int(k) for k in check["knobs"]))] = bool(check["agrees"])
        except (ValueError, KeyError, TypeError):
            continue
    return checks


def _json_database(path: Path, option: str, shown: Path | None = None) -> ms.database.JSONDatabase:
    try:
        return ms.database.JSONDatabase(work_dir=str(path), module_equality="structural")
    except Exception as err:  # TVM reports a damaged line as a bare TVMError
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise TuningError(f"{option} {shown or path}: the tuning records are damaged ({reason}); "
                          "tune into a new directory") from None


def _drop_torn_line(file: Path) -> None:
    """Cut a last line left half-written by a killed job (each record is one line, so the rest is whole)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return
    if data and not data.endswith(b"\n"):
        file.write_bytes(data[: data.rfind(b"\n") + 1])
