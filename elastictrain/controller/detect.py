"""Failure detection as an object: observations of workers in, :class:`Failure` records out. No Ray and
no controller attributes: the monitor hands it what it saw (:class:`WorkerView`, run results, the clock),
so every rule is testable on its own (tests/test_detect.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.config import TimeoutsConfig
from elastictrain.controller import policy
from elastictrain.controller.kinds import FailureKind


@dataclass
class Failure:
    slot: int
    rank: int | None
    kind: FailureKind
    reason: str
    detected_at: float
    last_progress: float
    last_step: int  # the most advanced step any rank had completed when the failure was seen
    progress: int = 0  # steps the failed worker completed since it joined (a crash loop makes none)
    joined_step: int | None = None  # where this incarnation joined (None: never joined)


@dataclass(frozen=True)
class WorkerView:
    """What the controller knows of one worker when it judges it."""

    slot: int
    rank: int | None
    joined_step: int | None = None  # the step at which this incarnation joined; None: never joined
    phase: str = "idle"              # idle | data | compute | collective (from its last poll)
    phase_since: float = 0.0
    poll_sent_at: float | None = None  # an unanswered poll, sent then
    dead: bool = False


@dataclass(frozen=True)
class CallOutcome:
    """How one member's part of a collective call (join, load, sync, hold_snapshot) ended: ``ok``,
    ``pending`` (not returned), ``dead`` (its actor died), ``own`` (it raised its own error) or ``peer`` (it
    raised because the communication with a peer failed). ``error``: its own error in one line."""

    slot: int
    status: str
    error: str = ""


def blame(outcomes: Sequence[CallOutcome]) -> list[CallOutcome]:
    """Whose failure a failed collective call of the members is: the members whose actor died; else those
    that raised their own error (not a peer's: a member that raised because a peer broke the call is its
    victim); else, if some returned, those that did not (hung in the call). Empty when nothing names one
    (every part returned, or none did): the caller decides. Never a healthy member for another's error."""
    for status in ("dead", "own"):
        hit = [o for o in outcomes if o.status == status]
        if hit:
            return hit
    pending = [o for o in outcomes if o.status == "pending"]
    return pending if len(pending) < len(outcomes) else []


class FailureDetector:
    """Collects failures (one per slot until taken) from the observations it is given."""

    def __init__(self, timeouts: TimeoutsConfig) -> None:
        self.timeouts = timeouts
        self.pending: list[Failure] = []

    def report(self, w: WorkerView, kind: FailureKind, reason: str, *, now: float, last_progress: float,
               known_step: int) -> Failure | None:
        """Record a failure of ``w`` (ignored if ``w`` is dead already or has one pending)."""
        if w.dead or any(f.slot == w.slot for f in self.pending):
            return None
        progress = max(0, known_step - w.joined_step) if w.joined_step is not None else 0
        f = Failure(w.slot, w.rank, kind, reason, now, last_progress, known_step, progress, w.joined_step)
        self.pending.append(f)
        return f

    def on_run_result(self, w: WorkerView, result: dict[str, Any], **at: Any) -> Failure | None:
        """A worker's ``run`` returned: its own error is its failure (quoted); ``peer_failed`` is not (the
        dead peer is found elsewhere); ``done``/``stopped`` are no failure."""
        if result.get("status") == "error":
            return self.report(w, FailureKind.EXCEPTION, result.get("error") or "error (no message)", **at)
        return None

    def find_hangs(self, members: Sequence[WorkerView], *, now: float, progress_at: float,
                   step_times: Sequence[float], **at: Any) -> list[Failure]:
        """No progress for longer than the hang bound: members that do not answer polls are hung; if all
        answer, the ones stuck computing while others wait in a collective are. ``step_times``: recent
        step times of a generation that completed a step (empty before: the bound is the cap)."""
        bound = policy.hang_bound(step_times, self.timeouts)
        if now - progress_at < bound:
            return []
        suspects = [w for w in members if w.poll_sent_at is not None and now - w.poll_sent_at > bound]
        if not suspects and any(w.phase == "collective" for w in members):
            suspects = [w for w in members if w.phase == "compute" and now - w.phase_since > bound]
        why = f"no progress for {now - progress_at:.1f}s (bound {bound:.1f}s from observed step times)"
        found = [self.report(w, FailureKind.HANG, why, now=now, **at) for w in suspects]
        return [f for f in found if f is not None]

    @staticmethod
    def find_data_stalls(members: Sequence[WorkerView], *, now: float, bound: float) -> list[WorkerView]:
        """Members waiting on their dataset's reads (phase ``data``: storage, not the worker) for longer than
        the hang bound. Never a failure: a replacement would wait on the same storage. :meth:`find_hangs`
        blames none of them (they neither compute nor answer late) and none of the peers waiting for them."""
        return [w for w in members if w.phase == "data" and now - w.phase_since > bound]

    def take(self) -> list[Failure]:
        """The pending failures, handed over once."""
        out, self.pending = self.pending, []
        return out
