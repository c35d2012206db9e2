"""Step records carried by peer-tier snapshots (issue #40): a recovery from the tier reports the steps whose
records died with the workers, once each, in order, marked ``replayed``. The end-to-end proof is
tests/test_recovery.py's all-workers-lost run; these check the parts without Ray."""

from __future__ import annotations

import json
import pickle

import torch

from elastictrain.checkpoint.memory_dcp import take_snapshot
from elastictrain.controller.gather import _memory_restore
from elastictrain.controller.ledger import Ledger
from elastictrain.events import EventLog
from elastictrain.worker.loop import StepRecord


def _record(step: int, rank_tag: float = 0.0) -> StepRecord:
    return StepRecord(step=step, loss=1.0 / step + rank_tag, world_size=2, accum=1, step_s=0.01, compute_s=0.005,
                      finished_at=1000.0 + step)


def _steps(log: EventLog) -> list[dict]:
    lines = log.path.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "step"]


def test_replay_reports_the_unseen_steps_once_in_order_and_never_a_step_seen(tmp_path):
    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=10, global_batch=4, max_workers=2)
    for step in (1, 2, 3):  # polled before the failure
        ledger.add(0, _record(step), complete=True)
    # the snapshot of step 5 carried the records of steps 1..6 (6: newer than the restored state, never)
    assert ledger.replay([_record(s) for s in (6, 2, 4, 1, 5, 3)], up_to=5) == [4, 5]
    assert ledger.replay([_record(s) for s in (4, 5)], up_to=5) == []  # a second replay adds nothing
    ledger.add(0, _record(5, rank_tag=9.0), complete=True)  # a late record of a replayed step: dropped
    ledger.add(0, _record(6), complete=True)  # the next generation's first step
    steps = _steps(log)
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]  # every step once, in order
    assert [e.get("replayed", False) for e in steps] == [False, False, False, True, True, False]
    assert [e["loss"] for e in steps] == [1.0 / s for s in range(1, 7)]  # the records' own losses
    assert ledger.last_step == 6


def test_replay_after_every_rank_reported_counts_ranks_no_more(tmp_path):
    """Every rank reporting (pp): a step some ranks reported before the failure is replayed from the
    carried record, and the late records of other ranks do not report it again."""
    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=10, global_batch=4, max_workers=2)
    ledger.new_generation(0, 2, 1)
    for rank in (0, 1):
        ledger.add(rank, _record(1))
    ledger.add(0, _record(2))  # rank 1's record of step 2 died with it
    assert ledger.replay([_record(1), _record(2)], up_to=2) == [2]
    ledger.add(1, _record(2))
    assert [e["step"] for e in _steps(log)] == [1, 2]


class _Source:
    def __init__(self, meta) -> None:
        self.meta = meta


def test_snapshot_meta_carries_records_and_the_restore_takes_them_off(tmp_path):
    state = {"model": {"w": torch.arange(4.0)}}
    carried = [_record(s) for s in (3, 4, 5)]
    snap = take_snapshot(state, rank=0, step=4, records=carried)
    meta = pickle.loads(pickle.dumps(snap.meta))  # the compact pickling keeps them (keeper -> controller)
    assert [r.step for r in meta.records] == [3, 4, 5] and meta.records[1].loss == carried[1].loss
    other = take_snapshot({"model": {"w": torch.zeros(4)}}, rank=1, step=4)  # a rank that carries none
    srcs = [_Source(meta), _Source(other.meta)]
    restore = _memory_restore(4, srcs)
    assert [r.step for r in restore.records] == [3, 4]  # up to the restored step, in order
    assert all(s.meta.records == () for s in srcs)  # the loading ranks get the metas without them
    assert restore.kind == "memory" and restore.step == 4 and restore.sources == srcs
