"""The failure budget as the controller keeps it: every failure charged (by its kind's rule,
controller/kinds.py) into one log, judged by the pure verdicts of :mod:`elastictrain.controller.policy`."""

from __future__ import annotations

from collections.abc import Sequence

from elastictrain.config import RecoveryConfig
from elastictrain.controller import policy


class FailureBudget:
    def __init__(self, recovery: RecoveryConfig, slots: int) -> None:
        self.recovery, self.slots = recovery, slots
        self.log: list[policy.FailureRecord] = []  # what the budget judged so far
        self.any_setup_ok = False  # some worker finished its set-up (a set-up failure is then not deterministic)

    def judge(self, record: policy.FailureRecord) -> str | None:
        """Add ``record`` to the log; a reason to stop the run, or None (policy.setup_verdict, failure_verdict)."""
        self.log.append(record)
        return (policy.setup_verdict(self.log, self.slots, self.any_setup_ok)
                or policy.failure_verdict(self.log, record.at, self.recovery))

    def charge(self, records: Sequence[policy.FailureRecord]) -> str | None:
        """Judge a recovery's failures together: a lost node is one failure (policy.budget_records). The
        first reason to stop, or None."""
        verdicts = [self.judge(r) for r in policy.budget_records(records, self.log)]
        return next((v for v in verdicts if v), None)
