"""`ember bench`: time an artifact's prefill and decode, here or on a device of an RPC tracker."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.cli.options import add_farm_arguments, add_threads_argument, farm, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember bench` and its options."""
    parser = subparsers.add_parser(
        "bench", help="time an artifact's prefill and decode, here or on a device of an RPC tracker",
        description="Prefill a prompt and decode greedily a few times, on this machine or, with --rpc-tracker, on "
                    "a free device of --device-key (the artifact is uploaded there; the device runs `python -m "
                    "ember.runtime.rpc_device`). Reports tok/s, peak memory, the greedy tokens and decode's share "
                    "of the device's memory-bandwidth roofline.",
        epilog="example:\n  ember bench demo-cpu\n"
               "  python -m tvm.exec.rpc_tracker --host 127.0.0.1 --port 9190 &\n"
               "  python -m ember.runtime.rpc_device --tracker 127.0.0.1:9190 --key pi5 &   (on the device)\n"
               "  ember bench demo-pi5 --rpc-tracker 127.0.0.1:9190 --device-key pi5",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    add_farm_arguments(parser)
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, metavar="N",
                        help="prompt length (default %(default)s)")
    parser.add_argument("--new-tokens", type=positive_int, default=128, metavar="N",
                        help="decode steps after the prompt (default %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                        help="timed runs after a warm-up; the median is reported (default %(default)s)")
    parser.add_argument("--hardware", metavar="PRESET",
                        help="the device's hardware preset for the roofline (default: the artifact's board preset, "
                             "else this machine, measured, when the device has this machine's CPU)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_threads_argument(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Time the artifact and print the report."""
    from ember.driver.bench import bench, format_report
    from ember.runtime.bench import BenchOptions

    options = BenchOptions(args.prompt_tokens, args.new_tokens, args.repeats, args.threads)
    report = bench(args.artifact, options, farm(args), args.hardware)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0
