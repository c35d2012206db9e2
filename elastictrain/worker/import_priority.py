"""A standby process imports at idle CPU priority, and trains at normal priority.

A standby worker process (``workers.standby``, :mod:`elastictrain.controller.group`) is started while the run
trains, often right after a replacement joined; its imports (torch, DTensor, DCP: seconds of CPU) would take
a core from the training processes beside it, on every node, after every failure. The group starts it with
:data:`STANDBY_ENV` in its environment (the actor's runtime env), and ``elastictrain/worker/__init__.py``
calls :func:`lower_if_standby` before Ray's preload imports the worker actor's module: the importing thread
switches to ``SCHED_IDLE``, so it runs only on a core nobody else wants. :func:`restore` (the worker actor's
``__init__``, right after the imports) switches every thread of the process back to ``SCHED_OTHER``; a timer
does it after :data:`BOUND_S` seconds if the imports have not finished by then (a node with no idle core at
all must not leave its standby unimported for ever).

Going back is a privilege: Linux lets a thread leave ``SCHED_IDLE`` only with ``CAP_SYS_NICE`` or a
``RLIMIT_NICE`` that allows its nice value (sched(7); 20 - nice: 5 at the nice 15 Ray starts workers at).
Going back keeps the nice value the process had. Without either, :func:`lower_if_standby` leaves the priority alone
(imports at normal priority, as before): a worker that trained at idle priority would be starved by anything
else on its node. Linux only; elsewhere nothing changes. Standard library only: it runs before the imports
it is about.
"""

from __future__ import annotations

import os
import threading

STANDBY_ENV = "ELASTICTRAIN_STANDBY_PROCESS"
"""Set to "1" in a standby process's environment by the group; nobody else sets it."""
BOUND_S = 10.0
"""At most this long at idle priority: a standby's imports take ~4 s of CPU on a core of its own."""
_CAP_SYS_NICE = 23  # linux/capability.h

_lock = threading.Lock()
_lowered = False
_record: dict[str, object] = {"lowered": False, "restored_by": None}


def can_leave_idle(status: str, rlimit_nice: int, nice: int) -> bool:
    """PURE: may a thread at nice value ``nice``, with this ``/proc/self/status`` text and ``RLIMIT_NICE``
    soft limit, switch from ``SCHED_IDLE`` back to ``SCHED_OTHER``? Linux treats it as asking for its nice
    value: ``CAP_SYS_NICE``, or ``RLIMIT_NICE`` >= 20 - nice (Ray starts workers at nice 15: 5)."""
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
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler") and os.path.isdir("/proc/self/task")


def _may_restore() -> bool:
    import resource

    try:
        with open("/proc/self/status") as f:
            status = f.read()
        return can_leave_idle(status, resource.getrlimit(resource.RLIMIT_NICE)[0], os.nice(0))
    except (OSError, AttributeError, ValueError):
        return False


def lower_if_standby() -> bool:
    """In a standby process (and where it can be undone), switch the calling thread to ``SCHED_IDLE`` and
    arm the :data:`BOUND_S` timer; True when it did. Never raises."""
    global _lowered
    if os.environ.get(STANDBY_ENV) != "1" or not _supported():
        return False
    with _lock:
        if _lowered or not _may_restore():
            return False
        # started first: a new thread takes the policy of the thread that starts it
        timer = threading.Timer(BOUND_S, restore, kwargs={"by": "timer"})
        timer.daemon = True
        timer.start()
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            timer.cancel()
            return False
        _lowered = True
        _record["lowered"] = True
    return True


def restore(by: str = "init") -> None:
    """Every thread of this process at ``SCHED_IDLE`` goes back to ``SCHED_OTHER`` (idempotent; never raises).
    ``by`` says who did, in :func:`report`."""
    global _lowered
    with _lock:
        if not _lowered:
            return
        _lowered = False
        _record["restored_by"] = by
        os.environ.pop(STANDBY_ENV, None)  # processes it starts from now on are not standbys
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            pass


def report() -> dict[str, object]:
    """What happened in this process: ``lowered`` (its imports ran at idle priority), ``restored_by``
    ("init", "timer" or None), ``idle_threads`` (threads at ``SCHED_IDLE`` now) and its ``nice`` value."""
    idle = 0
    if _supported():
        for tid in os.listdir("/proc/self/task"):
            try:
                idle += os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
            except OSError:
                pass
    return {**_record, "idle_threads": idle, "nice": os.nice(0)}
