"""The layers drawn in src/ember/__init__.py hold: import-linter's contracts (pyproject.toml) pass on the tree as it
is (`lint-imports`, as .ci/run runs it), and fail when a lower layer imports a higher one."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports` with pyproject.toml's contracts, on the `ember` package found in `src`."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
               str(ROOT / "pyproject.toml"), "--no-cache"]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True,
                          text=True)


def test_the_tree_keeps_every_contract():
    result = lint_imports(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "upward_import", "contract"), [
    ("runtime/engine.py", "import ember.driver.compiler", "Light runtime"),
    ("runtime/engine.py", "import ember.ir.kv_cache", "Light runtime"),
    ("runtime/sampling.py", "import torch", "Light runtime"),
    ("frontend/hf.py", "import ember.runtime.tokenizer", "Layers"),
    ("schedules/matmul.py", "import ember.ir_passes.pipeline", "Layers"),
    ("core/errors.py", "import ember.targets.registry", "Layers"),
])
def test_an_upward_import_breaks_a_contract(tmp_path, module, upward_import, contract):
    """A copy of the package (links to the stages' folders resolved) with one upward import added."""
    shutil.copytree(ROOT / "src" / "ember", tmp_path / "ember", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "ember" / module
    path.write_text(path.read_text() + f"\n{upward_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
