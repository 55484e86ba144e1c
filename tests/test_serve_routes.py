"""docs/serving.md's table of endpoints is the server's route table (`serving/routes.py`) written out: a golden file
that `python -m ember.serving.routes` rewrites and this test compares (no server needed; tests/test_serve_utilities.py
checks that the server answers every route of the table)."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO_ROOT

from ember.serving import routes


def test_docs_serving_md_holds_the_table_of_the_routes_the_server_registers():
    docs = REPO_ROOT / routes.DOCS
    text = docs.read_text(encoding="utf-8")
    assert routes.with_table(text) == text, f"{docs}'s endpoints table is stale: run python -m ember.serving.routes"
    for route in routes.ROUTES:
        assert f"| {route.method} | `{route.shown_path}` |" in text


def test_the_module_rewrites_a_stale_table_and_leaves_the_rest(tmp_path, capsys):
    stale = tmp_path / "serving.md"
    stale.write_text(f"# Serving\n\n{routes.TABLE_BEGIN}\n| GET | `/gone` |\n{routes.TABLE_END}\n\nThe rest.\n")
    rewrite = [sys.executable, "-m", "ember.serving.routes", str(stale)]
    first = subprocess.run(rewrite, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and "rewritten" in first.stdout, first.stderr
    assert stale.read_text() == (f"# Serving\n\n{routes.TABLE_BEGIN}\n{routes.endpoint_table()}\n{routes.TABLE_END}"
                                 "\n\nThe rest.\n")
    assert routes.main([str(stale)]) == 0 and "up to date" in capsys.readouterr().out


def test_a_file_without_the_markers_is_refused_in_one_line(tmp_path, capsys):
    plain = tmp_path / "plain.md"
    plain.write_text("no table here\n")
    assert routes.main([str(plain)]) == 1 and plain.read_text() == "no table here\n"
    assert len(capsys.readouterr().err.splitlines()) == 1
