"""CPU seconds of processes and threads read from ``/proc`` (Linux), for the benchmarks that account for
CPU beside the step: step_cpu.py, drill_cost.py, idle_ray.py."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
SCHED_IDLE = 5


def _fields(raw: str) -> list[str]:
    """The fields of a ``stat`` line after the command name (which may hold spaces and parentheses)."""
    return raw[raw.rindex(")") + 2:].split()


def thread_stats(pid: int) -> dict[int, tuple[str, float, bool]]:
    """{thread id: (its name now, CPU seconds (utime + stime), in SCHED_IDLE)} of a live process; {} once it
    is gone. Keyed by id: Ray renames an actor's threads after the task they run."""
    out: dict[int, tuple[str, float, bool]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        f = _fields(raw)
        out[int(tid)] = (raw[raw.index("(") + 1:raw.rindex(")")], (int(f[11]) + int(f[12])) / TICK,
                         int(f[38]) == SCHED_IDLE)
    return out


def parents() -> dict[int, int]:
    """{pid: parent pid} of every process (one scan of /proc)."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = int(_fields(Path(f"/proc/{entry}/stat").read_text())[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def process_cpu(pid: int) -> float | None:
    """CPU seconds (utime + stime) of a live process, all its threads; None once it is gone."""
    try:
        f = _fields(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / TICK
