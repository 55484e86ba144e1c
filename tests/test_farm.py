"""A device farm on loopback: a TVM RPC tracker and ember devices (`python -m ember.runtime.rpc_device`) on
127.0.0.1, used by `ember bench --rpc-tracker` and `ember tune --rpc-tracker`.

Every process a test starts listens on 127.0.0.1 only and is killed (by its process id) when the test
module ends; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import REPO_ROOT, assert_one_line_error, run_ember

from ember.core.errors import FarmError
from ember.driver.farm import Farm

KEY = "loopback"
START_SECONDS = 60  # for a tracker or a device to come up (TVM's import takes seconds on a busy machine)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackFarm:
    """A tracker on 127.0.0.1 and the device processes started against it, all killed by `close`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        self.processes: list[subprocess.Popen] = []
        self.tracker = self._start("tracker", "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                   "--port", str(self.port), "--port-end", str(self.port + 1))
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                Farm("127.0.0.1", self.port, KEY).summary()
                return
            except FarmError:
                time.sleep(0.5)
        raise AssertionError(f"the tracker did not start: {self.log('tracker')}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_device(self, key: str = KEY, bare: bool = False, python: tuple[str, ...] = (sys.executable,),
                     env: dict[str, str] | None = None, seconds: float = START_SECONDS) -> subprocess.Popen:
        """An ember device of `key` (or TVM's bare rpc_server) run by `python`, once the tracker lists it."""
        before = Farm("127.0.0.1", self.port, key).devices()
        module = "tvm.exec.rpc_server" if bare else "ember.runtime.rpc_device"
        port = free_port()
        name = f"device-{len(self.processes)}"
        device = self._start(name, "-m", module, "--tracker", self.address, "--key", key, "--host", "127.0.0.1",
                             "--port", str(port), "--port-end", str(port + 50), python=python, env=env)
        deadline = time.monotonic() + seconds
        while Farm("127.0.0.1", self.port, key).devices() <= before:
            assert time.monotonic() < deadline and device.poll() is None, \
                f"the device did not register: {self.log(name)}"
            time.sleep(0.5)
        return device

    def stop(self, process: subprocess.Popen) -> None:
        """Kill a process this farm started and its children (SIGKILL: as a device that loses power). TVM's
        tracker and stock rpc_server serve from a worker process of their own, in the process group the
        farm gave each (its id is the process's)."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)

    def close(self) -> None:
        for process in reversed(self.processes):
            self.stop(process)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def _start(self, name: str, *args: str, python: tuple[str, ...] = (sys.executable,),
               env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        process = subprocess.Popen([*python, *args], cwd=self.log_dir, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, **(env or {})})
        self.processes.append(process)
        return process


@contextmanager
def loopback_farm(log_dir: Path) -> Iterator[LoopbackFarm]:
    farm = LoopbackFarm(log_dir)
    try:
        yield farm
    finally:
        farm.close()


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[LoopbackFarm]:
    """A tracker with two ember devices of `KEY`."""
    with loopback_farm(tmp_path_factory.mktemp("farm")) as farm:
        farm.start_device()
        farm.start_device()
        yield farm


def bench_json(*args: str) -> dict:
    result = run_ember("bench", *args, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_bench_on_a_device_matches_this_machine(farm, tiny_models):
    """The same greedy tokens through the tracker as here, and tok/s of the same order: one machine, so only
    noise and the session process differ. One thread and runs alternated, best of two each, so that other
    work on a shared 2-core machine slows both sides alike."""
    artifact = str(tiny_models["llama"].artifact_dir)
    options = ("--prompt-tokens", "64", "--new-tokens", "32", "--repeats", "3", "--threads", "1")
    remote = ("--rpc-tracker", farm.address, "--device-key", KEY)
    here, there = zip(*[(bench_json(artifact, *options), bench_json(artifact, *options, *remote)) for _ in range(2)])
    assert here[0]["where"] == "this machine" and there[0]["where"] == f"device {KEY!r} via tracker {farm.address}"
    assert all(run["tokens"] == here[0]["tokens"] and run["tokens_repeat"] for run in here + there)
    assert len(here[0]["tokens"]) == 33 and there[0]["fingerprint"] == here[0]["fingerprint"]
    for phase in ("prefill", "decode"):
        ratio = max(run[f"{phase}_tokens_per_s"] for run in there) / max(run[f"{phase}_tokens_per_s"] for run in here)
        assert 1 / 3 < ratio < 3, (phase, ratio)
    assert there[0]["upload_seconds"] is not None and there[0]["peak_memory_bytes"] > 0
    assert there[0]["threads"] == 1
    # Same CPU as this machine: its measured bandwidth is the roofline.
    assert there[0]["hardware"] == "host" and there[0]["decode_roofline_share"] > 0


def test_bench_text_report(farm, tiny_models):
    result = run_ember("bench", str(tiny_models["llama"].artifact_dir), "--prompt-tokens", "16", "--new-tokens",
                       "8", "--repeats", "1", "--rpc-tracker", farm.address, "--device-key", KEY)
    assert result.returncode == 0, result.stderr
    assert f"on device {KEY!r} via tracker {farm.address}" in result.stdout
    for text in ("uploaded", "prefill", "decode", "tok/s", "of the bandwidth roofline", "peak memory",
                 "greedy tokens"):
        assert text in result.stdout, result.stdout


def test_bench_refuses_a_key_without_devices_in_bounded_time(farm, tiny_models):
    start = time.monotonic()
    result = run_ember("bench", str(tiny_models["llama"].artifact_dir), "--rpc-tracker", farm.address,
                       "--device-key", "nobody", "--wait", "2")
    assert time.monotonic() - start < 60
    assert_one_line_error(result, "no device of key 'nobody' registered with tracker", "within 2 s",
                          f"keys registered: {KEY}", "python -m ember.runtime.rpc_device")


@pytest.mark.slow
def test_unreachable_tracker_names_the_address(tiny_models):
    address = f"127.0.0.1:{free_port()}"
    result = run_ember("bench", str(tiny_models["llama"].artifact_dir), "--rpc-tracker", address,
                       "--device-key", KEY)
    assert_one_line_error(result, f"--rpc-tracker {address}: cannot reach the tracker",
                          "python -m tvm.exec.rpc_tracker")


def test_a_bare_tvm_rpc_server_is_named(farm, tiny_models):
    """TVM's stock rpc_server measures kernels but serves no ember functions: the error says what to run instead."""
    device = farm.start_device("bare", bare=True)
    try:
        result = run_ember("bench", str(tiny_models["llama"].artifact_dir), "--rpc-tracker", farm.address,
                           "--device-key", "bare", "--wait", "10")
        assert_one_line_error(result, "serves no ember functions", "python -m ember.runtime.rpc_device")
    finally:
        farm.stop(device)


def test_farm_options_are_checked():
    assert_one_line_error(run_ember("bench", "x", "--device-key", KEY), "--device-key needs --rpc-tracker")
    with pytest.raises(FarmError, match="expected HOST:PORT"):
        Farm.parse("localhost", KEY)
    with pytest.raises(FarmError, match="--device-key is needed"):
        Farm.parse("127.0.0.1:9190", None)


def test_device_writes_stay_in_the_session_directory(tmp_path, monkeypatch):
    import tvm_ffi

    from ember.runtime import rpc_device

    tvm_ffi.register_global_func("tvm.rpc.server.workpath", lambda path: str(tmp_path / path), override=True)
    rpc_device._write("artifact/params/a.bin", 0, bytearray(b"abc"))
    rpc_device._write("artifact/params/a.bin", 3, bytearray(b"def"))
    assert (tmp_path / "artifact/params/a.bin").read_bytes() == b"abcdef"
    for path in ("../escape", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(ValueError, match="not a relative path"):
            rpc_device._write(path, 0, bytearray(b"x"))
    assert json.loads(rpc_device._fingerprint())["fingerprint"]["cores"] >= 1


RECORDS = "database_tuning_record.json"


def tune_command(farm: LoopbackFarm, checkpoint: Path, db: Path, trials: int, kernels: int = 1,
                 key: str = KEY) -> list[str]:
    return [sys.executable, "-m", "ember", "tune", str(checkpoint), "--db", str(db), "--trials", str(trials),
            "--kernels", str(kernels), "--prefill-chunk", "64", "--rpc-tracker", farm.address, "--device-key", key]


def record_lines(db: Path) -> int:
    return len((db / RECORDS).read_text().splitlines()) if (db / RECORDS).exists() else 0


def start_job(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_records(db: Path, job: subprocess.Popen, count: int = 1, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while record_lines(db) < count and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert record_lines(db) >= count, job.communicate(timeout=60)


def compile_applies(tiny_models, db: Path, out: Path, kernels: int) -> None:
    """`ember compile --tuning-db` takes the database: each tuned kernel is scheduled by its record, or
    by the rule where the rule measured fastest."""
    compiled = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(out), "--tuning-db", str(db),
                         "--prefill-chunk", "64", "--no-progress", timeout=300)
    assert compiled.returncode == 0, compiled.stderr
    applied = re.search(r"(\d+) kernels from the tuning database, (\d+) where the rule's schedule won", compiled.stdout)
    assert applied and int(applied[1]) + int(applied[2]) == kernels, compiled.stdout + compiled.stderr


@pytest.mark.slow
def test_tune_on_two_devices_keys_the_database_by_their_fingerprint(farm, tiny_models, tmp_path):
    db = tmp_path / "db"
    job = subprocess.run(tune_command(farm, tiny_models.checkpoint("llama"), db, trials=8, kernels=2),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stderr
    assert f"2 devices of key {KEY!r}:" in job.stderr, job.stderr
    assert f"(2 devices of {KEY!r} serving)" in job.stderr, job.stderr
    assert job.stdout == f"tuned 2 kernels into {db}\n", job.stdout
    reported = Farm("127.0.0.1", farm.port, KEY).fingerprints()
    assert len(reported) == 2 and all(fp == json.loads((db / "fingerprint.json").read_text()) for fp in reported)
    assert record_lines(db) >= 8
    compile_applies(tiny_models, db, tmp_path / "artifact", kernels=2)


def test_tune_against_a_key_without_devices_fails_in_bounded_time(farm, tiny_models, tmp_path):
    start = time.monotonic()
    result = run_ember("tune", str(tiny_models.checkpoint("llama")), "--db", str(tmp_path / "db"),
                       "--rpc-tracker", farm.address, "--device-key", "nobody", "--wait", "3")
    assert time.monotonic() - start < 90
    assert_one_line_error(result, "no device of key 'nobody' registered with tracker", "within 3 s")
    assert not (tmp_path / "db").exists()


def test_a_device_database_applies_to_compiles_for_its_architecture(tmp_path, caplog):
    """A database an aarch64 device measured: a compile for that target takes the records the device checked
    against the rule (their kernels cannot run here to be checked again), and a compile for this CPU none."""
    import logging

    import tvm
    from test_tuning import nt_matmul

    from ember.schedules.tuning import SCHEDULE_SOURCE_ATTR, apply_tuning_database, knobs_record, rule_knobs, workload
    from ember.schedules.tuning_db import TuningDatabase
    from ember.targets.registry import resolve_target

    board, func = resolve_target("raspberry-pi-5"), nt_matmul()
    device = {"machine": "aarch64", "cpu": "Cortex-A76", "isa": ["asimd"], "cores": 4}
    tuning = TuningDatabase.for_tuning(tmp_path / "db", device)
    knobs = [2, 8, 2] if rule_knobs(func, board) != [2, 8, 2] else [1, 16, 4]
    tuning.records.commit_tuning_record(knobs_record(workload(func), tuning, board, 1e-10, knobs))

    def source(target) -> str | None:
        database = TuningDatabase.for_compiling(tmp_path / "db")
        assert database is not None and not database.measured_here
        with target.target:
            applied = apply_tuning_database(database, target)(tvm.IRModule({"nt": func}))
        return (applied["nt"].attrs or {}).get(SCHEDULE_SOURCE_ATTR)

    with caplog.at_level(logging.WARNING, logger="ember"):
        assert source(board) is None
    assert "was never checked against the rule on the device" in caplog.text
    tuning.record_check(workload(func), knobs, False, 0.5)
    assert source(board) is None and "differed from the rule on the device" in caplog.text
    tuning.record_check(workload(func), knobs, True, 0.0)
    assert source(board) == "tuning"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert source(resolve_target("cpu")) is None
    assert "made on Cortex-A76 (aarch64" in caplog.text and "ignoring it" in caplog.text


@pytest.mark.slow
def test_bench_on_an_emulated_aarch64_device(farm, arm64_python, demo_builds, tmp_path):
    """An aarch64 device under qemu-aarch64 (scripts/setup_arm64.sh), with ember's runtime package and TVM's runtime
    library only, joins the tracker; `ember bench` of the demo compiled for raspberry-pi-5 runs there and gives the
    greedy tokens of the x86 build (correctness only: emulated speed means nothing). The aarch64 artifact is
    refused by the x86 devices before any upload."""
    board, x86 = demo_builds.get("raspberry-pi-5", "q0f32"), demo_builds.get("cpu", "q0f32")
    package = tmp_path / "package"
    assert run_ember("package", str(board), "-o", str(package)).returncode == 0
    # ember's runtime from the package alone: the device has no ember checkout, compiler or torch.
    device = farm.start_device("arm64", python=tuple(arm64_python), seconds=300,
                               env={"PYTHONPATH": str(package), "TVM_USE_RUNTIME_LIB": "1"})
    try:
        options = ("--prompt-tokens", "32", "--new-tokens", "16", "--repeats", "1")
        there = bench_json(str(board), *options, "--rpc-tracker", farm.address, "--device-key", "arm64")
        here = bench_json(str(x86), *options)
        assert there["fingerprint"]["machine"] == "aarch64" and there["tokens"] == here["tokens"]
        assert there["hardware"] == "raspberry-pi-5" and there["decode_roofline_share"] > 0
        refused = run_ember("bench", str(board), "--rpc-tracker", farm.address, "--device-key", KEY)
        assert_one_line_error(refused, "was compiled for aarch64", f"device {KEY!r} via tracker", "is x86_64")

        # Tuning for the board on it: kernels cross-linked here, timed and checked there; compile applies them.
        db = tmp_path / "db"
        tuned = run_ember("tune", "demo", "--target", "raspberry-pi-5", "--db", str(db), "--trials", "3",
                          "--kernels", "1", "--rpc-tracker", farm.address, "--device-key", "arm64", timeout=900)
        assert tuned.returncode == 0, tuned.stderr
        assert json.loads((db / "fingerprint.json").read_text())["machine"] == "aarch64"
        assert len((db / "checks.json").read_text().splitlines()) == 1
        compiled = run_ember("compile", "demo", "--target", "raspberry-pi-5", "-o", str(tmp_path / "tuned"),
                             "--tuning-db", str(db), "--no-progress", timeout=600)
        assert compiled.returncode == 0, compiled.stderr
        applied = re.search(r"(\d+) kernels from the tuning database, (\d+) where the rule's schedule won",
                            compiled.stdout)
        assert applied and int(applied[1]) + int(applied[2]) == 1, compiled.stdout + compiled.stderr
    finally:
        farm.stop(device)


@pytest.mark.slow
@pytest.mark.farm
def test_tuning_outlives_its_devices_and_its_own_kill(tiny_models, tmp_path):
    """The faults of a tuning job over RPC, on one farm of two devices:
    1. one device is killed (SIGKILL, as a device losing power) once the first trials are recorded: the
       measurement in flight there fails and the job completes on the other device;
    2. a rerun for more trials is killed itself (kill -9 of the job and its builder and runner workers);
    3. the next rerun resumes from the records of both (on the device the killed job held: the tracker gave it
       back), and when that device dies too, ends before its next round in one line (within --wait), keeping
       its records."""
    db, checkpoint = tmp_path / "db", tiny_models.checkpoint("llama")
    with loopback_farm(tmp_path) as flaky:
        devices = [flaky.start_device("flaky"), flaky.start_device("flaky")]
        # Each of the two hottest kernels (decode GEMVs) has 9 knob tuples, measured and recorded 4 at a time.
        # 1: 8 trials of the hottest; 2: its 9th, then 4 of the second before the kill; 3: the second resumes.
        job = start_job(tune_command(flaky, checkpoint, db, trials=8, key="flaky"))
        try:
            wait_for_records(db, job)
            flaky.stop(devices[0])
            _, completed = job.communicate(timeout=600)
            assert job.returncode == 0, completed
            assert "8/8 trials" in completed and "(1 device of 'flaky' serving)" in completed, completed
            assert record_lines(db) >= 8

            job = start_job(tune_command(flaky, checkpoint, db, trials=64, kernels=2, key="flaky"))
            wait_for_records(db, job, count=9 + 4)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
        kept = record_lines(db)
        second_kernel = kept - 9  # the hottest kernel's 9 tuples are all on disk
        job = start_job(tune_command(flaky, checkpoint, db, trials=64, kernels=2, key="flaky") + ["--wait", "3"])
        try:
            # The hottest kernel's evaluation may record one line (its rule's knobs) before the second kernel
            # runs a round: one more line is the second kernel's (a round commits its records, then prints).
            wait_for_records(db, job, count=kept + 2)
            flaky.stop(devices[1])
            _, stopped = job.communicate(timeout=300)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1, stopped
    # "registered with tracker", or "became free" while the tracker has not yet noticed the device is gone.
    last = stopped.strip().splitlines()[-1]
    assert last.startswith("ember: error: no device of key 'flaky'") and "within 3 s" in last, stopped
    assert "Traceback" not in stopped and record_lines(db) > kept
    # The hottest kernel is complete (no round of it runs); the second continues from its trials on disk.
    first_count = re.search(r"(\d+)/\d+ trials", stopped)
    assert first_count and int(first_count[1]) > second_kernel, stopped
