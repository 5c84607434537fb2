"""How long each test file took in a full run, for the order `make test` hands files to its workers.

`make test` runs three workers that each take a whole file at a time (`--dist loadfile`), in the order of
the collection: a long file handed out last keeps one worker busy after the others have finished, so
tests/conftest.py puts the files in the order of their recorded seconds, longest first (a file missing from
the record goes where the median would). The record is tests/file_durations.json, written from a run's
JUnit report:

    PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml make test
    .venv/bin/python -m tests.file_durations /tmp/junit.xml
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("file_durations.json")


def file_of(classname: str) -> str | None:
    """tests.runtime.test_x (or tests.runtime.test_x.TestClass) -> tests/runtime/test_x.py, if it exists."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def from_junit(report: Path) -> dict[str, float]:
    """{test file: seconds of its tests (setup, call and teardown)} from a JUnit XML report."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0))
    return {path: round(s, 1) for path, s in sorted(seconds.items())}


def ordered(files: list[str]) -> list[str]:
    """files (in collection order), the longest recorded first; ties and unrecorded ones keep their order."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    default = statistics.median(record.values()) if record else 0.0
    return sorted(files, key=lambda path: -record.get(path, default))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.file_durations JUNIT_XML")
    durations = from_junit(Path(sys.argv[1]))
    RECORD.write_text(json.dumps(durations, indent=0) + "\n")
    print(f"{len(durations)} files, {sum(durations.values()):.0f} s, written to {RECORD}")
