"""What the standby process costs the training processes beside it, in load-robust figures.

Run: ``python benchmarks/standby.py [--steps N] [--warmup W] [--rounds R] [--ray-nice 0|15]``

The job of ``benchmarks/throughput.py`` (tiny GPT, 2 CPU workers, no checkpoints) runs with
``workers.standby`` off and on, alternating, on one local Ray. A sampler in this process reads ``/proc``
every 0.2 s: each training process's CPU seconds (``/proc/PID/stat`` utime + stime) and run-queue delay
(``/proc/PID/schedstat`` field 2: time spent runnable but not running), and every standby process's CPU
seconds and scheduling class (a child of this Ray's raylet whose environment names it a standby). Over the
steps ``W..N`` (the throughput benchmark's window) it reports, per run:

- ``delay_ms/step``: the training processes' run-queue delay per step (summed over both): what another
  process on their cores took from them, whoever it was;
- ``train_cpu_ms/step``: their CPU per step;
- ``standby_cpu_s_window`` / ``_run``: the standby's CPU seconds over the window and over the whole run (all
  of it before a take: nothing is killed here); ``standby_idle_share``: the share of the window's samples
  that saw it in ``SCHED_IDLE``; ``standby_cpu_s_before_low``: its CPU seconds when first seen in the idle
  class (an upper bound on Ray's start of the process, which runs at the training priority).

Wall-clock rates on a shared machine say little; these say where the CPU went. ``--ray-nice`` sets
``RAY_worker_niceness`` (0: the throughput benchmark's setting; 15: Ray's default, the recovery drill's).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import _job  # noqa: E402 - the same job as the throughput benchmark

STANDBY_MARK = b"ELASTICTRAIN_STANDBY_PROCESS="  # =start (the first) or =ahead (later ones)


def _stat(pid: int) -> tuple[float, float, int] | None:
    """(CPU seconds, run-queue delay seconds, scheduling policy) of process ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/schedstat") as f:
            delay_ns = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, delay_ns / 1e9, int(fields[38])


def _standbys(raylet: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != raylet:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if any(v.startswith(STANDBY_MARK) for v in f.read().split(b"\0")):
                    out.append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return out


class Sampler:
    """Samples (time, last step, {pid: stat}) for the training pids (from events.jsonl) and the standbys."""

    def __init__(self, run_dir: Path, raylet: int) -> None:
        self.run_dir, self.raylet = run_dir, raylet
        self.samples: list[tuple[float, int, dict[int, Any], dict[int, Any]]] = []
        self.train: set[int] = set()
        self.step, self._pos, self._stop = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _read_events(self) -> None:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind("\n") + 1
        self._pos += len(data[:end].encode())
        for line in data[:end].splitlines():
            e = json.loads(line)
            if e["event"] == "worker_started":
                self.train.add(e["pid"])
            elif e["event"] == "step":
                self.step = max(self.step, e["step"])

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._read_events()
            train = {p: s for p in self.train if (s := _stat(p))}
            stand = {p: s for p in _standbys(self.raylet) if (s := _stat(p))}
            self.samples.append((time.time(), self.step, train, stand))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def figures(samples: list, warmup: int) -> dict[str, float]:
    """The window's figures from the first sample at step >= ``warmup`` to the last sample before the end."""
    window = [s for s in samples if s[1] >= warmup and s[2]]
    if len(window) < 2:
        raise RuntimeError("too few samples in the window: raise --steps")
    (_, s0, t0, _), (_, s1, t1, _) = window[0], window[-1]
    steps = max(1, s1 - s0)
    pids = set(t0) & set(t1)
    delay = sum(t1[p][1] - t0[p][1] for p in pids)
    cpu = sum(t1[p][0] - t0[p][0] for p in pids)
    sb_first: dict[int, float] = {}
    sb_window: dict[int, float] = {}
    idle = total = 0
    for _, step, _, stand in samples:
        for pid, (c, _, policy) in stand.items():
            sb_first.setdefault(pid, c)
            if step >= s0 and step <= s1:
                sb_window.setdefault(pid, c)
                total += 1
                idle += policy == 5  # SCHED_IDLE
    last = {pid: c for _, _, _, stand in samples for pid, (c, _, _) in stand.items()}
    # CPU seconds before it lowered itself (Ray's start of the process, at the training priority): the first
    # sample that sees it in the idle class bounds it from above
    before_low = {}
    for _, _, _, stand in samples:
        for pid, (c, _, policy) in stand.items():
            if policy == 5:
                before_low.setdefault(pid, c)
    return {
        "steps": steps, "delay_ms/step": 1000 * delay / steps, "train_cpu_ms/step": 1000 * cpu / steps,
        "standby_cpu_s_window": sum(last[p] - sb_window[p] for p in sb_window),
        "standby_cpu_s_run": sum(last.values()), "standby_idle_share": idle / total if total else 0.0,
        "standby_cpu_s_before_low": sum(before_low.values()),
    }


def run_once(steps: int, warmup: int, standby: bool, raylet: int) -> dict[str, float]:
    from elastictrain import Trainer, build_config

    spec = _job(steps, 32, 8, 0.1)
    spec["workers"]["standby"] = standby
    config = build_config(spec, source="benchmarks/standby.py")
    with tempfile.TemporaryDirectory(prefix="et-standby-") as tmp:
        sampler = Sampler(Path(tmp), raylet)
        t0 = time.time()
        try:
            result = Trainer(config, run_dir=tmp, console=None).fit()
        finally:
            sampler.stop()
        wall = time.time() - t0
    if not result.ok:
        raise RuntimeError(f"run failed (exit {result.exit_code}): {result.summary.get('error')}")
    return {**figures(sampler.samples, warmup), "wall_s": wall, "load": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ray-nice", type=int, default=0, help="RAY_worker_niceness of the training processes")
    a = p.parse_args()
    import ray

    os.environ["RAY_worker_niceness"] = str(a.ray_nice)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for i in range(a.rounds):
            for standby in (False, True):
                f = run_once(a.steps, a.warmup, standby, raylet)
                rows[standby].append(f)
                print(f"round {i + 1} standby={standby}: " + " ".join(f"{k}={v:.3g}" for k, v in f.items()),
                      flush=True)
    finally:
        ray.shutdown()
    for standby, fs in rows.items():
        med = {k: statistics.median(f[k] for f in fs) for k in fs[0]}
        print(f"median standby={standby}: " + " ".join(f"{k}={v:.3g}" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
