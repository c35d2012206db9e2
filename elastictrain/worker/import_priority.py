"""A standby process started while the run trains lives at the lowest CPU priority until it is taken; the
run's first standby, started with the first workers, runs at the workers' priority; taken, every standby
trains at the priority it started with.

A standby worker process (``workers.standby``, :mod:`elastictrain.controller.group`) is started beside the
training processes (the first with them, the next after each replacement); everything it does before a
replacement takes it (its imports: torch, DTensor, FSDP, seconds of CPU; and its set-up ahead: model and
data) takes CPU from whatever runs beside it. The phase it starts in decides
(:func:`priority_for`, a pure rule):

- ``START`` (the run's first standby, started right after the first generation's workers): the cores are
  importing anyway, so it starts at the workers' priority and is done in seconds, before the steps are under
  way. In the idle class it would be smeared over the whole run instead, importing in every gap of the
  training processes' collectives for all of it (docs/perf/2026-11-28-standby-first.md).
- ``AHEAD`` (every later standby, started while the run trains, after a replacement): the ``SCHED_IDLE``
  class at nice 19: the scheduler then gives it the CPU the training processes leave (a core idle while
  they wait on a collective or on data) and preempts it as soon as one wakes, instead of a share of a busy
  core; a run that just lost a worker does not also lose a third of its CPU to the next standby's start.

The group starts it with :data:`STANDBY_ENV` naming the phase in its environment (the actor's runtime env),
and ``elastictrain/worker/__init__.py`` calls :func:`lower_if_standby` when Ray's preload imports the worker
package: in the ``AHEAD`` phase every thread the process has then (Ray's own included) goes to the low
priority, and the threads started later inherit it. The actor's ``__init__`` leaves a standby (slot -1)
there; taking it puts every thread back (:func:`restore`): the group calls ``Worker.wake`` when it hands the
standby a slot, and the set-up with a slot calls it too. At that moment a core is free (the one the dead
worker held), so even an idle-class process runs at once.

Not covered here: Ray's own start of the process (``setup_worker.py``, the interpreter, ``import ray``, the
connect to the raylet), which runs before the preload, at the raylet's nice value (Ray's ``worker_niceness``
comes with the connect, main thread only). The group lowers that from outside, bounded by Ray's
registration timeout (:mod:`elastictrain.controller.standby_start`); it leaves each thread's nice value as it
is, so what this module records and puts back is the same with or without it.

The GIL hazard of ``SCHED_IDLE``: an idle-class thread that holds Python's GIL while the cores are busy
stops every other thread of its process, the one that would run ``wake`` included. Two bounds: the take
happens when a core is free (above), and where the taking controller runs on the standby's node it puts the
threads back from outside too (:func:`restore_process`, by pid, no GIL needed), which is what the
replacements of a single-node run rely on; it finds the pid and the threads' nice values in the file the
standby wrote before lowering itself (:data:`PRIORITIES_ENV`), so this works while the standby is still
importing, before its actor exists to answer any call; and a standby taken before it lowered itself finds
the group's mark there and never does (:func:`put_back`). The files live in the node's temporary folder
(``elastictrain-standby/``); the group removes them at shutdown and :func:`sweep` those of dead processes.

Going back is a privilege: Linux lets a thread lower its nice value (or leave ``SCHED_IDLE``) only with
``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` that allows the value (20 - nice: 5 for the nice 15 Ray starts workers
at). Without either, :func:`lower_if_standby` leaves the priority alone (the standby runs at the training
priority, as before this module): a worker left at the low priority would lose its core to anything else on
its node. Linux only; elsewhere nothing changes. Standard library only: it runs before the imports it is
about.
"""

from __future__ import annotations

import enum
import json
import os
import threading
from dataclasses import dataclass

STANDBY_ENV = "ELASTICTRAIN_STANDBY_PROCESS"
"""Set to the :class:`Phase` value a standby process starts in (``start`` or ``ahead``) in its environment by
the group; nobody else sets it."""
PRIORITIES_ENV = "ELASTICTRAIN_STANDBY_PRIORITIES"
"""A file path, set beside :data:`STANDBY_ENV` by the group: the standby writes its pid and each thread's nice
value there before it lowers them (:func:`read_priorities`), so the group can put it back from outside."""
LOW_NICE = 19
_CAP_SYS_NICE = 23  # linux/capability.h
IDLE, OTHER = "idle", "other"  # the scheduling classes used: SCHED_IDLE, SCHED_OTHER

_lock = threading.Lock()
_lowered_from: int | None = None  # the nice value the process had, while lowered
_thread_nice: dict[int, int] = {}  # each thread's nice value before it was lowered (Ray's own threads run at 0)
_record: dict[str, object] = {"lowered": False, "restored_by": None}


class Phase(enum.Enum):
    START = "start"  # the run's first standby, started with the first workers: the cores import anyway
    AHEAD = "ahead"  # started ahead while the run trains: imports, set-up with no slot, waiting to be taken
    TAKEN = "taken"  # a replacement runs in it: it trains


@dataclass(frozen=True)
class Priority:
    policy: str  # IDLE or OTHER
    nice: int


def priority_for(phase: Phase, training_nice: int, may_go_back: bool, has_idle: bool) -> Priority:
    """PURE: the priority of a standby process in ``phase``. Started ahead while the run trains (``AHEAD``):
    ``SCHED_IDLE`` at nice 19 (nice 19 alone where the platform has no ``SCHED_IDLE``), but only where it
    ``may_go_back`` to ``training_nice``; otherwise, started with the run (``START``) and once taken, the
    training priority."""
    if phase is not Phase.AHEAD or not may_go_back or training_nice >= LOW_NICE and not has_idle:
        return Priority(OTHER, training_nice)
    return Priority(IDLE if has_idle else OTHER, LOW_NICE)


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


def _has_idle() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


def _may_go_back(nice: int) -> bool:
    import resource

    try:
        with open("/proc/self/status") as f:
            status = f.read()
        return can_go_back(status, resource.getrlimit(resource.RLIMIT_NICE)[0], nice)
    except (OSError, AttributeError, ValueError):
        return False


def _set_thread(tid: int, priority: Priority) -> None:
    """One thread (Linux: setpriority and sched_setscheduler act on a thread id). Raises OSError."""
    if _has_idle():
        policy = os.SCHED_IDLE if priority.policy == IDLE else os.SCHED_OTHER
        if priority.policy == OTHER:  # leave the idle class first: nice is ignored in it
            os.sched_setscheduler(tid, policy, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, priority.nice)
    if _has_idle() and priority.policy == IDLE:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _threads(pid: int | str) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def lower_if_standby() -> bool:
    """In a standby process started in the :data:`Phase.AHEAD` phase (and where it can be undone), put every
    thread of the process at that phase's priority until :func:`restore`; True when it did. Never raises."""
    global _lowered_from
    phase = {p.value: p for p in Phase}.get(os.environ.get(STANDBY_ENV, ""))
    if phase is None or not _supported():
        return False
    with _lock:
        if _lowered_from is not None:
            return False
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        low = priority_for(phase, nice, _may_go_back(nice), _has_idle())
        if low == Priority(OTHER, nice):
            return False
        me = threading.get_native_id()
        _thread_nice.clear()
        for tid in _threads("self"):  # Ray's threads started before the preload, this one included
            try:
                _thread_nice[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            except OSError:  # the thread ended meanwhile
                pass
        _thread_nice[me] = nice
        if not _publish(nice):  # taken before it got here: it trains, it does not lower itself
            os.environ.pop(STANDBY_ENV, None)
            return False
        try:  # this thread first: if it cannot, nothing changed
            _set_thread(me, low)
        except OSError:
            return False
        for tid in _thread_nice:
            try:
                _set_thread(tid, low)
            except OSError:  # the thread ended meanwhile
                pass
        _lowered_from = nice
        _record["lowered"] = True
    return True


def _claim(path: str, text: str) -> bool:
    """Create ``path`` holding ``text``, whole, unless it exists (a hard link of a finished temporary file:
    atomic, so the reader never sees half of it). True when this call created it."""
    tmp = f"{path}.{os.getpid()}.{threading.get_native_id()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _publish(nice: int) -> bool:
    """Write this process's priorities to its :data:`PRIORITIES_ENV` file before lowering them. False when
    the group has taken the standby already (its mark holds the path): then it must not lower itself."""
    path = os.environ.get(PRIORITIES_ENV)
    if not path:
        return True
    text = json.dumps({"pid": os.getpid(), "nice": nice, "threads": {str(t): n for t, n in _thread_nice.items()}})
    try:
        return _claim(path, text)
    except OSError:  # cannot write: the group then relies on Worker.wake alone
        return True


def read_priorities(path: str) -> tuple[int, int, dict[int, int]] | None:
    """What a standby wrote to its :data:`PRIORITIES_ENV` file: (pid, the nice value it trains at, each
    thread's nice value before); None when there is no such file on this node, or it holds the group's mark."""
    try:
        with open(path) as f:
            data = json.load(f)
        return int(data["pid"]), int(data["nice"]), {int(t): int(n) for t, n in data["threads"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def put_back(path: str) -> str:
    """The group's side of a take, on its own node: mark ``path`` taken so that a standby that has not lowered
    itself yet never does ("marked"), or put back the threads of one that has ("restored N"); "not here" when
    the file names no live process of this node. Never raises."""
    try:
        if _claim(path, json.dumps({"taken": True})):
            return "marked"
    except OSError:
        return "not here"
    written = read_priorities(path)
    if written is None:
        return "not here"
    return f"restored {restore_process(*written)}"


MARK_TTL_S = 86400.0
"""A mark (a standby taken before it lowered itself) older than this is swept: its process is long gone."""


def sweep(folder: str, now: float) -> int:
    """Remove the files in ``folder`` that no standby needs any more: those whose process is gone (one killed
    between its start and its group's shutdown writes its file after the group looked), and marks older than
    :data:`MARK_TTL_S`. Returns how many it removed; never raises."""
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json")]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(folder, name)
        written = read_priorities(path)
        try:
            if written is None:
                stale = now - os.stat(path).st_mtime > MARK_TTL_S
            else:
                stale = not os.path.exists(f"/proc/{written[0]}")
            if stale:
                os.unlink(path)
                removed += 1
        except OSError:  # removed meanwhile
            pass
    return removed


def restore_process(pid: int | str, nice: int, before: dict[int, int] | None = None) -> int:
    """Every thread of process ``pid`` ("self": this one) in ``SCHED_IDLE`` or at :data:`LOW_NICE` goes to
    ``SCHED_OTHER`` at the nice value it had before (``before``, by thread id), or at ``nice`` (one started
    while lowered). From another process this needs no GIL of the target's (the group's bound on the idle
    class's GIL hazard). Returns how many threads it moved; never raises."""
    before = before or {}
    moved = 0
    for tid in _threads(pid):
        try:
            idle = _has_idle() and os.sched_getscheduler(tid) == os.SCHED_IDLE
            if idle or os.getpriority(os.PRIO_PROCESS, tid) >= LOW_NICE > nice:
                _set_thread(tid, Priority(OTHER, before.get(tid, nice)))
                moved += 1
        except OSError:  # the thread ended meanwhile, or not ours to change
            pass
    return moved


def restore(by: str = "take") -> None:
    """This process goes to the :data:`Phase.TAKEN` priority (the nice value it started with, ``SCHED_OTHER``)
    if it was lowered (idempotent; never raises). ``by`` says who did, in :func:`report`."""
    global _lowered_from
    with _lock:
        if _lowered_from is None:
            return
        nice, _lowered_from = _lowered_from, None
        _record["restored_by"] = by
        os.environ.pop(STANDBY_ENV, None)  # processes it starts from now on are not standbys
    restore_process("self", nice, _thread_nice)
    path = os.environ.pop(PRIORITIES_ENV, None)
    if path:
        try:
            os.unlink(path)
        except OSError:  # the group removed it, or it lives on another node's disk
            pass


def report() -> dict[str, object]:
    """What happened in this process: ``lowered`` (it lived at the low priority ahead of a take),
    ``restored_by`` ("take", "init" or None), ``low_threads`` (threads in ``SCHED_IDLE`` or above the
    nice value the process trains at, now) and that ``nice`` value (its main thread's; Ray's own threads
    run at 0)."""
    nice = _lowered_from if _lowered_from is not None else os.getpriority(os.PRIO_PROCESS, os.getpid())
    low = 0
    if _supported():
        for tid in _threads("self"):
            try:
                idle = _has_idle() and os.sched_getscheduler(tid) == os.SCHED_IDLE
                low += idle or os.getpriority(os.PRIO_PROCESS, tid) > nice
            except OSError:
                pass
    return {**_record, "low_threads": low, "nice": nice}
