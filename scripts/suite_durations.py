"""Write tests/suite_durations.json, the seconds each test file took, from a run's JUnit XML.

The test suite's conftest hands files to pytest-xdist's workers longest first by this table, so a run
ends on short files rather than on one worker finishing a long file alone. Record it from a cold run
(compiled test artifacts absent: their compiles are most of a file's time) on two workers, as .ci/run
runs the suite, and commit it when the files' times have moved:

    mv ~/.cache/ember/test-artifacts ~/.cache/ember/test-artifacts.old
    python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/suite.xml
    python scripts/suite_durations.py /tmp/suite.xml
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "suite_durations.json"


def file_seconds(junit_xml: Path) -> dict[str, int]:
    """{test file name: seconds its tests took, fixtures included}, longest first."""
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # "tests.test_gguf", or "tests.test_gguf.TestClass" for a test in a class
        module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), None)
        if module is not None:
            seconds[f"{module}.py"] += float(case.get("time", 0))
    return {name: round(total) for name, total in seconds.most_common()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path, help="pytest's --junitxml output of a whole-suite run")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args()
    try:
        seconds = file_seconds(args.junit_xml)
    except (OSError, ET.ParseError) as err:
        parser.error(f"{args.junit_xml}: not a readable JUnit XML file ({err})")
    if not seconds:
        parser.error(f"{args.junit_xml}: no test cases in it")
    args.output.write_text(json.dumps(seconds, indent=1) + "\n", encoding="utf-8")
    print(f"{args.output}: {len(seconds)} files, {sum(seconds.values())} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
