"""Ray's start of one standby process, by stage and by scheduling priority (issue 40 item 10).

Run: ``python benchmarks/standby_start.py [--rounds 2] [--spinners 0]`` from the repository root.

A private local Ray (``init_local_ray``: the worker package preloaded, as in a run), then per round two
standby-like actors one after the other, each started the way the group starts a standby ahead
(``runtime_env`` env vars ``ELASTICTRAIN_STANDBY_PROCESS=ahead`` and a priorities file): one without and one
with the driver's :class:`~elastictrain.controller.standby_start.StartWatch`. The new raylet child is sampled
every 10 ms from ``/proc`` until its preload has lowered it (or 120 s): each interval's CPU goes to the
process's stage and to its main thread's class and nice value at the interval's end:

- ``setup_worker``: Ray's ``setup_worker.py`` (an interpreter importing most of ``ray``);
- ``default_worker``: the exec'd interpreter, ``import ray``, the connect, until the CoreWorker applies Ray's
  ``worker_niceness`` to the main thread (its nice value changes);
- ``connected``: from there to the preload's lowering (``import_priority.lower_if_standby``: nice 19).

``--spinners N`` starts N CPU-bound processes at nice 15 (the training processes' nice under Ray's default)
for the duration, so that the idle class has something to yield to; their CPU seconds are printed.
CPU seconds are load-independent; the wall-clock columns are the machine's.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proc_cpu import TICK, _fields  # noqa: E402


def _spin() -> None:
    os.nice(15)
    while True:
        pass


def _sample(pid: int) -> tuple[str, float, int, int, int] | None:
    """(stage name from the command line, CPU-s of the process, main thread's policy and nice, threads)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        f = _fields(Path(f"/proc/{pid}/stat").read_text())
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    stage = "setup_worker" if b"setup_worker" in cmd else "default_worker"
    return stage, (int(f[11]) + int(f[12])) / TICK, int(f[38]), int(f[16]), threads


def one_start(raylet: int, folder: str, watch: bool) -> dict:
    import ray

    from elastictrain.controller.standby_start import StartWatch
    from elastictrain.worker.import_priority import PRIORITIES_ENV, STANDBY_ENV

    @ray.remote(num_cpus=0)
    class Standby:
        def pid(self) -> int:
            return os.getpid()

    path = os.path.join(folder, f"{uuid.uuid4().hex}.json")
    before = set(_children(raylet))
    t0 = time.time()
    actor = Standby.options(runtime_env={"env_vars": {STANDBY_ENV: "ahead", PRIORITIES_ENV: path}}).remote()
    w = StartWatch(raylet, path, path, bound_s=20.0) if watch else None
    pid, rows = None, []
    while time.time() - t0 < 120:
        if pid is None:
            new = sorted(set(_children(raylet)) - before)
            pid = new[0] if new else None
        if pid is not None:
            s = _sample(pid)
            if s is not None:
                rows.append((time.time() - t0, *s))
                if s[3] == 19:  # the preload lowered it: Ray's start is over
                    break
        time.sleep(0.01)
    by: dict[tuple[str, str], float] = defaultdict(float)
    first_nice = rows[0][4] if rows else 0
    connected_at = None
    for (t_a, _, c_a, *_), (t_b, stage, c_b, pol, nice, _) in zip(rows, rows[1:]):
        if stage == "default_worker" and nice != first_nice and connected_at is None:
            connected_at = t_b
        name = "connected" if connected_at is not None else stage
        by[(name, f"{'SCHED_IDLE' if pol == 5 else 'SCHED_OTHER'} nice {nice}")] += c_b - c_a
    ray.kill(actor)
    if w is not None:
        w.close()
    out = {"watch": watch, "found_s": round(rows[0][0], 3) if rows else None,
           "cpu_s_when_first_seen": rows[0][2] if rows else None,
           "connected_s": round(connected_at, 3) if connected_at else None,
           "preload_lowered_s": round(rows[-1][0], 3) if rows else None, "cpu_s_total": rows[-1][2] if rows else None,
           "by_stage_and_class": {f"{k[0]} @ {k[1]}": round(v, 3) for k, v in sorted(by.items())},
           "watch_record": dict(w.record) if w else None}
    return out


def _children(pid: int) -> list[int]:
    from elastictrain.controller.standby_start import children

    return sorted(children(pid))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spinners", type=int, default=0)
    args = p.parse_args(argv)
    import ray

    from elastictrain.local_ray import init_local_ray

    init_local_ray(2, logging_level=logging.WARNING, log_to_driver=False)
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.spinners)]
    folder = tempfile.mkdtemp(prefix="standby-start-")
    results = []
    try:
        raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
        time.sleep(5.0)  # Ray's pre-started idle workers import before the measurement
        for s in spinners:
            s.start()
        load0 = os.getloadavg()
        for r in range(args.rounds):
            for watch in (False, True):
                res = one_start(raylet, folder, watch)
                res["round"] = r + 1
                results.append(res)
                print(json.dumps(res))
        print(f"load average {load0} -> {os.getloadavg()}")
    finally:
        for s in spinners:
            s.kill()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
