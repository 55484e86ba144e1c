"""`ember tune`: autotune a model's hottest kernels into a tuning database."""

from __future__ import annotations

import argparse
from pathlib import Path

from ember.cli.options import add_farm_arguments, add_graph_arguments, checkpoint_dir, farm


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember tune` and its options."""
    parser = subparsers.add_parser(
        "tune", help="autotune a model's hottest kernels into a tuning database",
        description="Extract a model's kernels, weight them by how often prefill and decode call them, and "
                    "search the schedules of the hottest with meta_schedule on this machine, or with "
                    "--rpc-tracker on the devices of a key (built here, timed there; the database is keyed by "
                    "the devices' own fingerprint). Rerunning with the same --db continues where a job stopped.",
        epilog="example:\n  ember tune demo --db tuning --trials 64 --budget 5\n"
               "  ember compile demo -o demo-tuned --tuning-db tuning\n"
               "  ember tune demo --target raspberry-pi-5 --rpc-tracker 127.0.0.1:9190 --device-key pi5 --db pi5-db",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint directory, an artifact (tuned as it was compiled), or `demo`")
    parser.add_argument("--db", required=True, type=Path, metavar="DIR", help="tuning database directory")
    parser.add_argument("--target", default="cpu",
                        help="`cpu` (this machine; tuning measures here), or with --rpc-tracker the devices' CPU: a "
                             "board preset (raspberry-pi-5, ...) or a TVM target JSON, as for compile")
    parser.add_argument("--quant", default=None, metavar="FORMAT", help="weight format, as for compile")
    parser.add_argument("--trials", type=int, default=64,
                        help="measured trials in all, shared by the kernels (default 64)")
    parser.add_argument("--budget", type=float, default=10.0, metavar="MINUTES",
                        help="stop starting trials after this many minutes (default 10)")
    parser.add_argument("--kernels", type=int, default=8,
                        help="tune at most this many of the hottest kernels (default 8)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="as for compile (default 256)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="as for compile (default 8): int8 decode kernels (q8f32/q4f32) are timed at one "
                             "sequence and at this many, and their records apply to compiles with the same "
                             "--max-batch")
    parser.add_argument("--float-activations", action="store_true",
                        help="as for compile: q8f32/q4f32 projections stay float kernels, which tuning can search")
    add_graph_arguments(parser)
    add_farm_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Tune MODEL's hottest kernels into --db."""
    model = checkpoint_dir(args.model)
    from ember.driver.tune import TuneOptions, tune_model

    options = TuneOptions(db=args.db, target=args.target, quantization=args.quant, trials=args.trials,
                          budget_minutes=args.budget, kernels=args.kernels, prefill_chunk=args.prefill_chunk,
                          max_batch=args.max_batch, float_activations=args.float_activations, farm=farm(args),
                          frontend=args.frontend, tokenizer_dir=args.tokenizer)
    report = tune_model(model, options)
    print(f"tuned {len(report)} kernels into {args.db}")
    return 0
