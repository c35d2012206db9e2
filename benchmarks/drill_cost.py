"""What each kill of the recovery drill costs, in CPU seconds per process (load-independent evidence).

Run: ``python benchmarks/drill_cost.py [--spares 0] [--interval 15] [--chaos-s 100] [--ckpt-every 20]``
from the repository root (Ray adds the driver's directory to its workers' ``sys.path``).

The drill is ``benchmarks/recovery.py``'s scenario C (its job, its killer: the current rank-1 worker
SIGKILLed every ``--interval`` seconds), one run on a fresh private Ray. Wall-clock goodput on a shared
machine says more about the neighbours than about the code, so this measures where the CPU went instead:
a sampler thread (``benchmarks/step_cpu.py``'s) reads ``/proc/PID/task/TID/stat`` of every process the run
has (the driver, Ray's daemons, every Ray worker process: members, the replacement, the standbys, idle
pre-started ones) every 0.2 s, with each thread's scheduling class (``SCHED_IDLE`` or not).

Per kill, over the window from the kill to the next one (or as long, for the last), each process's CPU
seconds by role: the survivor, the killed rank's replacement (and whether it ran in the standby, prebuilt),
the next standby (started after the replacement: its CPU outside the idle class, where Ray's start runs at
the raylet's nice 0 unless lowered, and in it), the driver, Ray's daemons, other Ray processes. Beside it
the same processes' rate over the ``--baseline-s`` seconds before the first kill (steady training, no
failure), scaled to the window: the kill's extra CPU is the difference. The events give the timeline
(failure, recovered ``downtime_s``, the generations, the replacement's ``worker_started`` flags). Steps in
each window are counted too, but their time is the machine's: read the CPU columns.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import recovery  # noqa: E402
from proc_cpu import parents, thread_stats  # noqa: E402  (sets RAY_TRAIN_V2_ENABLED; its job, killer and event tail)

class Sampler:
    """Every ``period`` s: each watched process's threads (CPU, class). The set of processes is the driver,
    Ray's daemons and every child of the raylet (rescanned each second)."""

    def __init__(self, daemons: dict[int, str], period: float = 0.2) -> None:
        self.daemons, self.period = daemons, period
        self.samples: dict[int, list[tuple[float, dict[int, tuple[str, float, bool]]]]] = defaultdict(list)
        self.first_seen: dict[int, float] = {}
        self.own_tid = -1
        self._children: list[int] = []
        self._scanned = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _pids(self) -> list[int]:
        now = time.time()
        if now - self._scanned >= 1.0:
            raylets = {p for p, label in self.daemons.items() if label == "ray raylet"}
            self._children = [p for p, pp in parents().items() if pp in raylets]
            self._scanned = now
        return [os.getpid(), *self.daemons, *self._children]

    def _run(self) -> None:
        self.own_tid = threading.get_native_id()
        while not self._stop.is_set():
            for pid in self._pids():
                cpu = thread_stats(pid)
                if cpu:
                    now = time.time()
                    self.first_seen.setdefault(pid, now)
                    self.samples[pid].append((now, cpu))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu(self, pid: int, t0: float, t1: float) -> tuple[float, float]:
        """(CPU seconds, of which in SCHED_IDLE) of ``pid`` between ``t0`` and ``t1`` (sample resolution:
        the last sample at or before each end; a process not yet seen counts from 0, one gone keeps its
        last figure). The sampler's own thread is left out."""
        series = self.samples.get(pid, [])
        total = idle = 0.0
        if not series:
            return 0.0, 0.0
        a, b = _before(series, t0), _before(series, t1)
        for tid, (_, c1, _) in b.items():
            if tid == self.own_tid:
                continue
            c0 = a.get(tid, ("", 0.0, False))[1]
            total += c1 - c0
        # the idle share: per sample interval, what each idle-class thread gained
        prev = a
        for ts, cur in series:
            if ts <= t0 or ts > t1:
                continue
            for tid, (_, c, is_idle) in cur.items():
                if is_idle and tid != self.own_tid:
                    idle += c - prev.get(tid, ("", 0.0, False))[1]
            prev = cur
        return total, idle


def _before(series: list[tuple[float, dict]], t: float) -> dict:
    best: dict = {}
    for ts, cpu in series:
        if ts > t:
            break
        best = cpu
    return best


def _daemons() -> dict[int, str]:
    import ray

    node = ray._private.worker._global_node
    return {info.process.pid: f"ray {kind}" for kind, infos in node.all_processes.items() for info in infos
            if info.process is not None}


def roles(events: list[dict[str, Any]], kills: list[float], sampler: Sampler) -> list[dict[int, str]]:
    """Per kill: {pid: role} for the processes that matter in its window."""
    started = [e for e in events if e["event"] == "worker_started"]
    out = []
    for i, t in enumerate(kills):
        t_next = kills[i + 1] if i + 1 < len(kills) else float("inf")
        r: dict[int, str] = {os.getpid(): "driver"}
        for pid, label in sampler.daemons.items():
            r[pid] = label
        before = [e for e in started if e["time"] < t]
        members = {}
        for e in before:
            members[e["rank"]] = e["pid"]
        for e in started:  # earlier rank-1 processes, killed before this window
            if e["rank"] == 1 and e["time"] < t:
                r[e["pid"]] = "rank 1 (killed earlier)"
        for rank, pid in members.items():
            r[pid] = f"rank {rank} (killed)" if rank == 1 else f"survivor rank {rank}"
        repl = next((e for e in started if t <= e["time"] < t_next), None)
        if repl is not None:
            flags = ",".join(k for k in ("standby", "prebuilt", "reused") if repl.get(k))
            r[repl["pid"]] = f"replacement ({flags or 'fresh'})"
        # the next standby: a Ray process first seen after the kill that is no member (it is the next
        # replacement's process, if the run lasted)
        for pid, seen in sampler.first_seen.items():
            if pid not in r and t <= seen < t_next:
                r[pid] = "next standby (or new Ray process)"
        out.append(r)
    return out


def _role_class(role: str) -> str:
    if role.startswith(("rank 1", "replacement")):
        return "rank-1 slot (killed + replacement)"
    if role.startswith("survivor"):
        return "survivor"
    if role.startswith("next standby"):
        return "next standby"
    if role.startswith("ray "):
        return "ray daemons"
    return role if role == "driver" else "other Ray processes"


def report(events: list[dict[str, Any]], kills: list[float], sampler: Sampler, baseline_s: float) -> dict:
    steps = [e for e in events if e["event"] == "step"]
    t_first = min(recovery._t(e) for e in steps)
    t_b1 = kills[0] if kills else max(recovery._t(e) for e in steps)
    t_b0 = max(t_first + 2.0, t_b1 - baseline_s)
    base = {pid: sampler.cpu(pid, t_b0, t_b1) for pid in sampler.samples}
    base_steps = sum(1 for e in steps if t_b0 <= recovery._t(e) < t_b1)
    base_s = t_b1 - t_b0
    per_step_all = round(sum(c for c, _ in base.values()) / max(1, base_steps), 4)
    out: dict[str, Any] = {"baseline": {"from": t_b0, "to": t_b1, "s": round(base_s, 2), "steps": base_steps,
                                        "cpu_s_per_step_all": per_step_all}, "kills": []}
    print(f"\nbaseline: {base_s:.1f} s before the first kill, {base_steps} steps, "
          f"{out['baseline']['cpu_s_per_step_all'] * 1e3:.1f} CPU-ms per step (every process)")
    for pid in sorted(base, key=lambda p: -base[p][0]):
        if base[pid][0] > 0.05:
            print(f"    pid {pid:<8} {base[pid][0]:6.2f} CPU-s")
    for i, (t, r) in enumerate(zip(kills, roles(events, kills, sampler))):
        t_end = kills[i + 1] if i + 1 < len(kills) else min(t + (kills[i] - kills[i - 1] if i else 15.0),
                                                             max(recovery._t(e) for e in steps))
        w = t_end - t
        n = sum(1 for e in steps if t <= recovery._t(e) < t_end)
        after = [e for e in events if t <= e["time"] < t_end]
        timeline = []
        for e in after:
            if e["event"] in ("failure", "recovered", "generation_started", "worker_started", "resized"):
                keep = {k: e[k] for k in ("event", "reason", "world_size", "rank", "pid", "standby", "prebuilt",
                                          "reused", "setup_s", "downtime_s", "step") if k in e}
                keep["t"] = round(e["time"] - t, 3)
                timeline.append(keep)
        per = {}
        total_extra = 0.0
        for pid in sampler.samples:
            c, idle = sampler.cpu(pid, t, t_end)
            b = base.get(pid, (0.0, 0.0))[0] * w / base_s
            role = r.get(pid, "other Ray process")
            if c < 0.02 and b < 0.02:
                continue
            per[pid] = {"role": role, "cpu_s": round(c, 3), "idle_class_s": round(idle, 3),
                        "baseline_s": round(b, 3), "extra_s": round(c - b, 3)}
            total_extra += c - b
        classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for pid, pp in per.items():
            cls = _role_class(pp["role"])
            for j, key in enumerate(("cpu_s", "idle_class_s", "baseline_s")):
                classes[cls][j] += pp[key]
        k = {"kill": i + 1, "by_role": {c: [round(x, 3) for x in v] for c, v in classes.items()},
             "window_s": round(w, 2), "steps": n, "baseline_steps": round(base_steps * w / base_s, 1),
             "timeline": timeline, "per_process": per, "extra_cpu_s": round(total_extra, 3)}
        out["kills"].append(k)
        print(f"\nkill {i + 1}: window {w:.1f} s, {n} steps (baseline rate: {k['baseline_steps']})")
        for e in timeline:
            print(f"    +{e['t']:7.3f} s  {json.dumps({k: v for k, v in e.items() if k != 't'})}")
        print(f"    {'role':<40} {'CPU-s':>7} {'idle':>7} {'base':>7} {'extra':>7}")
        for pid, p in sorted(per.items(), key=lambda kv: -kv[1]["extra_s"]):
            print(f"    {p['role'][:32]:<32} {pid:<7} {p['cpu_s']:7.2f} {p['idle_class_s']:7.2f} "
                  f"{p['baseline_s']:7.2f} {p['extra_s']:7.2f}")
        print(f"    extra CPU-s over the baseline rate: {total_extra:.2f}")
        for c, (cpu, idle, b) in sorted(classes.items()):
            print(f"      {c:<28} {cpu:7.2f} CPU-s ({idle:.2f} idle class), baseline {b:7.2f}, extra {cpu - b:7.2f}")
    return out


def _run(config: Any, run_dir: Path, killer: Any) -> list[dict[str, Any]]:
    """``recovery.run_elastictrain`` that reports a failed run too: the killer does not know the run is
    ending, and a kill while the final model is written fails the run (a failure at the end is not
    recovered); the kills before it are measured all the same."""
    from elastictrain import Trainer
    from elastictrain.events import read_events

    run_dir.mkdir(parents=True, exist_ok=True)
    with recovery.EventTail(run_dir) as tail:
        thread = threading.Thread(target=killer, args=(tail,), daemon=True)
        thread.start()
        result = Trainer(config, run_dir=run_dir, console=None).fit()
    thread.join(timeout=10)
    if not result.ok:
        print(f"the run failed (exit {result.exit_code}): {result.summary.get('error')}")
    return read_events(run_dir)


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per kill (the last left out: the run's end cuts its window): how it recovered (the
    ``recover`` generation's size, steps at world 1 before the grow), the replacement's ``setup_s``, and
    CPU-s: the training processes' beyond their steps (the survivor's and the rank-1 slot's CPU minus the
    window's steps times their baseline CPU per step: rendezvous, state copy, a set-up finished after the
    take), the next standby's (outside the idle class / in it), the driver's and Ray's
    daemons' beyond their baseline rate. Printed as a table with the medians."""
    rows = []
    for k in result["kills"][:-1]:
        br, tl = k["by_role"], k["timeline"]
        zero = [0.0, 0.0, 0.0]
        surv, slot1 = br.get("survivor", zero), br.get("rank-1 slot (killed + replacement)", zero)
        per_step = (surv[2] + slot1[2]) / max(1e-9, k["baseline_steps"])
        nxt, drv, dmn = br.get("next standby", zero), br.get("driver", zero), br.get("ray daemons", zero)
        gens = [e for e in tl if e["event"] == "generation_started"]
        rec = next((e for e in gens if e.get("reason") == "recover"), {})
        grow = next((e for e in gens if e.get("reason") == "grow"), None)
        started = next((e for e in tl if e["event"] == "worker_started"), {})
        at_1 = 0 if rec.get("world_size") == 2 else (grow["step"] - rec["step"] if grow and rec else None)
        rows.append({"kill": k["kill"], "recover_world": rec.get("world_size"), "steps_at_world_1": at_1,
                     "setup_s": started.get("setup_s"),
                     "training_beyond_steps": surv[0] + slot1[0] - k["steps"] * per_step,
                     "standby_training_prio": nxt[0] - nxt[1], "standby_idle": nxt[1],
                     "driver": drv[0] - drv[2], "daemons": dmn[0] - dmn[2]})
    keys = list(rows[0]) if rows else []
    print("\n" + " | ".join(keys))
    for r in rows:
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()))
    for key in keys[4:]:
        vals = [r[key] for r in rows]
        print(f"  median {key}: {statistics.median(vals):.2f} (range {min(vals):.2f} .. {max(vals):.2f})")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--chaos-s", type=float, default=100.0)
    p.add_argument("--step-s", type=float, default=0.1, help="steps = chaos-s / step-s (recovery.py's default)")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="drill-cost-"))
    out.mkdir(parents=True, exist_ok=True)

    import ray

    from elastictrain.local_ray import init_local_ray

    init_local_ray(4, logging_level=logging.WARNING, log_to_driver=args.verbose)
    try:
        sampler = Sampler(_daemons())
        time.sleep(5.0)  # recovery.py's fresh_ray: the pre-started workers import before the run
        n_steps = round(args.chaos_s / args.step_s)
        plan = recovery.Plan(ckpt_every=args.ckpt_every, chaos_ckpt_every=args.ckpt_every)
        name = f"chaos-spares{args.spares}"
        kills: list[float] = []
        config = recovery.job_config(plan, n_steps, spares=args.spares, ckpt_dir=out / name / "ckpt")
        load0 = os.getloadavg()
        events = _run(config, out / name, lambda tail: recovery._chaos_killer(tail, args.interval, kills))
        sampler.stop()
        print(f"{n_steps} steps, {len(kills)} kills; load average {load0} -> {os.getloadavg()}")
        result = report(events, kills, sampler, args.baseline_s)
        result["load"] = [load0, os.getloadavg()]
        result["summary"] = summary(result)
        (out / "drill_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"\n{out / 'drill_cost.json'}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
