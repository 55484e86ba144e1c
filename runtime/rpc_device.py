"""A device of the farm: TVM's RPC server with ember's device functions, registered with a tracker.

    python -m ember.runtime.rpc_device --tracker HOST:PORT --key KIND [--host ADDR] [--port P]

runs TVM's RPC server (what `python -m tvm.exec.rpc_server` runs), with three more global
functions in its sessions. TVM's RPC calls only functions registered in the server process,
and the stock server registers none of ember's, so a device needs ember's runtime package
(`ember package` writes it; the compiler is not needed) and this launcher, which registers
them before the server starts (sessions are forked from this process):

    ember.device.fingerprint()                the device's CPU fingerprint (`ember.core.machine`) and
                                              versions, as JSON: what tuning records are keyed by
    ember.device.write(path, offset, bytes)   write a chunk of a file under the session's work
                                              directory (TVM's own upload writes flat files only)
    ember.device.bench(path, options)         `ember.runtime.bench.run_benchmark` of the artifact
                                              uploaded to `path`, as JSON ({"error": ...} for a
                                              user error such as a context too short)

Kernel measurements for `ember tune` use TVM's own session functions (upload, load_module,
time_evaluator), which this server serves as the stock one does. Each session runs in a
process of its own in a fresh work directory, removed when the session ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path, PurePosixPath

import tvm
import tvm_ffi
from tvm.rpc import server as rpc_server

import ember
from ember.core.errors import EmberError
from ember.core.machine import cpu_fingerprint
from ember.runtime.bench import BenchOptions, run_benchmark
from ember.runtime.device import use_cpu_threads

FINGERPRINT_FUNCTION = "ember.device.fingerprint"
WRITE_FUNCTION = "ember.device.write"
BENCH_FUNCTION = "ember.device.bench"


def register_functions() -> None:
    """Register ember's device functions in this process, before the server forks its sessions."""
    tvm_ffi.register_global_func(FINGERPRINT_FUNCTION, _fingerprint, override=True)
    tvm_ffi.register_global_func(WRITE_FUNCTION, _write, override=True)
    tvm_ffi.register_global_func(BENCH_FUNCTION, _bench, override=True)


def _fingerprint() -> str:
    return json.dumps({"fingerprint": cpu_fingerprint(), "ember_version": ember.__version__,
                       "tvm_version": tvm.__version__})


def _write(path: str, offset: int, data: bytearray) -> None:
    target = _session_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)


def _bench(path: str, options: str) -> str:
    try:
        return json.dumps(run_benchmark(_session_path(path), BenchOptions(**json.loads(options))))
    except EmberError as err:
        return json.dumps({"error": str(err)})


def _session_path(path: str) -> Path:
    """`path` under the session's work directory, refusing one that would leave it."""
    relative = PurePosixPath(path)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ValueError(f"{path!r}: not a relative path inside the session's work directory")
    return Path(tvm.get_global_func("tvm.rpc.server.workpath")(str(relative)))


def serve(tracker: tuple[str, int], key: str, host: str = "127.0.0.1", port: int = 9090,
          port_end: int = 9199) -> None:
    """Serve RPC sessions on `host` (the first free port in [port, port_end)), registered with `tracker` as
    a device of kind `key`, until killed."""
    register_functions()
    use_cpu_threads()  # sessions (forked from here) run kernels on one thread per physical core, as artifacts do
    # What `rpc.Server` runs in a worker process of its own, run in this one: the device is one process
    # to start and to stop, and needs no cloudpickle. Sessions are forked from it, functions included.
    state = rpc_server.PopenRPCServerState(host, port, port_end, tracker_addr=tracker, key=key)
    print(f"ember: device {key!r} serving at {host}:{state.port}, registered with tracker "
          f"{tracker[0]}:{tracker[1]}", file=sys.stderr, flush=True)
    state.thread.join()


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.runtime.rpc_device`."""
    parser = argparse.ArgumentParser(prog="python -m ember.runtime.rpc_device", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the RPC tracker to register with")
    parser.add_argument("--key", required=True, help="the device kind, e.g. raspberry-pi-5 (what clients request)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s; the tracker's clients must reach it)")
    parser.add_argument("--port", type=int, default=9090, help="first port to try (default %(default)s)")
    parser.add_argument("--port-end", type=int, default=9199, help="end of the port range (default %(default)s)")
    args = parser.parse_args(argv)
    tracker_host, _, tracker_port = args.tracker.rpartition(":")
    if not tracker_host or not tracker_port.isdigit():
        parser.error(f"--tracker {args.tracker}: expected HOST:PORT")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    serve((tracker_host, int(tracker_port)), args.key, args.host, args.port, args.port_end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
