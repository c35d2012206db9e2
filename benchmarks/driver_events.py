"""The driver's CPU per step event, by listener: what the controller spends on each ``step`` record it takes.

Run: ``python benchmarks/driver_events.py [--events N] [--rounds R]``

Emits ``N`` step events (30 ms apart on the records' own clock; the process is not slowed down) through an
:class:`~elastictrain.events.EventLog` in a temporary directory with, in turn: no listener, the metrics
listener (:class:`~elastictrain.metrics.RunMetrics`, on a private local Ray so that it sets real Ray
metrics) as it is, the metrics listener setting Ray's metrics at every step (``EXPORT_EVERY_S = 0``, as
before docs/perf/2026-11-28-idle-ray.md), and the TensorBoard listener. CPU time of this process
(``time.process_time``: every thread, the TensorBoard writer's included), per event, median of the rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _record(step: int, total: int) -> dict[str, Any]:
    return {"step": step, "loss": 5.0 - step / 1e4, "world_size": 2, "accum": 2, "samples_per_s": 1000.0 + step,
            "step_s": 0.03, "eta_s": 9.0, "total_steps": total, "final": False, "finished_at": 1e9 + step * 0.03,
            "tokens_per_s": 3.2e4, "memory": {"host_mib": 512.0 + step % 7}}


def _run(setup: Callable[[Any, Path], Any], n: int) -> float:
    """CPU seconds per step event with the listener ``setup(log, run_dir)`` adds (it returns a closer)."""
    from elastictrain.events import EventLog

    with tempfile.TemporaryDirectory(prefix="et-events-") as tmp:
        log = EventLog(Path(tmp), console=None)
        closer = setup(log, Path(tmp))
        log.emit("run_started", workers_max=2)
        t0 = time.process_time()
        for step in range(1, n + 1):
            log.emit("step", **_record(step, n + 1))
        if closer is not None:
            closer.close()  # (the TensorBoard writer's thread finishes its records: counted)
        spent = time.process_time() - t0
        log.close()
    return spent / n


def main() -> int:
    p = argparse.ArgumentParser(description="the driver's CPU per step event, by listener")
    p.add_argument("--events", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import ray

    import elastictrain.metrics as metrics
    from elastictrain.local_ray import init_local_ray
    from elastictrain.trainer import _tensorboard

    def with_metrics(every: float) -> Callable[[Any, Path], Any]:
        def setup(log: Any, _: Path) -> None:
            metrics.EXPORT_EVERY_S = every  # read at each call: restored below
            log.listeners.append(metrics.RunMetrics("bench"))
        return setup

    init_local_ray(1, log_to_driver=False, logging_level=logging.WARNING)
    throttle = metrics.EXPORT_EVERY_S
    cases = {"no listener": lambda log, _: None, f"metrics (set every {throttle:g} s)": with_metrics(throttle),
             "metrics (set every step)": with_metrics(0.0), "tensorboard": lambda log, d: _tensorboard(d, log)}
    rows: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(a.rounds):
            for name, setup in cases.items():
                rows[name].append(_run(setup, a.events))
                metrics.EXPORT_EVERY_S = throttle
    finally:
        ray.shutdown()
    for name, got in rows.items():
        print(f"{name:<28} {statistics.median(got) * 1e6:7.1f} us CPU per step event   rounds: "
              + ", ".join(f"{g * 1e6:.1f}" for g in got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
