"""The per-recovery record (controller/recovery.py): what a recovery learned, closed into one
``recovered`` event with the steps to redo counted as the source decision counted them."""

from __future__ import annotations

import time

from elastictrain.controller.detect import Failure
from elastictrain.controller.kinds import FailureKind
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.recovery import Recovery
from elastictrain.events import EventLog, read_events


def _ledger(tmp_path) -> tuple[Ledger, EventLog]:
    events = EventLog(tmp_path, console=None)
    return Ledger(events, 100, 8, 2), events


def test_a_recovery_without_a_failure_closes_silently(tmp_path) -> None:
    ledger, events = _ledger(tmp_path)
    Recovery(source="checkpoint", reason="grow").close(10, 2, ledger, events)
    events.close()
    assert ledger.recoveries == 0 and not [e for e in read_events(tmp_path) if e["event"] == "recovered"]


def test_a_recovery_counts_the_steps_to_redo_from_the_newest_step_known(tmp_path) -> None:
    """Lost steps: from the newest completed step known (the failure's, or the one the source decision
    saw, whichever is newer) back to where the new generation starts."""
    ledger, events = _ledger(tmp_path)
    now = time.time()
    f = Failure(1, 1, FailureKind.PROCESS_DIED, "worker process died", now - 2.0, now - 3.0, 40)
    Recovery(failure=f, source="checkpoint", reason="storage holds step 30", last_step=42).close(30, 1, ledger, events)
    events.close()
    (got,) = [e for e in read_events(tmp_path) if e["event"] == "recovered"]
    assert (got["source"], got["lost_steps"], got["step"], got["world_size"]) == ("checkpoint", 12, 30, 1)
    assert got["reason"] == "storage holds step 30" and got["downtime_s"] >= got["recovery_s"] >= 2.0
    assert (ledger.recoveries, ledger.lost_steps) == (1, 12)
