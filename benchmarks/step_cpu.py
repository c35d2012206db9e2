"""CPU seconds per training step: elastictrain DDP's processes against plain torchrun DDP's, same job.

Run: ``python benchmarks/step_cpu.py [--steps N] [--warmup W] [--dropout D] [--rounds R]
[--side both|elastictrain|plain] [--profile-driver K]``

Wall-clock throughput means nothing on a shared machine; CPU time does not depend on who else runs. Both
sides train ``benchmarks/throughput.py``'s job (tiny GPT, 2 CPU workers, one intra-op thread each, no
checkpoints). A sampler thread reads ``/proc/PID/task/TID/stat`` (utime + stime and the name of every
thread) of the processes below every 0.2 s, stamped with ``time.time()``. Each side's step times are rank
0's clock after the optimizer step (elastictrain: the ``step`` events' ``finished_at``; plain: the script's
own), so the CPU each thread spent between steps ``W`` and ``N`` is read off the samples, interpolated at
those two instants, and divided by ``N - W``.

elastictrain's side: its two workers, every other process Ray runs for the run (the standby process, idle
pooled workers), the driver process (the controller: polls, events, listeners) and this private Ray's
daemons (raylet, GCS, log monitor, dashboard agent). The plain side: torchrun's agent and its two ranks,
beside the same Ray, idle (as in ``throughput.py``'s plain rounds), whose daemons and this script are
counted too. The sampler's own thread (in the driver) is shown apart and left out of the totals.

Threads are keyed by id and labelled with every name they had in the window (``a|b``: Ray renames an
actor's threads after the task they run: ``ray::Worker.run`` is a worker's step loop). ``--profile-driver
K`` also runs the driver's ``fit`` under ``cProfile`` on the main thread's CPU clock, prints its top ``K``
functions and leaves the whole profile in a temporary ``.pstats`` file (its path is printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proc_cpu import parents, thread_stats  # noqa: E402
from throughput import MODEL, OPTIM, PLAIN_SCRIPT, RESULT_PREFIX, SEED, WORLD, _job  # noqa: E402

def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (its name now, CPU seconds)} of a live process; {} once it is gone."""
    return {tid: (name, cpu) for tid, (name, cpu, _) in thread_stats(pid).items()}


class Sampler:
    """Samples the CPU of the processes ``pids()`` names (called each tick: the set may grow) until stopped."""

    def __init__(self, pids, period: float = 0.2) -> None:
        self._pids, self._period = pids, period
        self.samples: dict[int, list[tuple[float, dict[str, float]]]] = defaultdict(list)
        self.labels: dict[int, str] = {}
        self.own_tid = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.own_tid = threading.get_native_id()  # this thread's CPU is the benchmark's, not the driver's
        while not self._stop.is_set():
            for pid, label in self._pids().items():
                self.labels[pid] = label
                cpu = _thread_cpu(pid)
                if cpu:
                    self.samples[pid].append((time.time(), cpu))
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, pid: int, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per thread between ``t0`` and ``t1`` (interpolated between samples), each thread
        labelled with the names it had over the window (``a|b``: renamed, as Ray's task threads are)."""
        series = self.samples[pid]
        if not series or series[0][0] > t0 or series[-1][0] < t1:
            raise RuntimeError(f"pid {pid} ({self.labels.get(pid)}) was not sampled over the whole window")
        out: dict[str, float] = defaultdict(float)
        for tid in {t for _, cpu in series for t in cpu}:
            names = ["cpu-sampler (this benchmark)"] if tid == self.own_tid else []
            for ts, cpu in series:
                if t0 <= ts <= t1 and tid in cpu and cpu[tid][0] not in names:
                    names.append(cpu[tid][0])
            out["|".join(names) or "?"] += _at(series, t1, tid) - _at(series, t0, tid)
        return dict(out)


def _at(series: list[tuple[float, dict[int, tuple[str, float]]]], t: float, tid: int) -> float:
    for (ta, a), (tb, b) in zip(series, series[1:]):
        if ta <= t <= tb:
            va = a[tid][1] if tid in a else 0.0
            vb = b[tid][1] if tid in b else va  # (a thread that ended keeps its figure)
            return va + (vb - va) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
    raise RuntimeError("time outside the sampled series")


_scanned: dict[int, tuple[float, list[int]]] = {}


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (a scan of /proc, at most once a second per parent: it costs the sampler)."""
    last = _scanned.get(pid)
    if last is not None and time.time() - last[0] < 1.0:
        return last[1]
    out = [child for child, parent in parents().items() if parent == pid]
    _scanned[pid] = (time.time(), out)
    return out


TRAINING = ("worker rank", "rank process")  # the labels of the two training processes of each side


def _report(title: str, sampler: Sampler, t0: float, t1: float, steps: int) -> tuple[float, float]:
    """Print the table; return (every process, the training processes) in CPU-s per step."""
    print(f"\n## {title}: CPU-s per step over {steps} steps")
    total = training = 0.0
    for pid in sorted(sampler.samples):
        try:
            per = sampler.between(pid, t0, t1)
        except RuntimeError as e:
            print(f"  {sampler.labels[pid]} (pid {pid}): {e}")
            continue
        s = sum(v for name, v in per.items() if not name.startswith("cpu-sampler")) / steps
        total += s
        training += s if sampler.labels[pid].startswith(TRAINING) else 0.0
        print(f"  {sampler.labels[pid]:<24} pid {pid:<8} {s * 1e3:8.2f} ms/step")
        for name, v in sorted(per.items(), key=lambda kv: -kv[1]):
            if v / steps >= 5e-5:
                print(f"      {name:<20} {v / steps * 1e3:8.2f} ms/step")
    print(f"  total (the sampler's own thread left out) {total * 1e3:8.2f} ms/step")
    return total, training


def _ray_daemons() -> dict[int, str]:
    """This script's own private Ray's daemons (no one else's): {pid: label}."""
    import ray

    node = ray._private.worker._global_node
    return {info.process.pid: f"ray {kind}" for kind, infos in node.all_processes.items() for info in infos
            if info.process is not None}


def run_elastictrain(steps: int, warmup: int, global_batch: int, micro_batch: int, dropout: float,
                     profile_top: int = 0) -> tuple[float, float]:
    import ray

    from elastictrain import Trainer, build_config

    config = build_config(_job(steps, global_batch, micro_batch, dropout), source="benchmarks/step_cpu.py")
    daemons = _ray_daemons()
    with tempfile.TemporaryDirectory(prefix="et-cpu-") as tmp:
        events_path = Path(tmp) / "events.jsonl"

        def pids() -> dict[int, str]:
            out = {os.getpid(): "driver (controller)", **daemons}
            for raylet in [p for p, label in daemons.items() if label == "ray raylet"]:
                for c in _children(raylet):  # Ray's worker processes: the workers, the standby, idle ones
                    out.setdefault(c, "ray worker process")
            if events_path.exists():
                for line in events_path.read_text().splitlines():
                    if '"worker_started"' in line:
                        e = json.loads(line)
                        out[e["pid"]] = f"worker rank {e['rank']}"
            return out

        sampler = Sampler(pids)
        trainer = Trainer(config, run_dir=tmp, console=None)
        if profile_top:  # the driver's main thread (the controller's loop), on its own CPU clock
            import cProfile
            import pstats

            prof = cProfile.Profile(time.thread_time)
            result = prof.runcall(trainer.fit)
            fd, dump = tempfile.mkstemp(prefix="et-driver-", suffix=".pstats")
            os.close(fd)
            prof.dump_stats(dump)
            print(f"driver profile: {dump} (pstats)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile_top)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(profile_top)
        else:
            result = trainer.fit()
        sampler.stop()
        events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    if not result.ok:
        raise RuntimeError(f"elastictrain run failed (exit {result.exit_code})")
    times = {e["step"]: e["finished_at"] for e in events if e["event"] == "step"}
    return _report("elastictrain", sampler, times[warmup], times[steps], steps - warmup)


def run_plain(steps: int, warmup: int, global_batch: int, micro_batch: int, dropout: float) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--standalone",
           str(PLAIN_SCRIPT), "--steps", str(steps), "--global-batch", str(global_batch),
           "--micro-batch", str(micro_batch), "--seed", str(SEED)]
    for key, value in {**MODEL, "dropout": dropout}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key, value in OPTIM.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))

    daemons = _ray_daemons()  # up but idle, as in benchmarks/throughput.py's plain rounds

    def pids() -> dict[int, str]:
        return {os.getpid(): "this script", **daemons, proc.pid: "torchrun agent",
                **{c: "rank process" for c in _children(proc.pid)}}

    sampler = Sampler(pids)
    out, err = proc.communicate(timeout=1200)
    sampler.stop()
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        raise RuntimeError(f"plain DDP failed: {(out + err)[-2000:]}")
    times = json.loads(lines[-1][len(RESULT_PREFIX):])["times"]
    return _report("plain DDP (torchrun)", sampler, times[warmup - 1], times[steps - 1], steps - warmup)


def step_parser(description: str, warmup: int) -> argparse.ArgumentParser:
    """The arguments of throughput.py's tiny job (``_job``) that this benchmark and step_profile.py share."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    return p


def main() -> int:
    p = step_parser("CPU seconds per step: elastictrain DDP vs plain torchrun DDP", warmup=40)
    p.add_argument("--profile-driver", type=int, default=0, metavar="K",
                   help="cProfile the driver's main thread (thread CPU clock) and print its top K functions")
    p.add_argument("--side", choices=("both", "elastictrain", "plain"), default="both")
    p.add_argument("--rounds", type=int, default=1, help="rounds, alternating the sides; medians at the end")
    a = p.parse_args()
    import ray

    from elastictrain.local_ray import init_local_ray

    os.environ["RAY_worker_niceness"] = "0"
    init_local_ray(WORLD, logging_level=logging.WARNING, log_to_driver=False)  # the Ray `elastictrain run` starts
    rows: dict[str, list[tuple[float, float]]] = {"elastictrain": [], "plain": []}
    try:
        for _ in range(a.rounds):
            if a.side in ("both", "elastictrain"):
                rows["elastictrain"].append(run_elastictrain(a.steps, a.warmup, a.global_batch, a.micro_batch,
                                                             a.dropout, a.profile_driver))
            if a.side in ("both", "plain"):
                rows["plain"].append(run_plain(a.steps, a.warmup, a.global_batch, a.micro_batch, a.dropout))
    finally:
        ray.shutdown()
    print("\n## medians over the rounds, CPU-ms per step: all processes / the two training processes")
    for side, got in rows.items():
        if got:
            print(f"  {side:<13} {statistics.median(t for t, _ in got) * 1e3:7.2f} / "
                  f"{statistics.median(w for _, w in got) * 1e3:7.2f}   rounds: "
                  + ", ".join(f"{t * 1e3:.2f}/{w * 1e3:.2f}" for t, w in got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
