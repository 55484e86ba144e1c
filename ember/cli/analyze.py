"""`ember analyze`: the roofline of a model on a hardware preset (options and work in ember.driver.analyze.cli)."""

from __future__ import annotations

import argparse

from ember.driver.analyze import cli as analyze_cli


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember analyze` and its options."""
    parser = subparsers.add_parser("analyze", help="roofline analysis of a model on a hardware preset")
    analyze_cli.add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Analyze (or measure) and print the report."""
    return analyze_cli.run(args)
