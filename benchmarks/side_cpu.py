"""The CPU each side of ``benchmarks/throughput.py`` spends per step, whole and by role, and the wake-ups of
its training processes' threads.

* Whole side (optional: needs a writable cgroup-v1 ``cpuacct`` hierarchy at ``/sys/fs/cgroup/cpuacct``):
  each side runs in a cpuacct group of its own, so its figure is the exact CPU of every process it started
  (elastictrain: the driver with the controller, Ray's daemons, the workers, the standby, Ray's idle worker
  processes; plain: torchrun's agent and its ranks), whoever else runs on the machine. Where the hierarchy
  is missing or read-only the column is left out and :func:`cgroup_unavailable` says why.
* By role (``/proc/PID/stat``, as ``step_cpu.py``): the two training processes, the launcher (elastictrain:
  this script's process, i.e. the driver; plain: torchrun's agent), elastictrain's standby process (found
  by its runtime environment), other Ray worker processes (Ray's idle pre-started ones), Ray's daemons, and
  the rest (whole side less those).
* Wake-ups: ``voluntary_ctxt_switches`` of every thread of the training processes
  (``/proc/PID/task/TID/status``), per second of the window. A thread that sleeps on a timer (a heartbeat,
  a poll, Ray's 10 ms signal check) wakes once per period; on two cores each wake-up can preempt a rank.

A sampler thread reads all of it every ``period`` seconds, stamped with ``time.time()``; the figures of a
window (rank 0's clock at steps ``W`` and ``N``) are interpolated between samples. The sampler moves itself
to the root cgroup, so its own CPU is on neither side.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cgroup_cpu
from cgroup_cpu import CpuGroup
from proc_cpu import parents, thread_stats

CG_ROOT = cgroup_cpu.ROOT


def cgroup_unavailable() -> str | None:
    """None when per-side cgroups can be made here; otherwise the reason, for the report."""
    if cgroup_cpu.available() and (CG_ROOT / "cpuacct.usage").exists():
        return None
    return (f"{CG_ROOT} is not a writable cgroup-v1 cpuacct hierarchy here (needs root and cgroup v1): "
            f"the whole-side CPU column is left out")


def wrap_in_group(group: CpuGroup | None, cmd: list[str]) -> list[str]:
    """``cmd`` run by a shell that first moves itself into ``group`` (no ``preexec_fn``: the caller has threads)."""
    if group is None:
        return cmd
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group.path), *cmd]


def _ctxt(pid: int) -> dict[int, int]:
    """{thread id: voluntary context switches} of a live process."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[int(tid)] = int(line.split()[1])
                    break
        except OSError:
            continue
    return out


def children(pid: int) -> list[int]:
    return [child for child, parent in parents().items() if parent == pid]


class RayRoles:
    """{pid: role} of this driver's private Ray: its daemons with their helper processes (the raylet's agents,
    the dashboard's modules), the standby, and the raylet's other worker processes (the training ones are
    named by the caller). Rescanned at most once a second: a scan of /proc costs the sampler."""

    def __init__(self) -> None:
        self.daemons: dict[int, str] = {}
        self._found: dict[int, str] = {}
        self._at = 0.0

    def __call__(self) -> dict[int, str]:
        import ray

        node = ray._private.worker._global_node if ray.is_initialized() else None
        if not self.daemons and node is not None:  # (the run starts its Ray after the sampler started)
            self.daemons = {i.process.pid: "ray daemon" for infos in node.all_processes.values() for i in infos
                            if i.process is not None}
        if self.daemons and time.time() - self._at >= 1.0:
            self._at = time.time()
            table = parents()
            known = {**self.daemons, **self._found}
            for _ in range(3):  # descendants, a few levels down
                for c, parent in table.items():
                    if parent in known and (c not in self._found or self._found[c] == "ray worker"):
                        self._found[c] = _kind(c)
                known = {**self.daemons, **self._found}
        return {**self.daemons, **self._found}


def _kind(pid: int) -> str:
    """A Ray worker process (elastictrain's standby: its runtime env sets the standby variable; it is read
    again at every scan, as a process just forked still has its parent's environment) or a daemon's helper."""
    from elastictrain.worker.import_priority import STANDBY_ENV

    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"default_worker.py" not in cmdline:
            return "ray daemon"
        return "standby" if f"{STANDBY_ENV}=".encode() in Path(f"/proc/{pid}/environ").read_bytes() else "ray worker"
    except OSError:
        return "ray worker"


@dataclass(frozen=True)
class SideCpu:
    """CPU-s per step of one side over a window, and its training processes' wake-ups per second."""
    whole: float | None              # the side's cgroup (None: no cgroup here)
    training: float                  # its two training processes (/proc)
    launcher: float                  # elastictrain: the driver process less the sampler; plain: torchrun's agent
    background: float | None = None  # the other side's group over this window (idle Ray beside plain DDP)
    wakeups: dict[str, float] = field(default_factory=dict)  # thread label -> wake-ups/s, per training process
    ray_workers: float = 0.0         # Ray worker processes other than the training ones and the standby
    standby: float = 0.0             # elastictrain's standby process
    ray_daemons: float = 0.0         # Ray's daemons (raylet, GCS, log monitor, agents)
    steps_per_s: float = 0.0
    thread_cpu: dict[str, float] = field(default_factory=dict)  # thread label -> CPU-s/step, per training process

    @property
    def rest(self) -> float | None:
        if self.whole is None:
            return None
        return self.whole - self.training - self.launcher - self.standby - self.ray_workers - self.ray_daemons

    @property
    def training_wakeups(self) -> float:
        return sum(self.wakeups.values())


@dataclass
class _Series:
    times: list[float] = field(default_factory=list)
    groups: list[dict[str, float]] = field(default_factory=list)
    threads: list[dict[int, dict[int, tuple[str, float, int]]]] = field(default_factory=list)


def _at(times: list[float], values: list[float], t: float) -> float:
    for (ta, va), (tb, vb) in zip(zip(times, values), zip(times[1:], values[1:])):
        if ta <= t <= tb:
            return va + (vb - va) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
    raise RuntimeError(f"t={t} outside the sampled window {times[0] if times else None}..{times[-1] if times else None}")


class Sampler:
    """Samples the given groups' usage and the threads of ``roles()`` ({pid: role}, called each tick: the
    set may grow) every ``period`` seconds until :meth:`stop`."""

    def __init__(self, groups: dict[str, CpuGroup], roles: Callable[[], dict[int, str]],
                 period: float = 0.2) -> None:
        self._groups, self._roles, self._period = groups, roles, period
        self._series = _Series()
        self.role_of: dict[int, str] = {}
        self.own_tid = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="side-cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.own_tid = threading.get_native_id()
        if self._groups:
            try:  # this thread's CPU is the benchmark's, not either side's
                (CG_ROOT / "tasks").write_text(str(self.own_tid))
            except OSError:
                pass
        while True:
            roles = self._roles()
            self.role_of.update(roles)
            snap: dict[int, dict[int, tuple[str, float, int]]] = {}
            for pid in roles:
                cpu, ctxt = thread_stats(pid), _ctxt(pid)
                snap[pid] = {tid: (name, c, ctxt.get(tid, 0)) for tid, (name, c, _) in cpu.items()
                             if tid != self.own_tid}
            s = self._series
            s.times.append(time.time())
            s.groups.append({name: g.cpu_s() for name, g in self._groups.items()})
            s.threads.append(snap)
            if self._stop.is_set():
                return
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float, steps: int, side: str, other: str | None) -> SideCpu:
        """The figures of ``side``'s group (and ``other``'s, as background) between ``t0`` and ``t1``."""
        s = self._series
        if not s.times or s.times[0] > t0 or s.times[-1] < t1:
            raise RuntimeError("the sampler did not cover the steady-state window")

        def group(name: str | None) -> float | None:
            if name is None or name not in self._groups:
                return None
            vals = [g[name] for g in s.groups]
            return (_at(s.times, vals, t1) - _at(s.times, vals, t0)) / steps

        def thread_delta(pid: int, tid: int, k: int) -> float:
            # a thread missing from a sample: 0 before it started, its last figure after it ended
            vals, last = [], 0.0
            for snap in s.threads:
                got = snap.get(pid, {}).get(tid)
                last = got[k] if got is not None else last
                vals.append(last)
            return _at(s.times, vals, t1) - _at(s.times, vals, t0)

        per_role: dict[str, float] = defaultdict(float)
        wake: dict[str, float] = defaultdict(float)
        thread_cpu: dict[str, float] = defaultdict(float)
        n_training = sum(1 for r in self.role_of.values() if r == "training") or 1
        for pid, role in self.role_of.items():
            tids: dict[int, list[str]] = defaultdict(list)
            for ts, snap in zip(s.times, s.threads):
                for tid, (name, _, _) in snap.get(pid, {}).items():
                    if t0 <= ts <= t1 and name not in tids[tid]:
                        tids[tid].append(name)
                    tids.setdefault(tid, [])
            for tid, names in tids.items():
                cpu = thread_delta(pid, tid, 1) / steps
                per_role[role] += cpu
                if role == "training":
                    wake["|".join(names) or "?"] += thread_delta(pid, tid, 2) / (t1 - t0) / n_training
                    thread_cpu["|".join(names) or "?"] += cpu / n_training
        return SideCpu(group(side), per_role["training"], per_role["launcher"], group(other),
                       {k: v for k, v in sorted(wake.items(), key=lambda kv: -kv[1])},
                       per_role["ray worker"], per_role["standby"], per_role["ray daemon"], steps / (t1 - t0),
                       {k: v for k, v in sorted(thread_cpu.items(), key=lambda kv: -kv[1])})


def one_line(c: SideCpu) -> str:
    """One run's figures, CPU-ms per step."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f}"
    return (f"whole {ms(c.whole)} training {ms(c.training)} launcher {ms(c.launcher)} standby {ms(c.standby)} "
            f"ray workers {ms(c.ray_workers)} daemons {ms(c.ray_daemons)} rest {ms(c.rest)} beside "
            f"{ms(c.background)} ms/step; training wake-ups {c.training_wakeups:.0f}/s per process ("
            + ", ".join(f"{k} {v:.0f}" for k, v in c.wakeups.items() if v >= 1) + "); training threads "
            + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in c.thread_cpu.items() if v >= 2e-5) + " ms/step per process")
