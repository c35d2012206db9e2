"""A standby process imports at the lowest CPU priority, and trains at the priority it started with.

A standby worker process (``workers.standby``, :mod:`elastictrain.controller.group`) is started while the run
trains, often right after a replacement joined; its imports (torch, DTensor, DCP: seconds of CPU) would take
a core from the training processes beside it, on every node, after every failure. The group starts it with
:data:`STANDBY_ENV` in its environment (the actor's runtime env), and ``elastictrain/worker/__init__.py``
calls :func:`lower_if_standby` before Ray's preload imports the worker actor's module: the importing thread
goes to nice 19, so while the cores are busy it gets a small share of one (about 0.3 of the core it shares
with a training process at Ray's nice 15, against 0.7 for that process) instead of an equal one. :func:`restore` (the worker actor's
``__init__``, right after the imports) puts every thread of the process back at the nice value it had; a
timer does it after :data:`BOUND_S` seconds if the imports have not finished by then.

Why nice 19 and not ``SCHED_IDLE``: an idle-class thread gets no CPU at all while the cores are busy, and
it holds Python's GIL through the import, so no other thread of the process (the timer included) could run
either: under load a replacement that took such a standby joined far later than with a normal-priority
import (docs/perf/2026-11-23-code-figures.md). A thread at nice 19 still runs, only less.

Going back is a privilege: Linux lets a thread lower its nice value only with ``CAP_SYS_NICE`` or a
``RLIMIT_NICE`` that allows the value (20 - nice: 5 for the nice 15 Ray starts workers at). Without either,
:func:`lower_if_standby` leaves the priority alone (imports at normal priority, as before): a worker left at
nice 19 would lose its core to anything else on its node. Linux only; elsewhere nothing changes. Standard
library only: it runs before the imports it is about.
"""

from __future__ import annotations

import os
import threading

STANDBY_ENV = "ELASTICTRAIN_STANDBY_PROCESS"
"""Set to "1" in a standby process's environment by the group; nobody else sets it."""
BOUND_S = 15.0
"""At most this long at nice 19: a standby's imports take ~4 s of CPU, ~10 s at nice 19 beside two busy
training processes on two cores."""
LOW_NICE = 19
_CAP_SYS_NICE = 23  # linux/capability.h

_lock = threading.Lock()
_lowered_from: int | None = None  # the nice value the process had, while lowered
_record: dict[str, object] = {"lowered": False, "restored_by": None}


def can_go_back(status: str, rlimit_nice: int, nice: int) -> bool:
    """PURE: may a thread with this ``/proc/self/status`` text and ``RLIMIT_NICE`` soft limit lower its nice
    value back to ``nice``? (``CAP_SYS_NICE``, or ``RLIMIT_NICE`` >= 20 - nice: setpriority(2).)"""
    if rlimit_nice < 0 or rlimit_nice >= 20 - nice:  # RLIM_INFINITY is -1
        return True
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
            except (IndexError, ValueError):
                return False
    return False


def _supported() -> bool:
    return hasattr(os, "setpriority") and hasattr(threading, "get_native_id") and os.path.isdir("/proc/self/task")


def _may_go_back(nice: int) -> bool:
    import resource

    try:
        with open("/proc/self/status") as f:
            status = f.read()
        return can_go_back(status, resource.getrlimit(resource.RLIMIT_NICE)[0], nice)
    except (OSError, AttributeError, ValueError):
        return False


def lower_if_standby() -> bool:
    """In a standby process (and where it can be undone), put the calling thread at nice :data:`LOW_NICE`
    and arm the :data:`BOUND_S` timer; True when it did. Never raises."""
    global _lowered_from
    if os.environ.get(STANDBY_ENV) != "1" or not _supported():
        return False
    with _lock:
        if _lowered_from is not None:
            return False
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if nice >= LOW_NICE or not _may_go_back(nice):
            return False
        # started first: a new thread takes the nice value of the thread that starts it
        timer = threading.Timer(BOUND_S, restore, kwargs={"by": "timer"})
        timer.daemon = True
        timer.start()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_NICE)  # this thread only (Linux)
        except OSError:
            timer.cancel()
            return False
        _lowered_from = nice
        _record["lowered"] = True
    return True


def restore(by: str = "init") -> None:
    """Every thread of this process above the nice value it started with goes back to it (idempotent; never
    raises). ``by`` says who did, in :func:`report`."""
    global _lowered_from
    with _lock:
        if _lowered_from is None:
            return
        nice, _lowered_from = _lowered_from, None
        _record["restored_by"] = by
        os.environ.pop(STANDBY_ENV, None)  # processes it starts from now on are not standbys
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # the thread ended meanwhile
            pass


def report() -> dict[str, object]:
    """What happened in this process: ``lowered`` (its imports ran at nice 19), ``restored_by`` ("init",
    "timer" or None), ``low_threads`` (threads above the process's nice value now) and its ``nice`` value."""
    nice = os.getpriority(os.PRIO_PROCESS, os.getpid())
    low = 0
    if _supported():
        for tid in os.listdir("/proc/self/task"):
            try:
                low += os.getpriority(os.PRIO_PROCESS, int(tid)) > nice
            except OSError:
                pass
    return {**_record, "low_threads": low, "nice": nice}
