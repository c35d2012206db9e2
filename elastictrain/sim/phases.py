"""Time stamps of a recovery's phases in the Ray variant (:mod:`elastictrain.sim.ray_run`), each relative
to the SIGKILL: when the victim's process ended (its pidfd, read by a thread that sleeps in ``select``: no
polling), when Ray's own notice of the death failed its ``run`` call (a thread in ``ray.wait`` on that one
call), when the controller's run watch first returned ended calls and what they were, and the
controller's own steps (its state changes and decision lines, a timer around its recovery methods with
the driver thread's CPU in each, and when each round of calls -- ``open_store``, ``join`` -- was answered;
``_run_after``: the runs sent right behind the joins).

Measurement only: the controller runs unchanged; the timer wraps a few of its methods on the instance and
the former module's ``call_members`` until :meth:`Phases.close`. Marks stop at the first step the
driver saw after the kill (the recovery traced is over).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

# the controller's recovery methods timed (their start and end), in the order they run
TIMED = ("_poll_members", "_check_runs", "_watchdog", "_check_stragglers", "check_drains", "kill_failed",
         "drain_runs", "poll_members_blocking", "_account_failures", "_regroup", "_form_generation",
         "_take_last_polls", "_run_after")  # the controller's, its monitor's or its former's
LINES = {"-> RECOVERING": "state_recovering", "recovery source:": "decision", "-> RUNNING": "state_running"}


class Phases(logging.Handler):
    """Collects ``(name, time)`` marks; :meth:`relative` gives them against the kill."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: list[tuple[str, float]] = []
        self.kill_at: float | None = None
        self.kill_cpu = 0.0
        self.done = False
        self.watching = False
        self.cpu_ms: dict[str, float] = {}  # the driver thread's CPU in each timed method (nested ones count twice)
        self._marks_lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def mark(self, name: str, at: float | None = None) -> None:
        with self._marks_lock:
            if not self.done:
                self.marks.append((name, time.time() if at is None else at))
            self.done = self.done or name == "next_step_seen"  # the recovery traced is over

    def emit(self, record: logging.LogRecord) -> None:  # the controller's log lines
        if self.kill_at is None:
            return
        msg = record.getMessage()
        for text, name in LINES.items():
            if text in msg:
                self.mark(name, record.created)

    def relative(self) -> dict[str, float]:
        """Each mark's first time after the kill, in seconds from it (a name seen again gets ``#2``...)."""
        if self.kill_at is None:
            return {}
        out: dict[str, float] = {}
        for name, at in sorted(self.marks, key=lambda m: m[1]):
            if at < self.kill_at:
                continue
            key, n = name, 1
            while key in out:
                n += 1
                key = f"{name}#{n}"
            out[key] = round(at - self.kill_at, 4)
        return out

    # ------------------------------------------------------------------ around the kill
    def killed(self, pid: int, run_ref: Any, at: float) -> None:
        """Called right after the SIGKILL (sent at ``at``): watch the process end and Ray's notice, each on
        its own thread."""
        self.kill_at, self.kill_cpu = at, time.thread_time()  # (called on the driver's thread)
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone (or no pidfd here)
            self.mark("process_gone")
            fd = None
        if fd is not None:
            self._spawn(self._watch_pid, fd)
        if run_ref is not None:
            self._spawn(self._watch_ref, run_ref)

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="sim-phases")
        t.start()
        self.threads.append(t)

    def _watch_pid(self, fd: int) -> None:
        try:
            select.select([fd], [], [], 30)  # readable once the process exited (a zombie counts)
            self.mark("process_gone")
        finally:
            os.close(fd)

    def _watch_ref(self, ref: Any) -> None:
        ready, _ = ray.wait([ref], timeout=30)
        if ready:
            try:
                ray.get(ready[0])
                self.mark("victim_run_returned")  # (not expected: it was killed)
            except Exception:  # noqa: BLE001 - the death notice is what is timed
                self.mark("ray_death_notice")

    # ------------------------------------------------------------------ the controller
    def instrument(self, controller: Any) -> None:
        """Time the controller's recovery methods (their start and end, after the kill only) and its
        run watch's returns."""
        for name in TIMED:
            owner = next(o for o in (controller, controller.monitor, controller.former) if hasattr(o, name))
            setattr(owner, name, self._timed(name, getattr(owner, name)))
        logger = logging.getLogger("elastictrain.controller")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        watch = controller.rt.watch
        controller.rt = controller.monitor.rt = _Rt(controller.rt, lambda refs: _Watch(watch(refs), self))
        from elastictrain.controller import former as module

        self._module, self._call_members = module, module.call_members
        module.call_members = self._answered

    def close(self) -> None:
        logging.getLogger("elastictrain.controller").removeHandler(self)
        self._module.call_members = self._call_members

    def _answered(self, calls: Any, timeout: float, what: str, *args: Any) -> Any:
        """The controller's rounds of calls (``open_store``, ``join``): when every answer was in."""
        out = self._call_members(calls, timeout, what, *args)
        if self.kill_at is not None:
            self.mark(f"{what.replace(' ', '_')}:answered")
        return out

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.kill_at is None or self.done:
                return fn(*args, **kwargs)
            self.mark(f"{name}>")
            cpu = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_ms[name] = self.cpu_ms.get(name, 0.0) + (time.thread_time() - cpu) * 1e3
                self.mark(f"{name}<")
        return timed


class _Rt:
    """The controller's runtime with its ``watch`` traced; every other call is the runtime's own."""

    def __init__(self, rt: Any, watch: Any) -> None:
        self._rt, self.watch = rt, watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


class _Watch:
    def __init__(self, watch: Any, phases: Phases) -> None:
        self.watch, self.phases = watch, phases

    def wait(self, timeout: float) -> Sequence[Any]:
        if self.phases.kill_at is not None and not self.phases.watching:
            self.phases.watching = True
            self.phases.mark("watch_waiting")  # the driver's first wait for ended calls after the kill
            self.phases.cpu_ms["kill->watch_waiting"] = (time.thread_time() - self.phases.kill_cpu) * 1e3
        ended = self.watch.wait(timeout)
        if ended and self.phases.kill_at is not None:
            self.phases.mark(f"watch_ended_{len(ended)}")
        return ended
