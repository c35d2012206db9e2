"""One recovery as a record of its own: what the controller learns between a failure and the generation
that stands after it (the failure that opened it, where the new state came from and why, how long the
membership waited for workers). The controller holds one open record; :meth:`Recovery.close` accounts it
(the ``recovered`` event) and the controller starts a fresh one."""

from __future__ import annotations

import time
from dataclasses import dataclass

from elastictrain.controller.detect import Failure
from elastictrain.controller.ledger import Ledger
from elastictrain.events import EventLog


@dataclass
class Recovery:
    failure: Failure | None = None  # the first failure of this recovery (None: no failure, e.g. a growth)
    source: str = "peer"            # where the new generation's state came from (gather.Gathered.kind)
    reason: str = ""                # why that source (the ``recovered`` event's reason)
    last_step: int = 0              # newest completed step known when the source was chosen
    waiting_since: float | None = None  # since when the membership waits for workers (None: not waiting)

    def close(self, start_step: int, world_size: int, ledger: Ledger, events: EventLog) -> None:
        """The new generation stands at ``start_step``: account the recovery (nothing without a failure).
        ``lost_steps`` counts completed steps that must be redone (0 when a survivor held the newest
        state); the step in flight is lost time, not a step."""
        f = self.failure
        if f is None:
            return
        now = time.time()
        lost = max(0, max(f.last_step, self.last_step) - start_step)  # as the source decision counted
        ledger.recoveries += 1
        ledger.lost_steps += lost
        ledger.add_time("recovery", now - f.detected_at)
        events.emit("recovered", source=self.source, recovery_s=round(now - f.detected_at, 3),
                    downtime_s=round(now - f.last_progress, 3), lost_steps=lost, step=start_step,
                    world_size=world_size, reason=self.reason)
