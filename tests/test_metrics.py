"""Metrics through ray.util.metrics: the pure fold of events, and a scrape of a real local Ray's metrics
endpoint after a real run with a failure, a recovery and committed checkpoints."""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from elastictrain.metrics import COUNTERS, GAUGES, MetricsState
from tests.conftest import job, run_job


def test_state_folds_events() -> None:
    s = MetricsState()
    s.observe({"event": "run_started", "time": 100.0, "workers_max": 2}, now=100.0)
    s.observe({"event": "step", "time": 101.0, "step": 1, "step_s": 1.0, "samples_per_s": 16.0,
               "world_size": 2, "loss": 3.0}, now=101.0)
    s.observe({"event": "step", "time": 103.0, "step": 2, "step_s": 2.0, "samples_per_s": 8.0,
               "world_size": 1, "loss": 2.0}, now=104.0)
    s.observe({"event": "failure", "time": 104.0, "kind": "hang"}, now=104.0)
    s.observe({"event": "recovered", "time": 105.0, "downtime_s": 4.5}, now=105.0)
    s.observe({"event": "checkpoint_saved", "time": 105.0, "bytes": 1000, "write_s": 0.5, "stall_s": 0.25},
              now=105.0)
    g = s.gauges
    assert (g["elastictrain_step"], g["elastictrain_loss"], g["elastictrain_world_size"]) == (2.0, 2.0, 1.0)
    assert g["elastictrain_checkpoint_write_bytes_per_second"] == 2000.0
    assert g["elastictrain_checkpoint_stall_seconds"] == 0.25
    assert g["elastictrain_recovery_downtime_seconds"] == 4.5
    # productive: 1.0 s at full size + 2.0 s * 1/2 at half size = 2.0 s of 5 s wall
    assert g["elastictrain_goodput_ratio"] == pytest.approx(0.4)
    assert ("elastictrain_failures_total", 1.0, {"kind": "hang"}) in s.pending


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_metrics_endpoint_of_a_real_ray_has_them(ray_local, tmp_path: Path) -> None:
    import ray

    run_id = f"metrics-{uuid.uuid4().hex[:8]}"
    spec = job(name="metrics", run_id=run_id, train={"steps": 6},
               checkpoint={"uri": str(tmp_path / "ckpt"), "every_steps": 2},
               faults=[{"rank": 1, "step": 3, "kind": "raise", "point": "mid_step"},
                       {"rank": 0, "step": 5, "kind": "nan", "generation": None}])  # a skipped step, counted
    run = run_job(tmp_path, spec)
    assert run.result.ok and run.summary["failures"] >= 1, run.summary
    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    # every metric but the GPU-only ones and the eval loss (set only by train.eval_every, which needs a
    # validation split)
    wanted = {f"ray_{n}" for n in (*GAUGES, *COUNTERS) if "device_memory" not in n} - {"ray_elastictrain_eval_loss"}

    def seen(text: str) -> tuple[set[str], list[str], bool]:
        """The wanted metrics of this run, its step gauge's lines, whether its exception failure is counted."""
        lines = [ln for ln in text.splitlines() if f'run_id="{run_id}"' in ln]
        step = [ln for ln in lines if ln.startswith("ray_elastictrain_step{")]
        failed = any('kind="exception"' in ln for ln in lines if ln.startswith("ray_elastictrain_failures_total"))
        return {ln.split("{", 1)[0] for ln in lines} & wanted, step, failed

    def at_the_end() -> bool:
        return found == wanted and bool(step) and float(step[0].rsplit(" ", 1)[1]) == 6.0 and failed

    # Ray's agent exports every ~10 s (a loaded machine: later): wait, bounded, until an export holds the run's
    # end -- every metric, and the step gauge at the last step (an earlier export may hold an earlier one)
    found, step, failed = set(), [], False
    deadline = time.time() + 120
    while True:
        try:
            found, step, failed = seen(_scrape(url))
        except OSError:  # the agent did not answer within the scrape's 10 s (a loaded machine): ask again
            pass
        if at_the_end() or time.time() > deadline:
            break
        time.sleep(2)
    assert found == wanted, f"missing from {url}: {sorted(wanted - found)}"
    assert step and float(step[0].rsplit(" ", 1)[1]) == 6.0, step
    assert failed, f"no exception failure counted for {run_id} at {url}"
