"""A device farm: TVM's RPC tracker and the devices registered with it under a key.

A farm is what AutoTVM and Ansor measure on: a tracker (`python -m tvm.exec.rpc_tracker`)
that devices join (`python -m ember.runtime.rpc_device --tracker HOST:PORT --key KIND`), and
clients that ask it for a session on any free device of a kind. `ember bench` and `ember tune
--rpc-tracker` are such clients. This module is their side of it, bounded in time everywhere:
a tracker that does not answer, a key no device has registered under and a device that never
frees up each end in one line naming what was asked for, never in a wait without end.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import rpc
from tvm.rpc import base as rpc_base

from ember.core.errors import FarmError
from ember.runtime.rpc_device import FINGERPRINT_FUNCTION

CONNECT_TIMEOUT = 5.0  # seconds to reach the tracker: on a LAN it answers in milliseconds
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Farm:
    """The devices of kind `key` registered with the tracker at `host`:`port`."""

    host: str
    port: int
    key: str
    wait_seconds: float = 60.0  # how long to wait for a device of `key` to register, or to be free

    @classmethod
    def parse(cls, tracker: str, key: str | None, wait_seconds: float = 60.0) -> Farm:
        """`--rpc-tracker HOST:PORT --device-key KEY` as given on the command line."""
        host, _, port = tracker.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FarmError(f"--rpc-tracker {tracker}: expected HOST:PORT, e.g. 127.0.0.1:9190")
        if not key:
            raise FarmError(f"--rpc-tracker {tracker}: --device-key is needed too (the kind of device to use, "
                            "as its rpc_device was started with --key)")
        if wait_seconds <= 0:
            raise FarmError(f"--wait {wait_seconds:g}: must be a positive number of seconds")
        return cls(host.strip("[]"), int(port), key, wait_seconds)

    @property
    def tracker(self) -> str:
        """The tracker's address as HOST:PORT."""
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """`device 'KEY' via tracker HOST:PORT`."""
        return f"device {self.key!r} via tracker {self.tracker}"

    def summary(self) -> dict[str, Any]:
        """The tracker's summary (servers and queues), refusing an unreachable address or one that is no tracker."""
        try:
            with socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT) as sock:
                sock.sendall(struct.pack("<i", rpc_base.RPC_TRACKER_MAGIC))
                magic = struct.unpack("<i", rpc_base.recvall(sock, 4))[0]
                if magic != rpc_base.RPC_TRACKER_MAGIC:
                    raise FarmError(f"--rpc-tracker {self.tracker}: something answers there, but not a TVM RPC tracker")
                rpc_base.sendjson(sock, [rpc_base.TrackerCode.SUMMARY])
                code, summary = rpc_base.recvjson(sock)
        except (OSError, ValueError, struct.error) as err:
            reason = "timed out" if isinstance(err, TimeoutError) else getattr(err, "strerror", None) or str(err)
            raise FarmError(f"--rpc-tracker {self.tracker}: cannot reach the tracker ({reason}); start one with "
                            f"`python -m tvm.exec.rpc_tracker --host {self.host} --port {self.port}`") from None
        if code != rpc_base.TrackerCode.SUCCESS:
            raise FarmError(f"--rpc-tracker {self.tracker}: the tracker refused a summary ({code})")
        return summary

    def devices(self) -> int:
        """How many devices of `key` are registered now (busy or free)."""
        return sum(1 for server in self.summary()["server_info"] if server["key"] == f"server:{self.key}")

    def wait_for_devices(self) -> int:
        """The number of devices of `key`, once there is one; refused after `wait_seconds` without any."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            count = self.devices()
            if count or time.monotonic() >= deadline:
                break
            time.sleep(POLL_SECONDS)
        if not count:
            keys = sorted({server["key"].split(":", 1)[-1] for server in self.summary()["server_info"]})
            registered = f"keys registered: {', '.join(keys)}" if keys else "no device is registered at all"
            raise FarmError(f"no device of key {self.key!r} registered with tracker {self.tracker} within "
                            f"{self.wait_seconds:g} s ({registered}); on the device run `python -m "
                            f"ember.runtime.rpc_device --tracker {self.tracker} --key {self.key}`")
        return count

    def session(self, session_timeout: float) -> rpc.RPCSession:
        """A session on a free device of `key` (waiting at most `wait_seconds` for one), which the device ends
        after `session_timeout` seconds."""
        self.wait_for_devices()
        result: list[Any] = []

        def request() -> None:
            try:
                tracker = rpc.connect_tracker(self.host, self.port)
                result.append(tracker.request(self.key, priority=1, session_timeout=session_timeout, max_retry=2))
            except Exception as err:  # noqa: BLE001 - reported below, in the caller's thread
                result.append(err)

        # The tracker answers a request only when a device is free: wait in a thread, for a bounded time.
        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        thread.join(self.wait_seconds)
        if not result:
            raise FarmError(f"no device of key {self.key!r} at tracker {self.tracker} became free within "
                            f"{self.wait_seconds:g} s")
        if isinstance(result[0], Exception):
            raise FarmError(f"{self.describe()}: could not open a session ({_last_line(result[0])})")
        return result[0]

    def fingerprint(self, session: rpc.RPCSession) -> dict[str, Any]:
        """What the device of `session` reports about itself: {"fingerprint": ..., "ember_version", "tvm_version"}."""
        try:
            function = session.get_function(FINGERPRINT_FUNCTION)
        except Exception:  # noqa: BLE001 - TVM raises several types for a missing remote function
            function = None
        if function is None:
            raise FarmError(f"{self.describe()} serves no ember functions: start it with `python -m "
                            f"ember.runtime.rpc_device --tracker {self.tracker} --key {self.key}` (ember's runtime "
                            "package on the device), not the bare `python -m tvm.exec.rpc_server`")
        return json.loads(function())

    def fingerprints(self, session_timeout: float = 120.0) -> list[dict[str, Any]]:
        """The fingerprint of every device of `key` registered now, each asked in a session of its own (all
        held at once, so the tracker hands out a different device each time)."""
        sessions = [self.session(session_timeout) for _ in range(self.wait_for_devices())]
        return [self.fingerprint(session)["fingerprint"] for session in sessions]


def runner_session(wait_seconds: float, config: Any) -> rpc.RPCSession:
    """meta_schedule `RPCRunner`'s `f_create_session`: its session, with a bounded wait for a free device (the
    runner's own waits without end when none is registered, hanging the tuning job)."""
    farm = Farm(config.tracker_host, config.tracker_port, config.tracker_key, wait_seconds)
    return farm.session(config.session_timeout_sec)


def runner_arguments(_session: rpc.RPCSession, device: Any, args_info: list, alloc_repeat: int) -> list[list[Any]]:
    """meta_schedule `RPCRunner`'s `f_alloc_argument`: random arguments made here and copied to the device
    (the runner's own fills them there with a function that TVM's runtime-only library lacks)."""
    rng = np.random.default_rng(0)

    def tensor(dtype: str, shape: list[int]) -> Any:
        kind = np.dtype(dtype)
        if kind.kind == "f":
            array = rng.uniform(-1, 1, shape).astype(kind)
        else:
            info = np.iinfo(kind)
            array = rng.integers(max(info.min, -128), min(info.max, 127), shape, dtype=kind, endpoint=True)
        return tvm.runtime.tensor(array, device)

    for info in args_info:
        if info[0] != "TENSOR":
            raise NotImplementedError(f"argument {info}: only tensors are measured")
    return [[tensor(dtype, shape) for _kind, dtype, shape in args_info] for _ in range(alloc_repeat)]


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
