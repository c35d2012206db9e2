"""Prometheus metrics through ``ray.util.metrics``, built from the event stream.

:class:`RunMetrics` is an :class:`~elastictrain.events.EventLog` listener: an observer that folds each event
record into a few numbers (:meth:`RunMetrics.observe`, pure bookkeeping) and, once Ray is connected, sets
them on Ray metrics, which Ray's metrics agent serves on each node's ``metrics_export_port`` (with the
``ray_`` prefix Ray adds, e.g. ``ray_elastictrain_loss``). Every metric carries the tag ``run_id``; failures
also ``kind``. A metrics problem never reaches the training run: the first error disables the export and
says so once on stderr. Ray's agent exports what is set every ``metrics_report_interval_ms`` (10 s by
default), so the values are set on Ray's metrics at most every :data:`EXPORT_EVERY_S` while steps run, and at
every other event (a failure, a save, the run's end): what an export holds is never older than that, and the
run's last values are always set. Setting them at every step was CPU the driver took from the workers' cores.

===================================================  =========  ==============================================
metric                                               type       from
===================================================  =========  ==============================================
``elastictrain_step``                                gauge      ``step.step`` (completed steps)
``elastictrain_step_time_seconds``                   gauge      ``step.step_s``
``elastictrain_samples_per_second``                  gauge      ``step.samples_per_s``
``elastictrain_loss``                                gauge      ``step.loss``
``elastictrain_eval_loss``                           gauge      ``step.eval_loss`` (train.eval_every)
``elastictrain_world_size``                          gauge      ``step.world_size`` / ``generation_started``
``elastictrain_failures_total``                      counter    ``failure`` (tag ``kind``)
``elastictrain_recovery_downtime_seconds``           gauge      ``recovered.downtime_s`` (the latest)
``elastictrain_recovery_downtime_seconds_total``     counter    sum of ``recovered.downtime_s``
``elastictrain_checkpoints_committed_total``         counter    ``checkpoint_saved``
``elastictrain_checkpoint_stall_seconds``            gauge      ``checkpoint_saved.stall_s`` (the latest)
``elastictrain_checkpoint_write_bytes_per_second``   gauge      ``checkpoint_saved.bytes / write_s``
``elastictrain_goodput_ratio``                       gauge      productive step time / wall time so far (a
                                                                redone step counted once)
``elastictrain_host_memory_peak_bytes``              gauge      ``step.memory.host_mib`` (the highest rank's)
``elastictrain_device_memory_allocated_peak_bytes``  gauge      ``step.memory.alloc_mib`` (GPUs)
``elastictrain_device_memory_reserved_peak_bytes``   gauge      ``step.memory.reserved_mib`` (GPUs)
``elastictrain_steps_skipped_total``                 counter    ``step_skipped``
===================================================  =========  ==============================================
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Seconds between two settings of Ray's metrics while only step events arrive (see module docstring).
EXPORT_EVERY_S = 1.0

GAUGES = {
    "elastictrain_step": "completed optimizer steps",
    "elastictrain_step_time_seconds": "duration of the latest optimizer step",
    "elastictrain_samples_per_second": "training throughput at the latest step",
    "elastictrain_loss": "mean loss over the global batch at the latest step",
    "elastictrain_eval_loss": "mean validation loss at the latest evaluation (train.eval_every)",
    "elastictrain_world_size": "workers in the current membership generation",
    "elastictrain_recovery_downtime_seconds": "last progress -> regrouped, of the latest recovery",
    "elastictrain_checkpoint_stall_seconds": "longest staging stall of the latest committed checkpoint",
    "elastictrain_checkpoint_write_bytes_per_second": "bytes / write time of the latest committed checkpoint",
    "elastictrain_goodput_ratio": "productive step time (full world size) / wall time so far",
    "elastictrain_host_memory_peak_bytes": "highest RSS peak of any rank since the previous step event",
    "elastictrain_device_memory_allocated_peak_bytes": "highest allocated device memory of any rank, same window",
    "elastictrain_device_memory_reserved_peak_bytes": "highest reserved device memory of any rank, same window",
}
COUNTERS = {
    "elastictrain_failures_total": "worker failures, by kind",
    "elastictrain_recovery_downtime_seconds_total": "sum of recovery downtime",
    "elastictrain_checkpoints_committed_total": "committed checkpoints",
    "elastictrain_steps_skipped_total": "steps whose update was skipped (non-finite loss or gradient norm)",
}


@dataclass
class MetricsState:
    """What the metrics say, folded from event records. ``pending`` holds counter increments not yet sent."""

    gauges: dict[str, float] = field(default_factory=dict)
    pending: list[tuple[str, float, dict[str, str]]] = field(default_factory=list)
    started_at: float | None = None
    workers_max: int = 1
    productive_s: float = 0.0
    credited: array = field(default_factory=lambda: array("d"))  # productive_s by step (NaN: none), 8 B/step

    def observe(self, r: dict[str, Any], now: float) -> None:
        name = r["event"]
        g = self.gauges
        if name == "run_started":
            self.started_at = r["time"]
            self.workers_max = max(1, int(r.get("workers_max") or 1))
        elif name == "generation_started":
            g["elastictrain_world_size"] = float(r["world_size"])
        elif name == "step":
            g.update({"elastictrain_step": float(r["step"]), "elastictrain_step_time_seconds": float(r["step_s"]),
                      "elastictrain_samples_per_second": float(r["samples_per_s"]),
                      "elastictrain_world_size": float(r["world_size"])})
            if r.get("loss") is not None:
                g["elastictrain_loss"] = float(r["loss"])
            memory = r.get("memory") or {}
            for key, gauge in (("host_mib", "elastictrain_host_memory_peak_bytes"),
                               ("alloc_mib", "elastictrain_device_memory_allocated_peak_bytes"),
                               ("reserved_mib", "elastictrain_device_memory_reserved_peak_bytes")):
                if memory.get(key) is not None:  # the highest rank's, since the previous step event
                    g[gauge] = float(memory[key]) * 1024 * 1024
            if r.get("eval_loss") is not None:
                g["elastictrain_eval_loss"] = float(r["eval_loss"])
            # The ledger's rule: a step at a smaller world size is productive in proportion to its size; a
            # step counts once (a redone step's event supersedes its first attempt's, whose time was lost)
            step, credit = int(r["step"]), float(r["step_s"]) * min(1.0, r["world_size"] / self.workers_max)
            if step < len(self.credited) and not math.isnan(self.credited[step]):
                self.productive_s -= self.credited[step]
            if len(self.credited) <= step:
                self.credited.extend([math.nan] * (step + 1 - len(self.credited)))
            self.credited[step] = credit
            self.productive_s += credit
        elif name == "step_skipped":
            self.pending.append(("elastictrain_steps_skipped_total", 1.0, {}))
        elif name == "failure":
            self.pending.append(("elastictrain_failures_total", 1.0, {"kind": str(r.get("kind") or "unknown")}))
        elif name == "recovered":
            down = float(r.get("downtime_s") or 0.0)
            g["elastictrain_recovery_downtime_seconds"] = down
            self.pending.append(("elastictrain_recovery_downtime_seconds_total", down, {}))
        elif name == "checkpoint_saved":
            self.pending.append(("elastictrain_checkpoints_committed_total", 1.0, {}))
            g["elastictrain_checkpoint_stall_seconds"] = float(r.get("stall_s") or 0.0)
            if r.get("write_s"):
                g["elastictrain_checkpoint_write_bytes_per_second"] = float(r.get("bytes") or 0) / r["write_s"]
        if self.started_at is not None and now > self.started_at:
            g["elastictrain_goodput_ratio"] = min(1.0, self.productive_s / (now - self.started_at))


class RunMetrics:
    """EventLog listener exporting :class:`MetricsState` through ``ray.util.metrics`` (see module docstring).

    Before Ray is initialised, records are only folded; the metrics are created at the first record after
    ``ray.init`` and catch up then (counters included).
    """

    def __init__(self, run_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id = run_id
        self.state = MetricsState()
        self._metrics: dict[str, Any] | None = None
        self.disabled_reason: str | None = None
        self._clock = clock
        self._exported_at: float | None = None  # (clock) when Ray's metrics were last set

    def __call__(self, record: dict[str, Any]) -> None:
        self.state.observe(record, time.time())
        if self.disabled_reason is not None:
            return
        now = self._clock()
        if (record["event"] == "step" and not record.get("final") and self._exported_at is not None
                and now - self._exported_at < EXPORT_EVERY_S):
            return  # folded; set with the next export
        try:
            self._export()
            if self._metrics is not None:
                self._exported_at = now
        except Exception as e:  # noqa: BLE001 - an observer must never break the run
            self.disabled_reason = f"{type(e).__name__}: {e}"
            print(f"elastictrain: metrics export disabled: {self.disabled_reason}", file=sys.stderr, flush=True)

    def _export(self) -> None:
        import ray

        if self._metrics is None:
            if not ray.is_initialized():
                return
            from ray.util.metrics import Counter, Gauge

            tags = {"run_id": self.run_id}
            self._metrics = {n: Gauge(n, d, tag_keys=("run_id",)).set_default_tags(tags) for n, d in GAUGES.items()}
            self._metrics.update({n: Counter(n, d, tag_keys=("run_id", "kind") if "failures" in n else ("run_id",))
                                  .set_default_tags(tags) for n, d in COUNTERS.items()})
        for name, value in self.state.gauges.items():
            self._metrics[name].set(value)
        pending, self.state.pending = self.state.pending, []
        for name, value, tags in pending:
            if value > 0:
                self._metrics[name].inc(value, tags=tags or None)


__all__ = ["RunMetrics", "MetricsState", "GAUGES", "COUNTERS", "EXPORT_EVERY_S"]
