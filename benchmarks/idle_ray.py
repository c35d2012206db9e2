"""CPU seconds per minute of an idle local Ray, per daemon: the CPU Ray takes beside a training step.

Run: ``python benchmarks/idle_ray.py [--variants base,tuned,...] [--actors 0,2] [--window 60] [--settle 20]
[--rounds 1]``

Each variant starts, in a fresh process, a private local Ray the way ``elastictrain run`` does
(``ray.init(address="local", include_dashboard=False, _system_config=local_ray_system_config())``), with the
variant's extra ``_system_config`` entries and ``RAY_*`` environment, optionally places N idle actors
(``num_cpus=1``, the way a worker holds its CPU), waits until start-up is over (:func:`_settle`), then reads
utime + stime of every process of that Ray (its descendants: GCS, raylet, the autoscaler monitor, the API
server, the log monitor, the dashboard and runtime-env agents, idle worker processes, the actors, and the
driver itself) from ``/proc`` at the start and the end of the window. CPU time, not wall time: figures stay
comparable on a loaded machine (within the noise of cache and core sharing). A process that starts inside
the window is counted from zero, one that ends from its last reading, and a start is named in the output.

``base`` is Ray as elastictrain started it before docs/perf/2026-11-28-idle-ray.md; ``current`` is
``local_ray_system_config()`` and ``local_ray_env()`` (elastictrain/local_ray.py) as they are now; the other
variants each change one setting, or one group of settings, over ``base`` (see VARIANTS).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from proc_cpu import parents, process_cpu

BASE_SYSTEM_CONFIG = {"preload_python_modules": ["elastictrain.worker.actor"], "enable_worker_prestart": False}

# name: (extra _system_config, extra environment); each over ``base``.
VARIANTS: dict[str, tuple[dict, dict]] = {
    "base": ({}, {}),
    "metrics_off": ({"enable_metrics_collection": False}, {}),
    "metrics_report_10s": ({"metrics_report_interval_ms": 10000}, {}),
    "task_events_off": ({"task_events_report_interval_ms": 0}, {}),
    "event_stats_off": ({"event_stats": False}, {}),
    "memory_monitor_off": ({"memory_monitor_refresh_ms": 0}, {}),
    "debug_dump_off": ({"debug_dump_period_milliseconds": 0}, {}),
    "usage_stats_off": ({}, {"RAY_USAGE_STATS_ENABLED": "0"}),
    "export_off": ({"enable_export_api_write": False}, {}),
    "ray_events_off": ({"enable_ray_event": False}, {}),
    "log_monitor_glob_1s": ({}, {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "1"}),
    "reporter_60s": ({}, {"REPORTER_UPDATE_INTERVAL_MS": "60000"}),
    "autoscaler_60s": ({}, {"AUTOSCALER_UPDATE_INTERVAL_S": "60"}),
    "resource_report_1s": ({"raylet_report_resources_period_milliseconds": 1000}, {}),
    "fs_monitor_1s": ({"local_fs_monitor_interval_ms": 1000}, {}),
    "check_gc_1s": ({"raylet_check_gc_period_milliseconds": 1000}, {}),
    "kill_idle_1s": ({"kill_idle_workers_interval_ms": 1000}, {}),
    "om_timer_1s": ({"object_manager_timer_freq_ms": 1000}, {}),
    "raylet_safe": ({"raylet_check_gc_period_milliseconds": 1000, "kill_idle_workers_interval_ms": 1000,
                     "local_fs_monitor_interval_ms": 1000, "debug_dump_period_milliseconds": 0,
                     "event_stats": False}, {}),
    "memory_monitor_1s": ({"memory_monitor_refresh_ms": 1000}, {}),
    "agent_pipe": ({}, {"RAY_enable_pipe_based_agent_to_parent_health_check": "1"}),
    "raylet_timers": ({"raylet_check_gc_period_milliseconds": 1000, "kill_idle_workers_interval_ms": 1000,
                       "object_manager_timer_freq_ms": 1000, "local_fs_monitor_interval_ms": 1000,
                       "debug_dump_period_milliseconds": 0, "event_stats": False,
                       "memory_monitor_refresh_ms": 1000}, {}),
}


def _descendants(root: int) -> dict[int, str]:
    """{pid: short command} of every process below ``root`` (one /proc scan)."""
    parent = parents()
    out, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out[child] = _label(child)
                frontier.append(child)
    return out


def _label(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in args)
    for key, name in (("gcs_server", "gcs_server"), ("raylet/raylet", "raylet"), ("log_monitor.py", "log monitor"),
                      ("autoscaler/_private/monitor.py", "autoscaler monitor"),
                      ("dashboard/dashboard.py", "api server (dashboard.py)"),
                      ("dashboard/agent.py", "dashboard agent"), ("ray::DashboardAgent", "dashboard agent"),
                      ("runtime_env/agent", "runtime env agent"), ("ray::RuntimeEnvAgent", "runtime env agent"),
                      ("ray::Idle", "actor (idle)"), ("ray::IDLE", "idle worker process"),
                      ("default_worker.py", "idle worker process")):
        if key in text:
            return name
    return text[:60]


def _settle(me: int, at_least: float, quiet_cpu_s: float = 0.3, bound: float = 180.0) -> None:
    """Start-up is not idle CPU (agents registering, idle worker processes importing the preload, which
    takes longer than any fixed wait on a loaded machine): wait ``at_least`` seconds, then until the Ray's
    processes together used less than ``quiet_cpu_s`` in 2 s (at most ``bound`` seconds)."""
    time.sleep(at_least)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        procs = [me, *_descendants(me)]
        before = sum(c for p in procs if (c := process_cpu(p)) is not None)
        time.sleep(2.0)
        if sum(c for p in procs if (c := process_cpu(p)) is not None) - before < quiet_cpu_s:
            return


def measure(variant: str, actors: int, settle: float, window: float) -> dict:
    """In this process: start the variant's Ray, wait, measure; {label: CPU-s per minute, ...}."""
    import ray

    extra_config, env = VARIANTS[variant] if variant in VARIANTS else ({}, {})
    if variant == "current":
        from elastictrain.local_ray import local_ray_env, local_ray_system_config

        config, env = local_ray_system_config(), local_ray_env()
    else:
        config = {**BASE_SYSTEM_CONFIG, **extra_config}
    os.environ.update(env)
    ray.init(address="local", num_cpus=max(2, actors), include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, _system_config=config)

    @ray.remote(num_cpus=1)
    class Idle:
        def ready(self) -> bool:
            return True

    held = [Idle.remote() for _ in range(actors)]
    ray.get([a.ready.remote() for a in held], timeout=300)
    me = os.getpid()
    _settle(me, settle)
    procs = {me: "driver (idle)", **_descendants(me)}
    first = {p: c for p in procs if (c := process_cpu(p)) is not None}
    last = dict(first)
    born: list[str] = []
    t0 = time.monotonic()
    deadline = t0 + window
    while (now := time.monotonic()) < deadline:  # a process started inside the window counts from zero
        for p, label in _descendants(me).items():
            if p not in procs:
                procs[p] = label
                first[p] = 0.0
                born.append(f"{label} (pid {p}) started in the window")
        for p in first:
            if (c := process_cpu(p)) is not None:
                last[p] = c
        time.sleep(min(1.0, max(0.0, deadline - now)))
    span = time.monotonic() - t0
    per: dict[str, float] = defaultdict(float)
    for p, c in last.items():
        per[procs[p]] += (c - first[p]) * 60.0 / span
    del held
    ray.shutdown()
    return {"variant": variant, "actors": actors, "cpu_s_per_min": dict(per), "notes": born}


def main() -> int:
    p = argparse.ArgumentParser(description="CPU-s per minute of an idle local Ray, per daemon")
    p.add_argument("--variants", default="base,current", help=f"comma-separated; known: current, {', '.join(VARIANTS)}")
    p.add_argument("--actors", default="0,2", help="comma-separated numbers of idle actors to hold")
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1, help="rounds over all variants; medians at the end")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one "variant:actors" in this process
    a = p.parse_args()
    if a.one:
        variant, actors = a.one.rsplit(":", 1)
        print("RESULT " + json.dumps(measure(variant, int(actors), a.settle, a.window)), flush=True)
        return 0
    results: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for _ in range(a.rounds):
        for actors in [int(x) for x in a.actors.split(",")]:
            for variant in a.variants.split(","):
                out = subprocess.run([sys.executable, __file__, "--one", f"{variant}:{actors}", "--window",
                                      str(a.window), "--settle", str(a.settle)], capture_output=True, text=True)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if out.returncode or not lines:
                    print(f"{variant}:{actors} failed: {(out.stdout + out.stderr)[-1500:]}")
                    continue
                r = json.loads(lines[-1][len("RESULT "):])
                results[(variant, actors)].append(r["cpu_s_per_min"])
                total = sum(r["cpu_s_per_min"].values())
                print(f"{variant:<22} actors={actors} total {total:6.2f} CPU-s/min  "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_s_per_min"].items(), key=lambda kv: -kv[1])
                                  if v >= 0.005) + ("  [" + "; ".join(r["notes"]) + "]" if r["notes"] else ""),
                      flush=True)
    print("\n## medians, CPU-s per minute (total; per process kind)")
    for (variant, actors), rows in results.items():
        keys = sorted({k for r in rows for k in r})
        med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
        print(f"{variant:<22} actors={actors} total {statistics.median(sum(r.values()) for r in rows):6.2f}  "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(med.items(), key=lambda kv: -kv[1]) if v >= 0.005))
    return 0


if __name__ == "__main__":
    sys.exit(main())
