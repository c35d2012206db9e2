"""The ``hold`` fault (worker/faults.py): a generation held by an event, not a clock. A held rank waits
until its host asks the generation to stop at a step boundary (``Worker.request_stop``'s flag, the one the
step's word carries) or aborts its group, at most ``seconds``; a stop that ends it is that step's own, so
the held step is the generation's last. The grow-back tests (tests/test_tp_recovery.py and the others) hold
their folded generation this way. Here: the worker's StepRunner on a one-rank gloo group in this process
(no Ray), and the injector's addressing on its own.

Against a hold that returns at once (``StepRunner._hold`` returning False without waiting), 2026-11-28:
four tests failed: ``..._lasts_its_seconds`` (held 0.36 s of 3.0), both ``..._while_holding_...`` (the
held step's word did not carry the stop) and ``..._before_the_hold_is_reached_...``. Against a hold deaf
to the stop (ended by the abort or its seconds only): ``..._while_holding_...[before_step]`` failed (held
60.0 s: the stop did not end the hold)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from elastictrain import build_config
from elastictrain.config import ConfigError, FaultConfig
from tests.conftest import job

BOUND = 60.0  # a hold's `seconds` where only the stop or the abort may end it (never reached when they work)


@contextmanager
def _runner(faults: list[dict], steps: int = 3) -> Iterator:
    """The worker's StepRunner of the base job (``steps`` steps, one worker) on a one-rank gloo group."""
    import torch.distributed as dist

    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    cfg = build_config(job(train={"steps": steps}, workers={"min": 1, "max": 1}, faults=faults))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(cfg.faults), parallel=cfg.parallel)
        runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
        yield runner
    finally:
        dist.destroy_process_group()


def _hold(step: int, seconds: float, point: str = "before_step", generation: int | None = 0) -> dict:
    return {"rank": 0, "step": step, "point": point, "kind": "hold", "seconds": seconds, "generation": generation}


def _clean_losses(steps: int) -> list[float]:
    with _runner([], steps) as runner:
        return [runner.run_step(False)[0].loss for _ in range(steps)]


def _step_in_thread(runner) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def main() -> None:
        t0 = time.monotonic()
        try:
            out["record"], out["stop"] = runner.run_step(False)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
        out["held_s"] = time.monotonic() - t0

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, out


def _until_holding(runner, thread: threading.Thread, step: int) -> None:
    """Wait (bounded) until the runner sits in the hold before step ``step``: in phase "compute" with step
    ``step - 1`` committed (or the thread already ended: a hold that does not hold)."""
    deadline = time.monotonic() + 120
    while not (runner.phase == "compute" and runner.step == step - 1) and thread.is_alive():
        assert time.monotonic() < deadline, "the hold was never entered"
        thread.join(0.01)


@pytest.mark.parametrize("point", ["before_step", "mid_step"])
def test_a_stop_asked_while_holding_ends_the_hold_and_the_held_step_is_the_last(point: str) -> None:
    """Held at step 2: nothing of step 2 commits until the stop is asked; then the step runs, its word
    carries the stop (``run_step`` says stop: the caller ends the generation after it), and its loss is an
    unheld run's."""
    clean = _clean_losses(2)
    with _runner([_hold(2, BOUND, point)]) as runner:
        first, stop = runner.run_step(False)
        assert not stop and first.loss == clean[0]
        thread, out = _step_in_thread(runner)
        _until_holding(runner, thread, 2)
        assert runner.step == 1  # held: step 2 has not committed
        runner.stop.set()
        thread.join(120)
        assert not thread.is_alive() and "error" not in out, out
        assert out["stop"], "the held step's word did not carry the stop"
        assert out["held_s"] < BOUND, f"held {out['held_s']:.1f} s: the stop did not end the hold"
        assert out["record"].step == 2 and out["record"].loss == clean[1]
        assert not runner.faults.touched  # poolable, like slow


def test_a_stop_asked_before_the_hold_is_reached_ends_it_at_once() -> None:
    with _runner([_hold(1, BOUND)]) as runner:
        runner.stop.set()
        t0 = time.monotonic()
        record, stop = runner.run_step(False)
        assert stop and record.step == 1 and time.monotonic() - t0 < BOUND


def test_a_hold_without_a_stop_lasts_its_seconds() -> None:
    """Nobody asks: the hold ends after ``seconds`` and the step goes on unchanged, without a stop. (The
    hold's time is the step's time outside its forwards and backwards: a loaded machine slows those.)"""
    seconds = 3.0
    clean = _clean_losses(2)
    with _runner([_hold(2, seconds)]) as runner:
        records = [runner.run_step(False) for _ in range(2)]
        held = records[1][0].step_s - records[1][0].compute_s
        assert held >= seconds, f"held {held:.2f} s of {seconds}"
        assert [(r.loss, stop) for r, stop in records] == [(loss, False) for loss in clean]


def test_an_abort_ends_the_hold_and_the_step_is_discarded() -> None:
    """A failure elsewhere (the controller aborts the generation's group) ends the hold at once; the held
    step then never commits."""
    from elastictrain.worker.loop import StepAborted

    with _runner([_hold(1, BOUND)]) as runner:
        thread, out = _step_in_thread(runner)
        _until_holding(runner, thread, 1)
        runner.abort(0)
        thread.join(120)
        assert not thread.is_alive() and isinstance(out.get("error"), StepAborted), out
        assert out["held_s"] < BOUND and runner.step == 0


def test_a_hold_fires_at_the_first_step_from_its_step_in_its_generation_once() -> None:
    """Addressing: the first step at or after ``step`` that the rank reaches at that point, in that generation
    (a fold resumes where its recovery source was: not always a known step), once per process."""
    from elastictrain.worker.faults import FaultInjector

    faults = FaultInjector([FaultConfig(**_hold(1, 5.0, generation=1))])
    calls: list[float] = []
    faults.bind(abort=lambda: None, stall=lambda: None, hold=lambda s: calls.append(s) or True)
    assert not faults.fire(rank=0, step=4, point="before_step", generation=0)  # another generation
    assert not faults.fire(rank=1, step=4, point="before_step", generation=1)  # another rank
    assert not faults.fire(rank=0, step=4, point="after_step", generation=1)  # another point
    assert faults.fire(rank=0, step=7, point="before_step", generation=1)  # the first from step 1 on
    assert not faults.fire(rank=0, step=8, point="before_step", generation=1)  # once
    assert calls == [5.0] and not faults.touched


def test_a_hold_where_no_stop_can_follow_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        build_config(job(faults=[_hold(1, 5.0, point="commit")]))
    text = str(e.value)
    assert "faults.0" in text and "point='commit' with kind='hold'" in text and "use point: before_step" in text
    assert "\n" not in text
