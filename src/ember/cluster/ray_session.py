"""Joining a Ray cluster for `ember serve --ray`, or starting one on this machine; a start-up that a signal stops.

An address is checked with Ray's own handshake (its GCS's `GetClusterId`, carrying a token where
RAY_AUTH_MODE=token says to) within CONNECT_TIMEOUT before `ray.init`, which would retry for minutes at anything
else. Without an address, ember starts the cluster itself, `ray start --head --block` in a session of its own (token
authentication set up as `ray.init()` sets it up for a cluster it starts), so that stopping it is one signal to one
process group, however many processes Ray started.

Start-up waits in Ray's C++ client, where Python runs no signal handler until the call returns (seconds; minutes for
a replica that loads a large artifact). Within a `StartUp` block, SIGINT and SIGTERM wake a thread
through the signal's own wakeup byte (`signal.set_wakeup_fd`), which stops the local cluster, says one line and
ends the process at once: exit 130 for SIGINT, 143 for SIGTERM. A cluster joined by address keeps running; Ray
stops the actors this process started when it is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO

from ember.core.errors import EmberError

try:
    import ray
    from ray.exceptions import RayError
except ImportError as err:
    raise EmberError(f"ember serve --ray needs Ray ({err.name} is missing): pip install 'ember[cluster]'") from None

CONNECT_TIMEOUT = 10.0  # seconds for a cluster address to answer before `--ray ADDRESS` gives up
LOCAL_START_TIMEOUT = 240.0  # seconds for `ray start --head` to come up on a loaded small machine
MAX_SOCKET_PATH = 107  # bytes of an AF_UNIX socket's path on Linux
_STARTED = "Ray runtime started"  # what `ray start` prints once the head serves


@dataclass
class LocalCluster:
    """A one-node Ray cluster started by this process: its `ray start --block` process leads a process group that
    holds every process Ray started for it."""

    process: subprocess.Popen
    address: str
    output: BinaryIO  # what `ray start` prints (an unlinked temporary file)

    @classmethod
    def start(cls, start_up: StartUp) -> LocalCluster:
        """Start the head on 127.0.0.1 (free ports, no dashboard) and wait until it serves; `start_up` knows of it
        from the moment its process exists."""
        port = _free_port()
        ports = [f"{flag}={_free_port()}" for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                                        "--dashboard-agent-grpc-port", "--metrics-export-port",
                                                        "--runtime-env-agent-port")]
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
                   "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats", *ports]
        _local_auth()
        output = tempfile.TemporaryFile()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        start_up.local = cluster = cls(process, f"127.0.0.1:{port}", output)
        try:
            cluster._wait_started()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _wait_started(self) -> None:
        """Wait until `ray start` says the head serves; one line if it ends or takes too long first."""
        deadline = time.monotonic() + LOCAL_START_TIMEOUT
        while _STARTED not in self._printed():
            if self.process.poll() is not None:
                lines = [line.strip() for line in self._printed().splitlines() if line.strip()]
                raise EmberError("--ray: the local Ray cluster failed to start: "
                                 f"{lines[-1] if lines else f'ray start exited with {self.process.returncode}'}")
            if time.monotonic() > deadline:
                raise EmberError(f"--ray: the local Ray cluster did not start within {LOCAL_START_TIMEOUT:g} s")
            time.sleep(0.1)

    def _printed(self) -> str:
        return os.pread(self.output.fileno(), 1 << 20, 0).decode(errors="replace")

    def stop(self) -> None:
        """Kill every process of the cluster and reap `ray start`: its process group, and the descendants that left
        it (Ray's workers lead groups of their own)."""
        descendants = _descendants(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self.output.close()


class RaySession:
    """This process's connection to a Ray cluster, and the local cluster it started, if any."""

    def __init__(self, local: LocalCluster | None) -> None:
        self.local = local

    def close(self) -> None:
        """Leave the cluster, and stop the one this process started."""
        ray.shutdown()
        if self.local is not None:
            self.local.stop()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignore(_signum: int, _frame: object) -> None:
    """The Python-level handler of `_SIGNALS` during start-up: the watcher thread acts on them."""


class StartUp:
    """Joining the cluster and starting what runs on it, as a block that SIGINT and SIGTERM end within a moment,
    whatever the main thread waits in (see the module docstring): `with StartUp() as start_up: ...`."""

    def __init__(self) -> None:
        self.local: LocalCluster | None = None  # the local cluster, once its process exists
        self._done = threading.Event()

    def __enter__(self) -> StartUp:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        self.claim_signals()
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="ember-start-up-signals", daemon=True)
        self._watcher.start()
        return self

    def claim_signals(self) -> None:
        """(Again) install Python-level handlers that do nothing: the C-level handler they imply writes the wakeup
        byte, which the watcher acts on while the main thread may not run Python for a while. `ray.init` installs
        C++ handlers of its own over them (which print a stack trace at SIGTERM)."""
        for sig in _SIGNALS:
            signal.signal(sig, _ignore)

    def __exit__(self, *_exc: object) -> None:
        self._done.set()
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the watcher reads the end of the pipe and returns
        self._watcher.join()
        os.close(self._read_fd)

    def _watch(self) -> None:
        received = os.read(self._read_fd, 1)
        if received and not self._done.is_set():
            self._end(received[0])

    def _end(self, signum: int) -> None:
        """Stop the local cluster, say why in one line, and end the process with the shell's code for `signum`."""
        if self.local is not None:
            self.local.stop()
        print("ember: interrupted" if signum == signal.SIGINT else "ember: terminated", file=sys.stderr, flush=True)
        os._exit(128 + signum)


def connect(address: str | None, threads: int, replicas: int, start_up: StartUp) -> RaySession:
    """Join the Ray cluster at `address` (host:port of its head), or start one on this machine when None, within
    `start_up`; refuse with one line an address that does not answer or a cluster with fewer CPUs than the replicas
    need."""
    local = None
    if address is None:
        _check_temp_dir()
        local = LocalCluster.start(start_up)
    else:
        _probe(address)
    session = RaySession(local)
    try:
        ray.init(address=local.address if local is not None else address, logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=False)
    except (RayError, ConnectionError, RuntimeError, ValueError) as err:
        session.close()
        where = f"--ray {address}" if address else "--ray"
        raise EmberError(f"{where}: cannot join the Ray cluster: {str(err).strip().splitlines()[0]}") from None
    finally:
        start_up.claim_signals()
    cpus = ray.cluster_resources().get("CPU", 0)
    if replicas * threads > cpus:
        session.close()
        raise EmberError(f"--replicas {replicas}: the Ray cluster has {cpus:g} CPUs and each replica takes {threads} "
                         f"(--threads), so at most {int(cpus // threads)} replicas fit")
    return session


def _descendants(root: int) -> list[int]:
    """The processes descended from `root`, read from /proc (the parent of each process is the 4th field of its
    `stat`, after the command name in parentheses)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    parent = int(stat.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):  # a process that ended meanwhile
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    """The token metadata Ray's own client would send to an address: a token (RAY_AUTH_TOKEN or ~/.ray/auth_token)
    only where RAY_AUTH_MODE=token says to send it, as Ray never sends one to an address unasked."""
    try:
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple,
        )
    except ImportError:  # a Ray without token authentication
        return ()
    return _get_authentication_metadata_tuple()


def _local_auth() -> None:
    """Token authentication for the local cluster, set up as `ray.init()` sets it up for a cluster it starts: on
    unless RAY_AUTH_MODE says otherwise, with a token generated into ~/.ray/auth_token where there is none.
    `ray start` and this process's client both take it from the environment."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    notes = logging.getLogger(enable_token_auth_by_default.__module__)  # its note that auth is on: ember's default
    level = notes.level
    notes.setLevel(logging.ERROR)
    try:
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    finally:
        notes.setLevel(level)


def _probe(address: str) -> None:
    """Raise one line unless a Ray cluster's head answers at `address` within CONNECT_TIMEOUT: its GCS must answer
    a GetClusterId call, the first thing `ray.init` asks. Pointed at anything else (a web server, a gRPC server of
    another kind, one that accepts and then says nothing), `ray.init` would retry for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EmberError(f"--ray {address}: not HOST:PORT (the address `ray start --head` prints)")
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT, metadata=_auth_metadata())
        except grpc.RpcError as err:
            details = err.details() or ""
            if err.code() == grpc.StatusCode.UNAVAILABLE and ("refused" in details or "resol" in details.lower()):
                reason = details.rpartition(": ")[2] or "unreachable"
                raise EmberError(f"--ray {address}: no Ray cluster answers there ({reason})") from None
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise EmberError(f"--ray {address}: the Ray cluster there requires token authentication; set "
                                 "RAY_AUTH_MODE=token, with the head's token in RAY_AUTH_TOKEN or "
                                 "~/.ray/auth_token (Ray sends a token to an address only when told to)") from None
            reason = (f"it did not answer Ray's handshake within {CONNECT_TIMEOUT:g} s"
                      if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else
                      f"Ray's handshake failed: {err.code().name.lower()}")
            raise EmberError(f"--ray {address}: what answers there is not a Ray cluster's head ({reason})") from None


def _check_temp_dir() -> None:
    """Refuse a temporary directory so long that a local Ray cluster's socket paths would pass the 107 bytes an
    AF_UNIX path may have (Ray would fail deep in its start-up)."""
    from ray._common.utils import get_default_ray_temp_dir

    temp = get_default_ray_temp_dir()
    longest = os.path.join(temp, "session_2026-01-01_00-00-00_000000_4194304", "sockets", "plasma_store.99")
    if len(longest.encode()) > MAX_SOCKET_PATH:
        variable = "RAY_TMPDIR" if "RAY_TMPDIR" in os.environ else "TMPDIR"
        raise EmberError(f"{variable}: a local Ray cluster keeps its sockets under {temp}, whose "
                         f"{len(temp.encode())} bytes leave no room for their paths (an AF_UNIX path has at most "
                         f"{MAX_SOCKET_PATH} bytes); set {variable} to a shorter directory, such as /tmp")
