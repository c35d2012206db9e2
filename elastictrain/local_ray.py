"""The private local Ray that ``elastictrain run`` (and ``Trainer.fit`` with no Ray address) starts on this
machine: its system config, the environment its daemons start with, and the one call that starts it.

Ray is tuned here only where this library starts Ray itself: a Ray it is pointed at (``--ray-address``,
``RAY_ADDRESS``, a cluster) keeps its operator's settings. What an idle local Ray costs per daemon, and
what each setting below saves, is in docs/perf/2026-11-28-idle-ray.md (``benchmarks/idle_ray.py``): on a
small machine that CPU is taken from the training processes, which run in lockstep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# What a Ray worker process imports before it takes work (Ray's ``preload_python_modules``): the worker
# actor's module, i.e. torch, DTensor and FSDP, most of a worker's start (docs/perf/2026-11-23-code-figures.md).
# Ray pre-starts idle worker processes (as many as the node's CPUs, for its first driver), and an actor
# placed on one of them then starts in well under a second. Ray 2.60 does not start new idle workers to
# replace used ones, so this speeds up the workers that find a pre-started process (the first ones), not
# every replacement.
WORKER_PRELOAD_MODULES = ("elastictrain.worker.actor",)


def local_ray_system_config() -> dict[str, Any]:
    """Ray system config of the private local Ray (the k8s manifests set the preload through
    ``RAY_preload_python_modules``).

    ``enable_worker_prestart`` off: Ray then pre-starts its idle processes when the first driver connects
    (as many as the node's CPUs, the same ones as with it on) but starts no extra ones when requests for
    workers queue up. On a small machine those extra ones were waste: each imports the preload (seconds of
    CPU beside the training processes) and most are killed unused a second later as over Ray's idle limit
    (tests/test_controller_paths.py: 11 processes that never ran anything with it on, 5 with it off).

    The rest (Ray's defaults first) cut the raylet's idle CPU (timers that run whether or not anything happens) and touch nothing
    elastictrain relies on: actor and worker death notices, node health checks (``health_check_*``),
    placement groups, the object store and its transfers (``object_manager_timer_freq_ms``), the memory
    monitor (``memory_monitor_refresh_ms``), metrics export: all left as Ray sets them.

    * ``raylet_check_gc_period_milliseconds`` 100 -> 1000: the check whether the object store's pressure
      asks for a global Python GC.
    * ``kill_idle_workers_interval_ms`` 200 -> 1000: idle worker processes over Ray's soft limit are ended
      up to a second later.
    * ``local_fs_monitor_interval_ms`` 100 -> 1000: the local disk's usage check (past 95% full Ray refuses
      new objects), a second behind at most.
    * ``debug_dump_period_milliseconds`` 0: no ``debug_state.txt`` dump every 10 s.
    * ``event_stats`` off: no per-handler statistics of Ray's event loops (every process: Ray's own
      debugging figures, unused here)."""
    return {"preload_python_modules": list(WORKER_PRELOAD_MODULES), "enable_worker_prestart": False,
            "raylet_check_gc_period_milliseconds": 1000, "kill_idle_workers_interval_ms": 1000,
            "local_fs_monitor_interval_ms": 1000, "debug_dump_period_milliseconds": 0, "event_stats": False}


def local_ray_env() -> dict[str, str]:
    """Environment of the private local Ray's daemons (Ray's Python daemons read these from their
    environment only). Each one cuts CPU an idle Ray spends beside the training processes and keeps what
    elastictrain relies on (actor death notices, node health checks, placement groups, the object store,
    the metrics agent, worker output on the driver's console):

    * ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0`` and ``LOG_NAME_UPDATE_INTERVAL_S=1``: the log monitor
      looks for new log files once a second instead of every 0.1 s (a glob of the log directory each time);
      lines of files it knows are still forwarded within 0.1 s, and a new file is read from its start.
    * ``REPORTER_UPDATE_INTERVAL_MS=60000``: the dashboard agent's node report (psutil figures of every
      Ray process, for the dashboard and Ray's node metrics, which elastictrain does not use) once a
      minute instead of every 5 s. Metrics set through ``ray.util.metrics`` are exported as before.
    """
    return {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "1",
            "REPORTER_UPDATE_INTERVAL_MS": "60000"}


@contextmanager
def local_ray_environ() -> Iterator[None]:
    """Within the block, :func:`local_ray_env` is in ``os.environ`` (a variable the user set keeps the
    user's value); after it, the environment is as before. Ray's daemons and worker processes started in
    the block inherit it; the calling process is left as it was."""
    saved = {key: os.environ.get(key) for key in local_ray_env()}
    for key, value in local_ray_env().items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_local_ray(num_cpus: int, **kwargs: Any) -> Any:
    """Start the private local Ray: ``ray.init(address="local", include_dashboard=False, ...)`` with
    :func:`local_ray_system_config` and, for its daemons, :func:`local_ray_env`. ``kwargs`` go to
    ``ray.init`` (e.g. ``log_to_driver``, ``logging_level``). Returns what ``ray.init`` returns."""
    import ray

    with local_ray_environ():
        return ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                        _system_config=local_ray_system_config(), **kwargs)


__all__ = ["WORKER_PRELOAD_MODULES", "init_local_ray", "local_ray_env", "local_ray_environ",
           "local_ray_system_config"]
