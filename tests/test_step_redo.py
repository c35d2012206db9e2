"""Each step counts once (issue #40). A step redone after a restore from an older step is reported again,
``redone: true``, and its event supersedes the first attempt's: the report, summary.json and the goodput
metric count it once, the first attempt's time is goodput's ``redone_s``. A durable checkpoint carries the
reporting rank's step records, and a recovery from one this run committed reports the steps it holds
whose events were never written. The end-to-end proofs are runs the suite makes anyway:
tests/test_parallel.py's fsdp kill (restored from an older checkpoint) and tests/test_recovery.py's
all-workers-lost run (restored from the peer tier); these check the parts without Ray."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from elastictrain.checkpoint import CheckpointStore, CheckpointWriter
from elastictrain.checkpoint.carried import CARRIED_MAX, carried, carry, to_replay
from elastictrain.checkpoint.manifest import Manifest, ManifestError
from elastictrain.config import CheckpointConfig
from elastictrain.controller.ledger import Ledger
from elastictrain.events import EventLog
from elastictrain.metrics import MetricsState
from elastictrain.report import build_view
from elastictrain.worker.loop import StepRecord


def _record(step: int, loss: float, step_s: float = 0.25, world_size: int = 2) -> StepRecord:
    return StepRecord(step=step, loss=loss, world_size=world_size, accum=1, step_s=step_s, compute_s=step_s / 2,
                      finished_at=1000.0 + step, tokens=512, flops_per_token=1e6, devices=world_size)


def _events(log: EventLog) -> list[dict]:
    return [json.loads(line) for line in log.path.read_text().splitlines()]


def _newest(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["event"] == "step"}  # the contract: the newest event stands


def test_a_redone_step_supersedes_its_first_attempt_and_counts_once(tmp_path):
    """Steps 1..6 reported; the state is restored at step 4 (every worker lost); 5 and 6 are redone (other
    step times, as a redo on another machine has), then 7. Every figure a user reads counts each step once."""
    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=7, global_batch=8, max_workers=2, cpu_peak_flops=1e9)
    first = {s: _record(s, 1.0 / s, step_s=0.25 if s < 5 else 1.0) for s in range(1, 7)}
    for r in first.values():
        ledger.add(0, r, complete=True)
    ledger.rewind(4)
    redo = {s: _record(s, 1.0 / s + 0.5, step_s=0.5) for s in (5, 6)}
    for r in [*redo.values(), _record(7, 1.0 / 7, step_s=0.5)]:
        ledger.add(0, r, complete=True)
    events = _events(log)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6, 5, 6, 7]
    assert [e.get("redone", False) for e in steps] == [False] * 6 + [True, True, False]
    assert [e.get("lost_s") for e in steps[6:8]] == [1.0, 1.0]  # the first attempts' step times
    final = {**first, **redo, 7: _record(7, 1.0 / 7, step_s=0.5)}
    assert {s: e["loss"] for s, e in _newest(events).items()} == {s: r.loss for s, r in final.items()}
    # goodput: the newest attempts are the training, the first attempts of 5 and 6 the lost work
    assert ledger.goodput["productive_s"] == pytest.approx(sum(r.step_s for r in final.values()))
    assert ledger.goodput["redone_s"] == pytest.approx(2.0) and ledger.goodput["degraded_s"] == 0.0
    # every attempt's time is in exactly one bucket (so the buckets still add up to wall time)
    ran = sum(r.step_s for r in first.values()) + sum(r.step_s for r in redo.values()) + 0.5
    assert sum(ledger.goodput[k] for k in ("productive_s", "degraded_s", "compile_s", "redone_s")) == pytest.approx(ran)
    summary = ledger.summary("finished", {})
    assert summary["goodput"]["redone_s"] == pytest.approx(2.0)
    per_device = statistics.median(512 / r.step_s / r.devices for r in final.values())
    assert summary["tokens_per_s_per_device"] == pytest.approx(per_device)
    # the goodput metric folds the same events to the same productive time
    state = MetricsState()
    for e in events:
        state.observe(e, now=e["time"])
    assert state.productive_s == pytest.approx(ledger.goodput["productive_s"])
    # the report's loss curve: each step once, with the redo's loss
    view = build_view(events, summary)
    assert [loss for _, loss in view["loss"]] == [final[s].loss for s in range(1, 8)]
    assert view["goodput"]["redone_s"] == pytest.approx(2.0)


def test_rewind_drops_records_of_the_old_attempt_still_held(tmp_path):
    """Every rank reporting (pp): rank 0's record of step 5 was held waiting for rank 1's when the state was
    restored at step 4. Rank 1's redo of step 5 must not complete it with rank 0's old record."""
    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=9, global_batch=8, max_workers=2)
    ledger.new_generation(0, 2, 1)
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            ledger.add(rank, _record(step, 1.0))
    ledger.add(0, _record(5, 99.0))  # the old attempt's, rank 1's died with it
    ledger.rewind(4)
    ledger.new_generation(1, 2, 1)
    assert ledger.add(1, _record(5, 0.5)) == []  # waits for rank 0's redo
    (event,) = ledger.add(0, _record(5, 0.5))
    assert event["loss"] == 0.5 and "redone" not in event  # step 5 was never reported: not a redo


def _commit(tmp_path, step: int, records) -> Manifest:
    root = str(tmp_path / "ckpt")
    store = CheckpointStore(root)
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait"), root, 0, 1, None)
    try:
        assert writer.save_async(step, {"w": torch.arange(4.0)}, records=carry(records, step))
        (report,) = writer.wait(30)
        assert report.error is None, report.error
        store.commit(step, [report], {"world_size": 1})
    finally:
        writer.close()
    manifest, problems = store.latest_valid()
    assert manifest is not None and manifest.step == step, problems
    return manifest


def test_a_checkpoint_carries_step_records_and_a_recovery_replays_the_unreported(tmp_path):
    """The reporting rank's records (a redo keeps its newest, none past the saved step) travel through a real
    save and commit into the manifest; a recovery from a checkpoint this run committed reports the steps
    after the last one reported, up to the checkpoint's, once each, ``replayed``; then redoes the rest."""
    recent = [_record(s, 1.0 / s) for s in range(1, 8)] + [_record(5, 0.5)]  # 5 redone; 6, 7 newer than 5
    manifest = _commit(tmp_path, 5, recent)
    back = carried(manifest)
    assert [(r.step, r.loss) for r in back] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 0.5)]
    assert back[0].tokens == 512 and back[0].step_s == 0.25 and back[0].finished_at == 1001.0
    assert to_replay(manifest, committed_by_this_run=[]) == []  # a branch point / an earlier run's
    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=9, global_batch=8, max_workers=2)
    for step in (1, 2, 3):
        ledger.add(0, _record(step, 1.0 / step), complete=True)
    assert ledger.replay(to_replay(manifest, committed_by_this_run=[5]), up_to=5) == [4, 5]
    ledger.rewind(5)
    ledger.add(0, _record(6, 1 / 6), complete=True)
    steps = [e for e in _events(log) if e["event"] == "step"]
    assert [(e["step"], e.get("replayed", False), e["loss"]) for e in steps] == [
        (1, False, 1.0), (2, False, 0.5), (3, False, 1 / 3), (4, True, 0.25), (5, True, 0.5), (6, False, 1 / 6)]


def test_carried_records_are_bounded_and_checked(tmp_path):
    many = [_record(s, 1.0) for s in range(1, 200)]
    assert [r["step"] for r in carry(many, 150)] == list(range(150 - CARRIED_MAX + 1, 151))
    skipped = StepRecord(step=3, loss=float("nan"), world_size=1, accum=1, step_s=0.1, compute_s=0.1,
                         finished_at=1.0, skipped="non-finite loss (rank 0)")
    (item,) = carry([skipped], 3)
    assert item["loss"] is None and item["skipped"] == "non-finite loss (rank 0)"
    json.dumps(item, allow_nan=False)  # strict JSON, as the manifest is written
    good = carry([_record(1, 1.0), _record(2, 0.5)], 2)

    def manifest(records) -> Manifest:
        return Manifest(step=2, world_size=1, files={}, meta={}, created_at=0.0,
                        shards={0: {"files": [], "records": records}})

    assert [r.step for r in carried(manifest(list(good)))] == [1, 2]
    pp = StepRecord(step=1, loss=1.0, world_size=1, accum=4, step_s=0.1, compute_s=0.1, finished_at=1.0,
                    pipeline={"pp": 2, "schedule": "1f1b", "n_microbatches": 4, "stages_per_rank": 1,
                              "bubble_timeline": 0.2, "bubble_measured": 0.25})
    (back,) = carried(manifest(list(carry([pp], 1))))
    assert back.pipeline == pp.pipeline  # goodput counts a pp step's ranks by it
    for bad, why in [([{**good[0], "loss": "1"}], "'loss'"), ([{**good[0], "code": 1}], "unknown fields"),
                     ([{k: v for k, v in good[0].items() if k != "step_s"}], "no 'step_s'"),
                     ([good[1], good[0]], "in order"), ([{**good[0], "step": 3}], "up to 2"),
                     ([{**good[0], "pipeline": {"pp": "2", "bubble_measured": 0.1}}], "'pipeline'"),
                     ("x", "not a list")]:
        with pytest.raises(ManifestError, match=why):
            carried(manifest(bad))
