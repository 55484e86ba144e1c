"""`ember package`: an artifact and the runtime, gathered to copy to a device."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember package` and its options."""
    parser = subparsers.add_parser(
        "package", help="gather an artifact and the runtime to copy to a device",
        description="Write DIR with the artifact (DIR/artifact), ember's runtime package (DIR/ember) and "
                    "requirements-runtime.txt: on the device, pip install -r DIR/requirements-runtime.txt and run "
                    "with PYTHONPATH=DIR TVM_USE_RUNTIME_LIB=1 (no compiler, torch or transformers needed).")
    parser.add_argument("artifact", type=Path)
    parser.add_argument("-o", "--output", required=True, type=Path, help="new directory to write")
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the package directory."""
    from ember.driver.package import package_artifact

    print(f"packaged {args.artifact} -> {package_artifact(args.artifact, args.output)}")
    return 0
