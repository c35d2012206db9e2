"""What the machine did around a measured window (the fault -> decision of a scenario): to tell a slow
run's cause apart from the controller's work when the figures come from a shared machine.

:func:`snapshot` is taken at both ends of the window; :func:`window` is their difference: the driver
thread's CPU, its minor page faults (memory taken from the OS for the first time: a first recovery in a
process builds its 10,000-element structures in fresh pages), its involuntary context switches (the OS
gave its core to something else), the CPU time the whole machine spent busy and the part of it this
process spent, the time the hypervisor ran something else on this VM's cores (steal), and the garbage
collections by generation. Linux only (``/proc``); elsewhere the machine's figures are None.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _proc_stat() -> tuple[int, int] | None:
    """(busy, steal) jiffies of the whole machine since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _own_jiffies() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> dict[str, Any]:
    """The counters :func:`window` subtracts (cheap: two small /proc reads and a getrusage)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": time.thread_time(), "wall": time.perf_counter(), "minflt": ru.ru_minflt,
            "ivcsw": ru.ru_nivcsw, "stat": _proc_stat(), "own": _own_jiffies(),
            "gc": [g["collections"] for g in gc.get_stats()]}


def window(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """From snapshot ``a`` to snapshot ``b``: seconds for the CPU and wall times (the machine's from its
    jiffies, so to ~10 ms), counts for the rest."""
    out: dict[str, Any] = {"cpu_s": round(b["cpu"] - a["cpu"], 4), "wall_s": round(b["wall"] - a["wall"], 4),
                           "minor_faults": b["minflt"] - a["minflt"], "involuntary_switches": b["ivcsw"] - a["ivcsw"],
                           "gc_collections": [y - x for x, y in zip(a["gc"], b["gc"])]}
    stat = (a["stat"], b["stat"])
    own = (a["own"], b["own"])
    out["machine_busy_s"] = None if None in stat else round((stat[1][0] - stat[0][0]) * _TICK_S, 2)
    out["steal_s"] = None if None in stat else round((stat[1][1] - stat[0][1]) * _TICK_S, 2)
    out["process_busy_s"] = None if None in own else round((own[1] - own[0]) * _TICK_S, 2)
    return out
