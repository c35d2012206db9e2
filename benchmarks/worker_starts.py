"""Worker processes started fresh and taken warm, per test directory, under a pytest ``--basetemp``.

Run: ``python benchmarks/worker_starts.py BASETEMP``

Reads every ``events.jsonl`` below BASETEMP and counts the ``worker_started`` events that name a pid, split
by their ``reused`` field (a warm pooled process: controller/warm_pool.py). The suite's time is CPU-bound
and a fresh worker process costs seconds of CPU (Ray's boot, torch), so this count is one of the suite's
cost figures (docs/perf/2026-11-28-suite-fresh.md, 2026-11-28-suite-cpu.md). A directory is the first path
component below each xdist worker's folder: the test's ``tmp_path`` name.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def count(root: Path) -> tuple[collections.Counter, collections.Counter]:
    """(fresh, reused) starts per test directory."""
    fresh: collections.Counter = collections.Counter()
    reused: collections.Counter = collections.Counter()
    for path in root.rglob("events.jsonl"):
        parts = path.relative_to(root).parts
        where = parts[1] if len(parts) > 2 else parts[0]
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed writer
            if event.get("event") == "worker_started" and event.get("pid"):
                (reused if event.get("reused") else fresh)[where] += 1
    return fresh, reused


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/worker_starts.py BASETEMP (a pytest --basetemp directory)")
    fresh, reused = count(Path(sys.argv[1]))
    print(f"fresh {sum(fresh.values())} reused {sum(reused.values())}")
    for where, n in fresh.most_common(40):
        print(f"{n:4d} {reused[where]:4d} {where}")
