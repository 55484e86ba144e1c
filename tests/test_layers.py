"""The layers drawn in ember/__init__.py hold: import-linter's contracts (pyproject.toml) pass on the
tree, and fail when a lower layer imports a higher one."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
lint_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint_imports)


def test_the_tree_keeps_every_contract(tmp_path):
    result = lint_imports.run_lint_imports(lint_imports.lay_out_package(ROOT, tmp_path))
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
    tree = lint_imports.lay_out_package(ROOT, tmp_path)
    path = tree / "ember" / module
    path.write_text(path.read_text() + f"\n{upward_import}\n")
    result = lint_imports.run_lint_imports(tree)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
