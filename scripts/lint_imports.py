"""Run import-linter's `lint-imports` on ember's layers (the contracts in pyproject.toml).

The stages live in top-level folders that setuptools maps onto `ember.*` (`frontend/` is
`ember.frontend`), which import-linter cannot follow: it walks the `ember/` folder alone. So this
lays the package out as installed, in a temporary directory, and runs `lint-imports` on that copy.
Extra arguments go to `lint-imports`. Exit status: lint-imports' own.

    python scripts/lint_imports.py            # what .ci/run does
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lay_out_package(root: Path, destination: Path) -> Path:
    """Copy the Python files of every package in pyproject.toml's package-dir to where they install."""
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in sorted(settings["package-dir"].items()):
        shutil.copytree(root / folder, destination.joinpath(*package.split(".")), dirs_exist_ok=True,
                        ignore=lambda _, names: [n for n in names if n == "__pycache__"
                                                 or (not n.endswith(".py") and "." in n)])
    return destination


def run_lint_imports(tree: Path, args: list[str] = ()) -> subprocess.CompletedProcess:
    """`lint-imports` with pyproject.toml's contracts on the package laid out in `tree`."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
               str(ROOT / "pyproject.toml"), *args]
    return subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ember-layers-") as tmp:
        result = run_lint_imports(lay_out_package(ROOT, Path(tmp)), argv)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
