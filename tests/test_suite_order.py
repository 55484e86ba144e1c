"""The suite's own scheduling: files go to pytest-xdist's workers longest first, by the seconds
`scripts/suite_durations.py` records from a run's JUnit XML."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import SUITE_DURATIONS, longest_files_first

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "suite_durations.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
 <testcase classname="tests.test_small" name="test_a" time="0.4"/>
 <testcase classname="tests.test_big" name="test_compile" time="30.2"/>
 <testcase classname="tests.test_big.TestServer" name="test_b" time="10.1"/>
 <testcase classname="tests.test_small" name="test_c" time="1.3"/>
 <testcase classname="tests.test_middle" name="test_d" time="7.0"/>
</testsuite></testsuites>
"""


def test_the_script_sums_each_files_tests_longest_first(tmp_path):
    (tmp_path / "run.xml").write_text(JUNIT, encoding="utf-8")
    out = tmp_path / "durations.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run.xml"), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert list(json.loads(out.read_text()).items()) == [("test_big.py", 40), ("test_middle.py", 7),
                                                         ("test_small.py", 2)]
    assert "3 files, 49 s in all" in done.stdout


def test_the_script_refuses_a_file_that_is_not_junit_xml(tmp_path):
    (tmp_path / "run.xml").write_text("PASSED 12 tests\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run.xml"), "-o", str(tmp_path / "d.json")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "run.xml: not a readable JUnit XML file" in done.stderr
    assert not (tmp_path / "d.json").exists()


def test_files_go_longest_first_unknown_ones_before_all_tests_in_their_order():
    seconds = json.loads(SUITE_DURATIONS.read_text(encoding="utf-8"))
    long, short = max(seconds, key=seconds.get), min(seconds, key=seconds.get)
    items = [SimpleNamespace(path=Path("tests") / name, name=f"{name}::{n}")
             for name, n in [(short, 1), (long, 1), ("test_not_yet_timed.py", 1), (short, 2), (long, 2)]]
    longest_files_first(items)
    assert [item.name for item in items] == ["test_not_yet_timed.py::1", f"{long}::1", f"{long}::2",
                                             f"{short}::1", f"{short}::2"]


def test_every_recorded_file_exists():
    """A renamed or deleted test file leaves the table, so the order it gives is the suite's."""
    missing = [name for name in json.loads(SUITE_DURATIONS.read_text(encoding="utf-8"))
               if not (REPO / "tests" / name).is_file()]
    assert not missing, f"{SUITE_DURATIONS.name} lists files that are gone: {missing}; rerun scripts/suite_durations.py"
