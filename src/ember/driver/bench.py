"""`ember bench ARTIFACT [--rpc-tracker HOST:PORT --device-key KEY]`: prefill and decode speed where the
artifact is deployed, and how close decode comes to the device's memory-bandwidth roofline.

Without a tracker the artifact runs in this process. With one, its files are uploaded to a free
device of the key (`ember.driver.farm`) and `ember.runtime.bench.run_benchmark` runs there, in the
device's RPC session (`ember.runtime.rpc_device`), so the times are the device's alone: no
network round trip is inside them. Both report the same greedy tokens for the same artifact.

Decode reads every weight once per token, plus the KV cache of the context so far, so its
bound is the device's memory bandwidth divided by those bytes (the token embedding table is
not read whole: one row per token, unless it is also the output projection). The bandwidth
comes from the device's hardware preset: `--hardware`, else the board preset the artifact was
compiled for (`--target raspberry-pi-5`), else, for this machine or a device with the same
CPU fingerprint, this machine as measured (`--hardware host`). Prefill is compute-bound and
gets no such share.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.core.errors import ArtifactError, EmberError, FarmError
from ember.core.machine import cpu_fingerprint
from ember.core.manifest import MANIFEST_NAME, PARAMS_DIR, WEIGHT_INDEX, Manifest, read_manifest
from ember.driver.farm import Farm
from ember.runtime.bench import BenchOptions, run_benchmark
from ember.runtime.rpc_device import BENCH_FUNCTION, WRITE_FUNCTION
from ember.targets.hardware import Hardware, load_hardware

UPLOAD_CHUNK = 16 * 2**20
REMOTE_DIR = "artifact"
SESSION_SECONDS = 1800.0  # the device ends a session that outlives this (a client that vanished)


@dataclass
class BenchReport:
    """What `ember bench` measured, where, and the roofline it is compared with."""

    artifact: Path
    where: str  # "this machine" or "device 'KEY' via tracker HOST:PORT"
    options: BenchOptions
    result: dict[str, Any]  # `run_benchmark`'s data
    decode_bytes_per_token: float
    hardware: Hardware | None = None  # the device's roofline
    hardware_note: str = ""  # where the roofline came from, or why there is none
    upload_seconds: float | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second, median of the runs."""
        return self.options.prompt_tokens / statistics.median(self.result["prefill_seconds"])

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps per second, median of the runs."""
        return self.options.new_tokens / statistics.median(self.result["decode_seconds"])

    @property
    def decode_roofline(self) -> float | None:
        """Decode tokens per second the device's memory bandwidth allows, if its bandwidth is known."""
        return self.hardware.memory_bandwidth / self.decode_bytes_per_token if self.hardware else None

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--json`."""
        roofline = self.decode_roofline
        return {
            "artifact": str(self.artifact), "where": self.where, **self.options.to_json(), **self.result,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode_bytes_per_token": self.decode_bytes_per_token, "upload_seconds": self.upload_seconds,
            "hardware": self.hardware.name if self.hardware else None, "hardware_note": self.hardware_note,
            "memory_bandwidth": self.hardware.memory_bandwidth if self.hardware else None,
            "decode_roofline_tokens_per_s": roofline,
            "decode_roofline_share": self.decode_tokens_per_s / roofline if roofline else None,
        }


def bench(artifact: Path, options: BenchOptions, farm: Farm | None = None, hardware: str | None = None) -> BenchReport:
    """Benchmark `artifact` in this process, or on a device of `farm`."""
    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    _check_options(artifact, manifest, options)
    if farm is None:
        result, where, upload_seconds = run_benchmark(artifact, options), "this machine", None
    else:
        result, upload_seconds = _bench_remote(artifact, manifest, options, farm)
        where = farm.describe()
    device, note = _roofline_hardware(manifest, result["fingerprint"], hardware, local=farm is None)
    return BenchReport(artifact, where, options, result, _decode_bytes(artifact, manifest, options), device, note,
                       upload_seconds)


def format_report(report: BenchReport) -> str:
    """The report for people: one line per phase, then memory, roofline and tokens."""
    result, options = report.result, report.options
    fingerprint = result["fingerprint"]
    isa = "/".join(fingerprint.get("isa", [])) or "no listed ISA extensions"
    threads = f"; {result['threads']} threads" if result.get("threads") else ""
    runs = len(result["prefill_seconds"])
    lines = [f"{report.artifact} on {report.where}: {fingerprint.get('cpu')} ({fingerprint.get('machine')}, {isa}, "
             f"{fingerprint.get('cores')} cores{threads})"]
    if report.upload_seconds is not None:
        size = sum(entry["size"] for entry in read_manifest(report.artifact).files.values())
        lines.append(f"  uploaded {size / 2**20:.1f} MiB in {report.upload_seconds:.1f} s")
    lines.append(f"  prefill {options.prompt_tokens:>5} tokens {report.prefill_tokens_per_s:>10.1f} tok/s  "
                 f"(median of {runs}: {statistics.median(result['prefill_seconds']):.4f} s)")
    lines.append(f"  decode  {options.new_tokens:>5} tokens {report.decode_tokens_per_s:>10.1f} tok/s  "
                 f"(median of {runs}: {statistics.median(result['decode_seconds']):.4f} s)")
    roofline = report.decode_roofline
    per_token = f"{report.decode_bytes_per_token / 2**20:.1f} MiB read per token"
    if roofline:
        lines.append(f"  decode at {report.decode_tokens_per_s / roofline:.0%} of the bandwidth roofline: "
                     f"{roofline:.1f} tok/s = {report.hardware.memory_bandwidth / 1e9:.1f} GB/s "
                     f"({report.hardware_note}) "
                     f"/ {per_token}")
    else:
        lines.append(f"  no bandwidth roofline: {report.hardware_note} ({per_token})")
    peak = result.get("peak_memory_bytes")
    lines.append(f"  peak memory {peak / 2**20:.0f} MiB (the benchmarking process: weights, KV cache, TVM, Python)"
                 if peak else "  peak memory: not reported by the device")
    shown = " ".join(map(str, result["tokens"][:16])) + (" ..." if len(result["tokens"]) > 16 else "")
    lines.append(f"  greedy tokens: {shown}" + ("" if result.get("tokens_repeat", True) else
                                                  "  (runs disagreed: the artifact is not deterministic here)"))
    return "\n".join(lines)


def _check_options(artifact: Path, manifest: Manifest, options: BenchOptions) -> None:
    """Refuse what the device would refuse, before any upload."""
    if options.prompt_tokens < 1 or options.new_tokens < 1 or options.repeats < 1:
        raise EmberError("--prompt-tokens, --new-tokens and --repeats must each be at least 1")
    context = manifest.kv_cache["max_context"]
    if options.prompt_tokens + options.new_tokens > context:
        raise EmberError(f"--prompt-tokens {options.prompt_tokens} + --new-tokens {options.new_tokens} exceed the "
                         f"{context} tokens of context {artifact} holds")


def _bench_remote(artifact: Path, manifest: Manifest, options: BenchOptions,
                  farm: Farm) -> tuple[dict[str, Any], float]:
    """Upload the artifact to a free device of `farm` and benchmark it there; its result and the upload seconds."""
    session = farm.session(SESSION_SECONDS)
    device = farm.fingerprint(session)
    machine = device["fingerprint"].get("machine")
    compiled_for = manifest.target.get("arch") if manifest.target["name"] == "cpu" else manifest.target["name"]
    if compiled_for and machine and compiled_for != machine:
        raise ArtifactError(f"{artifact} was compiled for {compiled_for}; {farm.describe()} is {machine}: compile "
                            f"for its --target and bench that")
    files = [MANIFEST_NAME, *manifest.files]
    size = sum((artifact / name).stat().st_size for name in files)
    _progress(f"uploading {artifact} ({size / 2**20:.1f} MiB) to {farm.describe()}")
    start = time.perf_counter()
    write = session.get_function(WRITE_FUNCTION)
    for name in files:
        with open(artifact / name, "rb") as f:
            offset = 0
            while chunk := f.read(UPLOAD_CHUNK):
                write(f"{REMOTE_DIR}/{name}", offset, bytearray(chunk))
                offset += len(chunk)
            if offset == 0:
                write(f"{REMOTE_DIR}/{name}", 0, bytearray())
    upload_seconds = time.perf_counter() - start
    _progress(f"running prefill and decode on {farm.describe()}")
    try:
        result = json.loads(session.get_function(BENCH_FUNCTION)(REMOTE_DIR, json.dumps(options.to_json())))
    except Exception as err:  # noqa: BLE001 - an RPC error (the device died, a bug on it) arrives as TVM's error
        if isinstance(err, EmberError):
            raise
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        raise FarmError(f"{farm.describe()}: the benchmark failed there: {lines[-1] if lines else err}") from None
    if "error" in result:
        raise EmberError(f"{farm.describe()}: {result['error']}")
    return result, upload_seconds


def _roofline_hardware(manifest: Manifest, fingerprint: dict[str, Any], hardware: str | None,
                       local: bool) -> tuple[Hardware | None, str]:
    """The device's hardware description for the roofline, and where it came from (or why there is none)."""
    if hardware:
        device = load_hardware(hardware)
        return device, f"--hardware {hardware}"
    preset = manifest.target.get("hardware") if manifest.target["name"] == "cpu" else ""
    if preset:
        return load_hardware(preset), f"preset {preset}, the artifact's --target"
    if local or fingerprint == cpu_fingerprint():
        return load_hardware("host"), "this machine, measured" + ("" if local else "; the device has its CPU")
    return None, "name the device's hardware preset with --hardware"


def _decode_bytes(artifact: Path, manifest: Manifest, options: BenchOptions) -> float:
    """Bytes a decode step reads at the runs' mean context: the weights (the embedding table one row, unless it is
    also the output projection) and the KV cache."""
    weights = float(manifest.memory["weight_bytes"])
    if not manifest.model.get("tie_word_embeddings", False):
        embedding = [record for record in _weight_records(artifact) if "embed_tokens" in record["name"]]
        rows = int(manifest.model["vocab_size"])
        weights -= sum(record["nbytes"] * (1 - 1 / rows) for record in embedding)
    context = options.prompt_tokens + options.new_tokens / 2
    return weights + context * float(manifest.memory["kv_bytes_per_token"])


def _weight_records(artifact: Path) -> list[dict[str, Any]]:
    try:
        index = json.loads((artifact / PARAMS_DIR / WEIGHT_INDEX).read_text(encoding="utf-8"))
        return [record for shard in index["records"] for record in shard["records"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ArtifactError(f"{artifact / PARAMS_DIR / WEIGHT_INDEX}: unreadable weight index ({err})") from None


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
