"""The controller's states and the transitions it may take (docs/design.md, "The controller's states").
The setter enforces and logs them; staying in a state is no transition."""

from __future__ import annotations

import enum
import logging

log = logging.getLogger("elastictrain.controller")


class State(enum.Enum):
    STARTING = "starting"          # placing workers, first rendezvous, resume
    RUNNING = "running"            # workers run the step loop
    RECOVERING = "recovering"      # a worker failed: survivors regroup, replacements start
    RESIZING = "resizing"          # ready joiners: stop at a step boundary and grow
    CHECKPOINTING = "checkpointing"  # preempted: stop and write a just-in-time checkpoint
    FINISHED = "finished"
    FAILED = "failed"
    PREEMPTED = "preempted"


TERMINAL = frozenset({State.FINISHED, State.FAILED, State.PREEMPTED})

ALLOWED: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.RUNNING, State.FAILED, State.PREEMPTED, State.RECOVERING}),
    State.RUNNING: frozenset({State.RECOVERING, State.RESIZING, State.CHECKPOINTING, State.FINISHED,
                              State.FAILED}),
    State.RECOVERING: frozenset({State.RUNNING, State.FAILED, State.CHECKPOINTING}),
    State.RESIZING: frozenset({State.RUNNING, State.RECOVERING, State.FAILED, State.CHECKPOINTING,
                               State.FINISHED}),
    State.CHECKPOINTING: frozenset({State.PREEMPTED, State.FAILED}),
    State.FINISHED: frozenset(),
    State.FAILED: frozenset(),
    State.PREEMPTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class StateMachine:
    def __init__(self) -> None:
        self.state = State.STARTING
        self.history: list[tuple[State, State, str]] = []

    def to(self, new: State, reason: str) -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.name} -> {new.name} is not allowed ({reason})")
        log.info("controller %s -> %s: %s", self.state.name, new.name, reason)
        self.history.append((self.state, new, reason))
        self.state = new

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL
