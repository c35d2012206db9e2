"""The driver sets Ray's metrics at most every ``EXPORT_EVERY_S`` while steps stream in, and at every other
event, so Ray's agent (which exports every ~10 s) never holds values older than that, and the run's last
values are always set. No Ray: :class:`RunMetrics` is driven with a clock of the test's, and what it would
set on Ray's metrics is recorded at each export (the state it folds is the real one)."""

from __future__ import annotations

from typing import Any

import pytest

from elastictrain.metrics import EXPORT_EVERY_S, RunMetrics


class _Recorded(RunMetrics):
    """RunMetrics whose export records the values it would set on Ray's metrics."""

    def __init__(self, clock) -> None:
        super().__init__("rate-probe", clock=clock)
        self.exports: list[tuple[float, dict[str, float], list[Any]]] = []

    def _export(self) -> None:
        self._metrics = {}
        pending, self.state.pending = self.state.pending, []
        self.exports.append((self._clock(), dict(self.state.gauges), pending))


def _step(n: int, total: int) -> dict[str, Any]:
    return {"event": "step", "time": 1000.0 + n, "step": n, "step_s": 0.03, "samples_per_s": 100.0 + n,
            "world_size": 2, "loss": 5.0 - n / 1000, "final": n == total}


def test_steps_are_set_at_most_every_interval_and_the_last_values_always() -> None:
    now = [0.0]
    m = _Recorded(lambda: now[0])
    m({"event": "run_started", "time": 1000.0, "workers_max": 2})
    total, dt = 400, 0.03  # 12 s of 30 ms steps
    for n in range(1, total + 1):
        now[0] += dt
        if n == 200:
            m({"event": "failure", "time": 1000.0 + n, "kind": "exception"})  # never held back
        m(_step(n, total))
    now[0] += dt
    m({"event": "run_finished", "time": 2000.0})
    times = [t for t, _, _ in m.exports]
    # every 30 ms step set would be 400 exports; at most one per interval, plus the other events
    assert len(times) <= total * dt / EXPORT_EVERY_S + 4, len(times)
    # never older than the interval while steps ran: an export follows each step within it
    for n, at in [(n, n * dt) for n in range(1, total + 1)]:
        assert any(at <= t <= at + EXPORT_EVERY_S + dt and g["elastictrain_step"] >= n for t, g, _ in m.exports), n
    # the failure's counter went out at once, and the last step's values are the ones set at the end
    failures = [(t, p) for t, _, p in m.exports if p]
    assert failures and failures[0][1][0][0] == "elastictrain_failures_total"
    assert failures[0][0] == pytest.approx(200 * dt)
    final = m.exports[-1][1]
    assert final["elastictrain_step"] == float(total) and final["elastictrain_loss"] == 5.0 - total / 1000
    assert final["elastictrain_samples_per_second"] == 100.0 + total


def test_the_final_step_is_set_even_within_the_interval() -> None:
    now = [0.0]
    m = _Recorded(lambda: now[0])
    for n in (1, 2, 3):
        now[0] += 0.01
        m(_step(n, 3))
    assert [g["elastictrain_step"] for _, g, _ in m.exports] == [1.0, 3.0]
