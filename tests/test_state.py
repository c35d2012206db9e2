"""The controller's state machine (elastictrain/controller/state.py): the table is the only way to move."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictrain.controller.state import ALLOWED, TERMINAL, IllegalTransition, State, StateMachine

EDGES = [(a, b) for a, outs in ALLOWED.items() for b in sorted(outs, key=lambda s: s.value)]
ILLEGAL = [(a, b) for a in State for b in State if b not in ALLOWED[a]]


def _machine_at(state: State) -> StateMachine:
    """A machine driven along legal edges (breadth-first from STARTING) to ``state``."""
    paths = {State.STARTING: []}
    frontier = [State.STARTING]
    while frontier:
        nxt = []
        for a in frontier:
            for b in ALLOWED[a]:
                if b not in paths:
                    paths[b] = paths[a] + [b]
                    nxt.append(b)
        frontier = nxt
    sm = StateMachine()
    for s in paths[state]:
        sm.to(s, "setup")
    return sm


def test_table_covers_every_state_and_starts_at_starting() -> None:
    assert set(ALLOWED) == set(State)
    sm = StateMachine()
    assert sm.state is State.STARTING and sm.history == [] and not sm.terminal


def test_every_state_is_reachable() -> None:
    for s in State:
        assert _machine_at(s).state is s


@pytest.mark.parametrize(("a", "b"), EDGES, ids=[f"{a.name}->{b.name}" for a, b in EDGES])
def test_allowed_transition_succeeds_and_is_logged(a: State, b: State, caplog) -> None:
    sm = _machine_at(a)
    before = list(sm.history)
    with caplog.at_level(logging.INFO, logger="elastictrain.controller"):
        sm.to(b, "because of a test")
    assert sm.state is b
    assert sm.history == before + [(a, b, "because of a test")]
    assert f"{a.name} -> {b.name}: because of a test" in caplog.text


@pytest.mark.parametrize(("a", "b"), ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b in ILLEGAL])
def test_illegal_transition_raises_naming_both_states(a: State, b: State) -> None:
    sm = _machine_at(a)
    before = list(sm.history)
    with pytest.raises(IllegalTransition) as info:
        sm.to(b, "why not")
    assert a.name in str(info.value) and b.name in str(info.value) and "why not" in str(info.value)
    assert sm.state is a and sm.history == before  # nothing changed


@pytest.mark.parametrize("terminal", sorted(TERMINAL, key=lambda s: s.value))
def test_terminal_states_have_no_exits(terminal: State) -> None:
    assert ALLOWED[terminal] == frozenset()
    sm = _machine_at(terminal)
    assert sm.terminal
    for s in State:
        with pytest.raises(IllegalTransition):
            sm.to(s, "after the end")


def test_non_terminal_states_can_always_end() -> None:
    """From every live state some path reaches a terminal state (no trap states)."""
    for start in set(State) - TERMINAL:
        seen, todo = {start}, [start]
        while todo:
            for b in ALLOWED[todo.pop()]:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        assert seen & TERMINAL, start
    assert State.FAILED in ALLOWED[State.RUNNING] and State.FAILED in ALLOWED[State.RECOVERING]


def test_preemption_goes_through_checkpointing() -> None:
    sm = StateMachine()
    for s in (State.RUNNING, State.CHECKPOINTING, State.PREEMPTED):
        sm.to(s, "preempted")
    assert [(a.name, b.name) for a, b, _ in sm.history] == [
        ("STARTING", "RUNNING"), ("RUNNING", "CHECKPOINTING"), ("CHECKPOINTING", "PREEMPTED")]
    with pytest.raises(IllegalTransition):
        StateMachine().to(State.FINISHED, "skipping RUNNING")


@given(st.lists(st.sampled_from(list(State)), max_size=30))
def test_random_walks_follow_the_table(targets: list[State]) -> None:
    sm = StateMachine()
    for t in targets:
        prev, n = sm.state, len(sm.history)
        if t in ALLOWED[prev]:
            sm.to(t, "walk")
            assert sm.state is t and sm.history[-1] == (prev, t, "walk")
        else:
            with pytest.raises(IllegalTransition):
                sm.to(t, "walk")
            assert sm.state is prev and len(sm.history) == n
    for a, b, _ in sm.history:
        assert b in ALLOWED[a]
    if sm.history:
        assert sm.history[0][0] is State.STARTING
        assert all(x[1] is y[0] for x, y in zip(sm.history, sm.history[1:]))
