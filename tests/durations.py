"""Seconds each unit of work of ``pytest -n 2`` took (tests/conftest.py sends each module whole to one
process, and the tests that shut the session's Ray down as one unit, ``own-ray``), so conftest can start the
longest units first: with the units in their file order, a 100 s module that came last ran alone while the
other process sat idle for half a minute.

Refresh after a suite run that wrote a JUnit file (the figures only order the work; a stale or missing
one orders worse, never wrongly):

    python -m pytest -q -n 2 --junitxml=/tmp/junit.xml && python tests/durations.py /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")


def load() -> dict[str, float]:
    """The recorded seconds per unit (a module's path, e.g. ``tests/test_recovery.py``, or ``own-ray``)."""
    try:
        return {str(k): float(v) for k, v in json.loads(FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def from_junit(path: str) -> dict[str, float]:
    """Seconds per unit from a JUnit file of ``pytest -n 2``: under xdist each test's name ends in
    ``@<its group>`` (conftest's groups are the units)."""
    seconds: Counter = Counter()
    for case in ET.parse(path).iter("testcase"):
        name = case.get("name", "")
        if "@" in name:
            seconds[name.rsplit("@", 1)[1]] += float(case.get("time") or 0)
    return {unit: round(s, 1) for unit, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/durations.py JUNIT.xml")
    units = from_junit(sys.argv[1])
    if not units:
        sys.exit(f"no test of {sys.argv[1]} names its xdist group: was it written by `pytest -n 2`?")
    FILE.write_text(json.dumps(units, indent=1) + "\n")
    print(f"{len(units)} units, {sum(units.values()):.0f} s in all, written to {FILE}")
