"""`ember analyze`: the roofline of a model on a hardware preset (options and work in ember.driver.analyze.cli)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember analyze` and its options."""
    from ember.driver.analyze import cli as analyze_cli  # numpy and the model presets: once main has started

    parser = subparsers.add_parser("analyze", help="roofline analysis of a model on a hardware preset")
    analyze_cli.add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Analyze (or measure) and print the report."""
    from ember.driver.analyze import cli as analyze_cli

    return analyze_cli.run(args)
