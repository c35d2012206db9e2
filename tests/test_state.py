"""The controller's state machine (elastictrain/controller/state.py) against its spec, written out by hand
from docs/design.md ("The controller's states"): every transition the spec names is allowed, logged and
recorded; every other move raises and changes nothing. The cases are not generated from the table they
test: a transition added to or dropped from the table without the spec fails here."""

from __future__ import annotations

import logging

import pytest

from elastictrain.controller.state import ALLOWED, TERMINAL, IllegalTransition, State, StateMachine

S = State

# (from, to, when): docs/design.md, "The controller's states"
SPEC = [
    (S.STARTING, S.RUNNING, "the first generation formed"),
    (S.STARTING, S.RECOVERING, "a worker failed during the first rendezvous"),
    (S.STARTING, S.FAILED, "workers.min not started within restart_grace_s, or every set-up failed alike"),
    (S.STARTING, S.PREEMPTED, "preempted before any generation formed: nothing to save"),
    (S.RUNNING, S.RECOVERING, "a failure was detected, or the group left its loop with nobody dead"),
    (S.RUNNING, S.RESIZING, "ready joiners: the members stop at a step boundary to grow"),
    (S.RUNNING, S.CHECKPOINTING, "preempted: the members stop at a step boundary"),
    (S.RUNNING, S.FINISHED, "every member reached train.steps"),
    (S.RUNNING, S.FAILED, "the failure budget is spent, or too many non-finite steps"),
    (S.RECOVERING, S.RUNNING, "the survivors (and joiners) formed the next generation"),
    (S.RECOVERING, S.CHECKPOINTING, "preempted while recovering or waiting for workers"),
    (S.RECOVERING, S.FAILED, "the budget is spent, the wait for workers ran out, or storage failed (exit 3)"),
    (S.RESIZING, S.RUNNING, "the grown generation formed"),
    (S.RESIZING, S.RECOVERING, "a failure while stopping, or the growth had to wait for workers"),
    (S.RESIZING, S.CHECKPOINTING, "preempted while stopping to grow"),
    (S.RESIZING, S.FINISHED, "the loop reached train.steps while stopping to grow"),
    (S.RESIZING, S.FAILED, "the failure budget is spent"),
    (S.CHECKPOINTING, S.PREEMPTED, "the just-in-time checkpoint is written (or could not be): exit 75"),
    (S.CHECKPOINTING, S.FAILED, "a checkpoint error while regrouping to save (exit 3)"),
]

# a path of spec transitions from STARTING to each state, to put a machine there
PATH = {
    S.STARTING: [],
    S.RUNNING: [S.RUNNING],
    S.RECOVERING: [S.RUNNING, S.RECOVERING],
    S.RESIZING: [S.RUNNING, S.RESIZING],
    S.CHECKPOINTING: [S.RUNNING, S.CHECKPOINTING],
    S.FINISHED: [S.RUNNING, S.FINISHED],
    S.FAILED: [S.FAILED],
    S.PREEMPTED: [S.PREEMPTED],
}


def _at(state: State) -> StateMachine:
    sm = StateMachine()
    for s in PATH[state]:
        sm.to(s, "setup")
    assert sm.state is state
    return sm


def test_the_table_is_the_spec_no_more_no_less() -> None:
    table = {(a, b) for a, outs in ALLOWED.items() for b in outs}
    assert table == {(a, b) for a, b, _ in SPEC}
    assert TERMINAL == {S.FINISHED, S.FAILED, S.PREEMPTED}
    assert StateMachine().state is S.STARTING and not StateMachine().terminal


@pytest.mark.parametrize(("a", "b", "when"), SPEC, ids=[f"{a.name}->{b.name}" for a, b, _ in SPEC])
def test_a_spec_transition_is_taken_logged_and_recorded(a: State, b: State, when: str, caplog) -> None:
    sm = _at(a)
    before = list(sm.history)
    with caplog.at_level(logging.INFO, logger="elastictrain.controller"):
        sm.to(b, when)
    assert sm.state is b and sm.history == before + [(a, b, when)]
    assert f"{a.name} -> {b.name}: {when}" in caplog.text
    assert sm.terminal == (b in TERMINAL)


# moves the spec rules out, each for a reason
ILLEGAL = [
    (S.STARTING, S.FINISHED, "nothing finishes before a generation trained"),
    (S.STARTING, S.RESIZING, "growing needs a generation to grow"),
    (S.STARTING, S.CHECKPOINTING, "no generation holds state to save yet: preemption ends the start"),
    (S.RUNNING, S.PREEMPTED, "a preemption goes through CHECKPOINTING"),
    (S.RUNNING, S.STARTING, "the start happens once"),
    (S.RECOVERING, S.RESIZING, "a recovery grows by forming its generation, not by stopping one"),
    (S.RECOVERING, S.FINISHED, "the last step is reached by a running generation"),
    (S.RECOVERING, S.PREEMPTED, "a preemption goes through CHECKPOINTING"),
    (S.RECOVERING, S.RECOVERING, "staying is no transition (waiting, or a survivor failed as well)"),
    (S.RESIZING, S.PREEMPTED, "a preemption goes through CHECKPOINTING"),
    (S.CHECKPOINTING, S.RUNNING, "a preempted run does not train again"),
    (S.CHECKPOINTING, S.RECOVERING, "a preempted run does not recover"),
    (S.CHECKPOINTING, S.FINISHED, "a preempted run ends PREEMPTED"),
    (S.FINISHED, S.RUNNING, "terminal states are final"),
    (S.FAILED, S.RECOVERING, "terminal states are final"),
    (S.PREEMPTED, S.CHECKPOINTING, "terminal states are final"),
    (S.FINISHED, S.FAILED, "terminal states are final: the first ending stands"),
]


@pytest.mark.parametrize(("a", "b", "why"), ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b, _ in ILLEGAL])
def test_a_move_outside_the_spec_raises_naming_both_and_changes_nothing(a: State, b: State, why: str) -> None:
    sm = _at(a)
    before = list(sm.history)
    with pytest.raises(IllegalTransition) as info:
        sm.to(b, why)
    assert a.name in str(info.value) and b.name in str(info.value) and why in str(info.value)
    assert sm.state is a and sm.history == before


def test_a_preempted_recovery_goes_through_checkpointing() -> None:
    sm = StateMachine()
    for s in (S.RUNNING, S.RECOVERING, S.CHECKPOINTING, S.PREEMPTED):
        sm.to(s, "preempted while recovering")
    assert [(a.name, b.name) for a, b, _ in sm.history] == [
        ("STARTING", "RUNNING"), ("RUNNING", "RECOVERING"), ("RECOVERING", "CHECKPOINTING"),
        ("CHECKPOINTING", "PREEMPTED")]
    assert sm.terminal
