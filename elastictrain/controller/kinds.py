"""What a failure is, and how the failure budget charges it: one enum, its rules written once beside it.

Every place that names a failure kind (the detector, the monitor, the controller, the budget in
:mod:`elastictrain.controller.policy`, the tests) goes through :class:`FailureKind`. It is a ``StrEnum``:
``failure`` events, ``summary.json`` and metrics tags keep the same words (``"process_died"``...).
"""

from __future__ import annotations

import enum


class Charge(enum.Enum):
    """How the failure budget (``policy.failure_verdict``) counts one failure."""

    SLOT = "slot"    # one failure of its worker slot; its progress since joining decides the crash-loop streak
    NODE = "node"    # one failure of the lost node, however many workers it hosted (policy.budget_records)
    SETUP = "setup"  # one failure of its slot, no progress; every slot failing alike ends the run (setup_verdict)
    GROUP = "group"  # one failure of the group as a whole (no slot to blame; its own crash-loop streak)


class FailureKind(enum.StrEnum):
    PROCESS_DIED = "process_died"  # the worker's process is gone (Ray's notice, its peers, a failed call)
    HANG = "hang"                  # no progress past the hang bound, blamed on this worker
    EXCEPTION = "exception"        # the worker raised its own error (in its step, or its part of a call)
    STRAGGLER = "straggler"        # evicted: its compute time is far above its peers' (recovery.evict_stragglers)
    NODE_LOST = "node_lost"        # a death or hang on a node that is no longer alive
    SETUP_FAILED = "setup_failed"  # the worker's set-up raised before it ever joined
    GROUP_FAILED = "group_failed"  # the group left its step loop with errors and nobody was found dead

    @property
    def charge(self) -> Charge:
        return RULES[self][0]

    def seen_on(self, node_alive: bool) -> FailureKind:
        """The kind as charged once the failed worker's node was looked at: a death or a hang on a node
        that is gone is the node's loss (one failure of the node, not one per worker)."""
        return FailureKind.NODE_LOST if not node_alive and RULES[self][1] else self


# kind -> (how the budget charges it, whether its node being gone makes it NODE_LOST): the one place
RULES: dict[FailureKind, tuple[Charge, bool]] = {
    FailureKind.PROCESS_DIED: (Charge.SLOT, True),
    FailureKind.HANG: (Charge.SLOT, True),
    FailureKind.EXCEPTION: (Charge.SLOT, False),
    FailureKind.STRAGGLER: (Charge.SLOT, False),
    FailureKind.NODE_LOST: (Charge.NODE, False),
    FailureKind.SETUP_FAILED: (Charge.SETUP, False),
    FailureKind.GROUP_FAILED: (Charge.GROUP, False),
}

# how a member's part of a failed collective call (detect.CallOutcome.status) is charged, when it is blamed
OUTCOME_KIND: dict[str, FailureKind] = {
    "dead": FailureKind.PROCESS_DIED, "own": FailureKind.EXCEPTION, "pending": FailureKind.HANG}
