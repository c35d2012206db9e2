"""Checks on a finished run that each step counts once (issue #40), for the runs the suite makes anyway
(tests/test_parallel.py's fsdp kill, tests/test_recovery.py's all-workers-lost run): a step reported
again is a redo after a restore from an older step, marked so, and the user's figures count it once;
every committed checkpoint carries the step records of the steps it holds."""

from __future__ import annotations

from typing import Any

from elastictrain.checkpoint import CheckpointStore
from elastictrain.checkpoint.carried import CARRIED_MAX, carried


def assert_each_step_counted_once(run: Any) -> list[int]:
    """A step's first event is not ``redone``; every later one is, and says the first attempt's lost time;
    steps are redone only after a restore (``recovered`` with ``lost_steps``); goodput's ``redone_s`` is
    there exactly when a step was redone. Returns the steps redone (in order)."""
    seen: set[int] = set()
    redone = []
    for e in run.of("step"):
        if e["step"] in seen:
            assert e.get("redone") is True and e["lost_s"] >= 0.0, e
            redone.append(e["step"])
        else:
            assert "redone" not in e and "lost_s" not in e, e
        seen.add(e["step"])
    lost = sum(e["lost_steps"] for e in run.of("recovered"))
    assert len(redone) <= lost, (redone, run.of("recovered"))
    assert (run.summary["goodput"]["redone_s"] > 0.0) == bool(redone), (run.summary["goodput"], redone)
    return redone


def assert_checkpoints_carry_their_steps(run: Any) -> None:
    """Every committed checkpoint of the run carries rank 0's records: the newest steps up to its own, one
    each, without a gap (at most ``CARRIED_MAX``; a rank 0 that is a new process has those since it joined),
    each with the loss of the step's standing (newest) event."""
    newest = {e["step"]: e for e in run.of("step")}
    manifests = CheckpointStore(run.summary["checkpoint_root"]).committed()
    assert manifests, "the run committed no checkpoint"
    for m in manifests:
        records = carried(m)
        steps = [r.step for r in records]
        assert steps and steps == list(range(steps[0], m.step + 1)) and len(steps) <= CARRIED_MAX, (m.step, steps)
        assert [r.loss for r in records] == [newest[r.step]["loss"] for r in records], m.step
