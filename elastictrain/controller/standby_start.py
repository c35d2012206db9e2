"""Ray's start of a standby process, lowered from outside: the standbys started while the run trains
(``workers.standby``, ``Phase.AHEAD``) run in ``SCHED_IDLE`` from their first instruction, not from the preload.

Ray starts every worker process the same way, before any code of ours runs in it: the raylet forks
``setup_worker.py`` (an interpreter that imports most of ``ray``), which execs ``default_worker.py`` (a second
interpreter, ``import ray``, the connect to the raylet). All of it runs at the raylet's own priority (nice 0):
Ray's ``worker_niceness`` (nice 15 unless ``RAY_worker_niceness`` says otherwise) is applied by the worker's
CoreWorker once it is connected, and to its main thread only. Beside training processes at nice 15 a process at
nice 0 takes a core nearly whole (CFS weights 1024 against 36), so that start was taken from the training, not
shared with it. Our hook at Ray's preload (:mod:`elastictrain.worker.import_priority`) comes after all of it.

So the group lowers it from outside. :class:`StartWatch`, a thread of the driver on the standby's node only, finds
the process among the raylet's children by a token (the standby's priorities file path: in the command line
while ``setup_worker.py`` runs, in the environment after its exec) and puts its threads in ``SCHED_IDLE`` at the
nice values they have; threads Ray starts later inherit the class; the CoreWorker's nice and the preload's record
and lowering then work as before (the preload records the same nice values, so a take puts each thread back where
it would have been). Rejected earlier for this start (docs/perf/2026-11-28-standby-priority.md): the raylet kills
a worker that has not registered within ``RAY_worker_register_timeout_seconds`` (60 s by default), and an
idle-class process on a node whose cores are busy may never get that far. Bounded here (:func:`verdict`): unless
the process has registered within :func:`register_bound_s` (a third of Ray's timeout, at most 20 s), the watch
puts it back (``SCHED_OTHER``, the same nice values) and it finishes its start as before. The sign that it
registered is its priorities file: the preload writes it, and the preload runs after the connect
(``ray/_private/workers/default_worker.py``). A take stops the watch first, then puts back what it lowered
(:meth:`StartWatch.put_back`, after :func:`~elastictrain.worker.import_priority.put_back` of the file).

Lowered only where the driver may put it back: ``CAP_SYS_NICE`` of the driver, or the process's own
``RLIMIT_NICE`` allowing the nice values it has (leaving ``SCHED_IDLE`` is checked like lowering a nice value).
Otherwise nothing changes. Linux only. No Ray mechanism is changed (no ``py_executable``: the worker command,
the worker pool's matching and the registration are Ray's as before).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time

from elastictrain.worker.import_priority import can_go_back

RAY_REGISTER_TIMEOUT_ENV = "RAY_worker_register_timeout_seconds"  # Ray's own setting, read only to stay below it
RAY_REGISTER_TIMEOUT_S = 60.0  # its default in Ray 2.60
log = logging.getLogger("elastictrain.controller")
FIND_PERIOD_S = 0.02  # how often the raylet's children are looked through until the process shows
WAIT_PERIOD_S = 0.1  # how often, once lowered, the watch looks for the sign that it registered


def register_bound_s(ray_timeout_s: float) -> float:
    """PURE: how long a lowered start may take to register before it is put back: a third of Ray's
    registration timeout, at most 20 s (the idle class then still leaves it two thirds of Ray's time)."""
    return max(0.0, min(20.0, ray_timeout_s / 3.0))


class Verdict(enum.Enum):
    LOOK = "look"  # not found yet: look again
    LOWER = "lower"  # found, not lowered yet
    WAIT = "wait"  # lowered, not registered yet, within the bound
    PUT_BACK = "put back"  # lowered and not registered within the bound
    DONE = "done"  # nothing more to do (registered, gone, or not found within the bound)


def verdict(elapsed_s: float, found: bool, lowered: bool, registered: bool, gone: bool,
            bound_s: float) -> tuple[Verdict, str]:
    """PURE: what the watch does next, ``elapsed_s`` after the standby's actor was created, with a reason."""
    if gone:
        return Verdict.DONE, "the process is gone"
    if registered:
        return Verdict.DONE, "it registered with the raylet (its preload wrote its file)"
    if elapsed_s >= bound_s:
        if lowered:
            return Verdict.PUT_BACK, f"not registered within {bound_s:g} s: put back to finish its start"
        return Verdict.DONE, f"not found on this node within {bound_s:g} s"
    if not found:
        return Verdict.LOOK, "not started yet"
    return (Verdict.WAIT, "lowered, starting") if lowered else (Verdict.LOWER, "found")


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def children(pid: int) -> set[int]:
    """The child processes of ``pid`` (``/proc/PID/task/TID/children``: no scan of ``/proc``)."""
    out: set[int] = set()
    for tid in _threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def holds(pid: int, token: bytes) -> bool:
    """Whether ``token`` is in the command line or the environment of process ``pid``."""
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                if token in f.read():
                    return True
        except OSError:
            return False
    return False


def may_put_back(pid: int) -> bool:
    """Whether this process may take ``pid``'s threads out of ``SCHED_IDLE`` at their nice values."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/limits") as f:
            line = next(ln for ln in f if ln.startswith("Max nice priority"))
        soft = line.split()[3]
        rlimit = -1 if soft == "unlimited" else int(soft)
        nices = [os.getpriority(os.PRIO_PROCESS, t) for t in _threads(pid)]
    except (OSError, StopIteration, IndexError, ValueError):
        return False
    return bool(nices) and can_go_back(status, rlimit, min(nices))


def set_idle(pid: int, idle: bool) -> int:
    """Every thread of ``pid`` into ``SCHED_IDLE`` (``idle``) or back to ``SCHED_OTHER``; the kernel keeps each
    thread's nice value across the change. Repeated until a pass moves none (a thread started during a pass
    inherits its creator's class). Returns how many it moved; never raises."""
    target, other = (os.SCHED_IDLE, os.SCHED_OTHER) if idle else (os.SCHED_OTHER, os.SCHED_IDLE)
    moved = 0
    for _ in range(5):
        now = 0
        for tid in _threads(pid):
            try:
                if os.sched_getscheduler(tid) == other:
                    os.sched_setscheduler(tid, target, os.sched_param(0))
                    now += 1
            except OSError:  # the thread ended meanwhile, or not ours to change
                pass
        moved += now
        if not now:
            break
    return moved


def supported() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler") and os.path.isdir("/proc/self/task")


class StartWatch:
    """A thread that lowers one standby process's start (above); :meth:`put_back` or :meth:`close` ends it.
    ``registered_file``: the path whose existence says the process registered (its priorities file)."""

    def __init__(self, raylet_pid: int, token: str, registered_file: str, bound_s: float) -> None:
        self.raylet_pid, self.token = raylet_pid, token.encode()
        self.registered_file, self.bound_s = registered_file, bound_s
        self.pid: int | None = None
        self.lowered = threading.Event()  # set once the process is in SCHED_IDLE (tests wait on it)
        self.finished = threading.Event()  # set when the watch has nothing more to do
        self.record: dict[str, object] = {"pid": None, "found_s": None, "cpu_s_at_lowering": None,
                                          "outcome": None, "reason": None, "own_cpu_s": None}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="standby-start-watch", daemon=True)
        self._thread.start()

    def _look(self, seen: set[int]) -> int | None:
        for pid in sorted(children(self.raylet_pid) - seen):
            seen.add(pid)
            if holds(pid, self.token):
                return pid
        return None

    def _run(self) -> None:
        seen: set[int] = set()
        try:
            while not self._stop.is_set():
                pid = self.pid
                gone = pid is not None and not os.path.exists(f"/proc/{pid}")
                act, why = verdict(time.monotonic() - self._t0, pid is not None, self.lowered.is_set(),
                                   os.path.exists(self.registered_file), gone, self.bound_s)
                if act is Verdict.LOOK:
                    self.pid = self._look(seen)
                    if self.pid is None:
                        self._stop.wait(FIND_PERIOD_S)
                    continue
                if act is Verdict.LOWER:
                    self._lower(pid)
                    continue
                if act is Verdict.WAIT:
                    self._stop.wait(WAIT_PERIOD_S)
                    continue
                if act is Verdict.PUT_BACK:
                    with self._lock:
                        set_idle(pid, False)
                    log.info("standby process %s: %s", pid, why)
                self.record.update(outcome=act.value, reason=why)
                return
        finally:
            self.record["own_cpu_s"] = round(time.thread_time(), 4)  # this thread's CPU: the watch's cost
            self.finished.set()

    def _lower(self, pid: int) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self.record.update(pid=pid, found_s=round(time.monotonic() - self._t0, 3))
            if not may_put_back(pid):
                self.record.update(outcome="not lowered", reason="this process may not put it back")
                self._stop.set()
                return
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                self.record["cpu_s_at_lowering"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
            if set_idle(pid, True):
                self.lowered.set()

    def close(self, outcome: str = "closed") -> None:
        """End the watch (joined); what it lowered stays lowered. ``outcome`` goes into :attr:`record` if the
        watch had not ended by itself."""
        with self._lock:
            self._stop.set()
        self._thread.join(timeout=10)
        if self.record["outcome"] is None:
            self.record.update(outcome=outcome, reason=f"{outcome} before it ended by itself")

    def put_back(self) -> int:
        """The take (or a drop): end the watch, then take every thread of the process it lowered out of
        ``SCHED_IDLE`` at the nice value it has. Call it after ``import_priority.put_back`` of the standby's
        file: a standby that lowered itself at its preload is put back from that file, one taken before its
        preload finds the mark there and never lowers itself. Returns how many threads it moved."""
        self.close("taken")
        if not self.lowered.is_set() or self.pid is None:
            return 0
        return set_idle(self.pid, False)


__all__ = ["StartWatch", "Verdict", "register_bound_s", "set_idle", "supported", "verdict"]
