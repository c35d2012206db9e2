"""Scenarios at N simulated ranks, each driving the real controller to its end, and what each measures:
driver CPU per training step, events.jsonl bytes per step, memory, and the time from the injected fault
to the controller's decision.

A scenario's numbers must equal what the policy promises (tests/test_sim.py): the steps run, the steps
lost, and the world-size history (:func:`promised_worlds`).
"""

from __future__ import annotations

import logging
import math
import random
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.config import JobConfig, build_config
from elastictrain.controller import policy
from elastictrain.controller.controller import Controller
from elastictrain.events import EventLog
from elastictrain.parallel.layout import spec_from_config
from elastictrain.sim import machine
from elastictrain.sim.group import SimGroup
from elastictrain.sim.world import Fault, SimWorld
from elastictrain.task import builtin_task

SCENARIOS = ("steady", "kill", "node", "hang", "preempt", "lose2pct")
FAULT_STEP = 50
BACK_STEP = 75  # a lost node comes back (growth back)
DECISION_MARKS = ("recovery source:", "-> CHECKPOINTING")  # the controller's lines that say it decided


def sim_config(ranks: int, steps: int, step_s: float, *, restart_grace_s: float = 60, memory_every_steps: int = 0,
               slowest_step_s: float | None = None, **recovery: Any) -> JobConfig:
    """A job for ``ranks`` simulated workers: ddp, one sample per rank and step (every world size that
    divides the global batch is valid: ``ranks`` and many sizes below it), timeouts scaled to the simulated
    step time (``slowest_step_s``: the slowest step a run paces, when slower than ``step_s``).
    ``restart_grace_s``: also how long the start waits for every worker (the Ray variant's actor processes
    start a few at a time)."""
    return build_config({
        "name": "sim",
        "train": {"steps": steps, "seed": 0, "global_batch": math.lcm(ranks, 720720),
                  "micro_batch": 1, "log_every": 10 ** 9},
        "workers": {"min": 1, "max": ranks, "standby": False},
        # the peer memory tier: off unless asked (the scale figures are without it); on, the controller
        # starts its keepers through the runtime, and the simulated world's keepers (sim/world.py SimKeeper)
        # take their budget and answer their catalogs -- empty: simulated workers hold no state
        "checkpoint": {"memory_every_steps": memory_every_steps},
        "timeouts": {"collective_s": 2, "step_watchdog_cap_s": 5,
                     "watchdog_floor_s": max(0.5, 10 * max(step_s, slowest_step_s or 0.0)),
                     "poll_s": 10, "restart_grace_s": restart_grace_s},
        "recovery": {"max_failures": 10 ** 6, "max_failures_per_rank": 10, **recovery},
    })


def promised_worlds(config: JobConfig, available: list[int]) -> list[int]:
    """The world sizes the policy promises for each count of available workers, in order."""
    spec = spec_from_config(config)
    w, tr = config.workers, config.train
    out = []
    for n in available:
        d = policy.decide_membership(available=n, current=w.max, mode=config.recovery.mode, min_workers=w.min,
                                     max_workers=w.max, global_batch=tr.global_batch, micro_batch=tr.micro_batch,
                                     waiting_since=None, now=0.0, wait_limit_s=1.0, spec=spec)
        out.append(d.world_size)
    return out


@dataclass
class Result:
    scenario: str
    ranks: int
    state: str
    steps: int
    lost_steps: int
    worlds: list[int]
    driver_cpu_per_step_s: float
    events_bytes_per_step: float
    peak_mem_mb: float
    fault_to_detect_s: float | None = None
    fault_to_decision_s: float | None = None
    growth_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _faults(scenario: str, ranks: int, world: SimWorld, rng: random.Random) -> list[Fault]:
    mid = ranks // 2 + 3  # a rank inside a node, not rank 0
    node = world.node_of(mid)
    nodes = sorted({world.node_of(s) for s in range(ranks)})

    def crash(slots: list[int]) -> Callable[[SimWorld, float], None]:
        return lambda w, t: [w.crash(w.workers[s], t) for s in slots]

    if scenario == "kill":
        return [Fault(FAULT_STEP, "kill", crash([mid]))]
    if scenario == "node":
        return [Fault(FAULT_STEP, "node", lambda w, t: w.lose_node(node, t)),
                Fault(BACK_STEP, "back", lambda w, t: w.node_back(node, t))]
    if scenario == "hang":
        return [Fault(FAULT_STEP, "hang", lambda w, t: w.stop(w.workers[mid], t))]
    if scenario == "preempt":
        hit = rng.sample(nodes, max(1, len(nodes) // 20))
        return [Fault(FAULT_STEP, "preempt", lambda w, t: w.draining.update(hit))]
    if scenario == "lose2pct":
        return [Fault(FAULT_STEP, "lose2pct", crash(rng.sample(range(1, ranks), max(1, ranks // 50))))]
    return []


def run_scenario(scenario: str, ranks: int, *, steps: int = 100, step_s: float = 0.05, memory: bool = False,
                 seed: int = 0, prebuilt_standby: bool = False) -> Result:
    """Run one scenario to the controller's end and measure it (see the module docstring).
    ``prebuilt_standby``: every replacement runs in a standby whose set-up ahead is done (``SimGroup``)."""
    config = sim_config(ranks, steps, step_s)
    world = SimWorld(step_s=step_s, setup_s=5 * step_s)
    world.faults = _faults(scenario, ranks, world, random.Random(seed))
    with tempfile.TemporaryDirectory() as tmp:
        events = EventLog(Path(tmp), console=None)
        seen: list[tuple[str, float, dict[str, Any]]] = []
        events.listeners.append(lambda r: seen.append((r["event"], time.time(), r)))
        group = SimGroup(world, config.workers.max + config.workers.spares, prebuilt_standby=prebuilt_standby)
        c = Controller(config, builtin_task(config), events, group=group)
        marks: list[tuple[float, float, int, int]] = []  # cpu, wall, events bytes, step

        def on_step(r: dict[str, Any]) -> None:
            # steady state as the driver processes it: from its step-5 event to its last one before the
            # fault (a driver that falls behind processes the same steps later, not fewer of them) -- and
            # before the fault happened: steps 41-49 reach the driver with rank 0's last records, taken
            # after the fault while it already handles it (O(N): at 10,000 ranks it would count as steady CPU)
            if (r["event"] == "step" and 5 <= r["step"] < FAULT_STEP and r.get("complete", True)
                    and all(f.at is None for f in world.faults)):
                marks.append((time.thread_time(), time.time(), events.path.stat().st_size, r["step"]))

        events.listeners.append(on_step)
        said = _Said(world)
        if memory:
            tracemalloc.start()
        try:
            with said:
                c.run()
        finally:
            peak = tracemalloc.get_traced_memory()[1] / 2 ** 20 if memory else 0.0
            if memory:
                tracemalloc.stop()
            events.close()
        summary = c.summary()
    return _result(scenario, ranks, c, summary, world, seen, marks, peak, said.lines)


class _Said(logging.Handler):
    """The controller's log lines while a scenario runs, with the wall time and the driver's own clock
    (:meth:`SimWorld.own_clock`): its decisions are read off them ("controller RUNNING -> RECOVERING",
    "recovery source: ...")."""

    def __init__(self, world: SimWorld) -> None:
        super().__init__(logging.INFO)
        self.world, self.lines = world, []
        self.log = logging.getLogger("elastictrain.controller")

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        # the machine's counters at a decision line: what it did in the fault -> decision window
        snap = machine.snapshot() if any(m in msg for m in DECISION_MARKS) else None
        self.lines.append((time.time(), self.world.own_clock(), msg, snap))

    def __enter__(self) -> _Said:
        self.level, self.propagate = self.log.level, self.log.propagate
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.log.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.log.removeHandler(self)
        self.log.setLevel(self.level)
        self.log.propagate = self.propagate


def _after_fault(lines: list[tuple[float, float, str, Any]], fault: Fault, *marks: str,
                 start: tuple[float, float] | None = None) -> tuple[float, float, Any] | None:
    """From ``fault`` (or from ``start``: (wall, own clock)) to the first controller line holding one of
    ``marks``: (on a core of its own, wall, the machine's counters at that line or None). On a core of its
    own: the driver's CPU plus its waits for the cluster -- what it takes whatever else this machine runs;
    wall: as measured here (a loaded machine makes it longer)."""
    at, clock = (fault.at, fault.apply_clock) if start is None else start
    for t, own, msg, snap in lines:
        if t >= at and any(m in msg for m in marks):
            return round(own - clock, 4), round(t - at, 4), snap
    return None


def _result(scenario: str, ranks: int, c: Controller, summary: dict[str, Any], world: SimWorld,
            seen: list[tuple[str, float, dict[str, Any]]], marks: list[Any], peak: float,
            lines: list[tuple[float, float, str, Any]]) -> Result:
    if not marks:  # the driver processed no step of the window (it fell that far behind)
        marks = [(0.0, 0.0, 0, 0)]
    (c0, t0, b0, s0), (c1, t1, b1, s1) = marks[0], marks[-1]
    steps = max(1, s1 - s0)
    cpu = c1 - c0
    fault = next((f for f in world.faults if f.label != "back"), None)
    out = Result(scenario, ranks, summary["state"], summary["final_step"], summary["lost_steps"],
                 [h["world_size"] for h in summary["world_size_history"]],
                 round(cpu / steps, 7), round((b1 - b0) / steps, 1), round(peak, 1))
    out.extra["calls"] = dict(world.calls)
    out.extra["driver_busy"] = round(cpu / max(1e-9, t1 - t0), 3)  # ~1: the driver cannot keep up
    if fault is not None and fault.at is not None:
        detect = _after_fault(lines, fault, "-> RECOVERING", "-> CHECKPOINTING")
        # a drain notice waits for the controller's next check of the watcher (once per poll interval, on
        # purpose: see the module docstring); its decision is timed from the check that read it
        notice = world.notice_read if fault.label == "preempt" else None
        decide = _after_fault(lines, fault, *DECISION_MARKS, start=notice)
        whole = _after_fault(lines, fault, *DECISION_MARKS)  # from the fault itself
        if whole is not None and whole[2] is not None and fault.machine is not None:
            out.extra["decision_window"] = machine.window(fault.machine, whole[2])
        if notice is not None:
            out.extra["fault_to_notice_s"] = round(notice[1] - fault.apply_clock, 4)
        out.fault_to_detect_s = None if detect is None else detect[0]
        out.fault_to_decision_s = None if decide is None else decide[0]
        out.extra["fault_to_decision_wall_s"] = None if whole is None else whole[1]
        formed = next((t for e, t, _ in seen if t >= fault.at and e in ("generation_started", "preempted")), None)
        out.extra["fault_to_generation_s"] = None if formed is None else round(formed - fault.at, 4)
    back = next((f for f in world.faults if f.label == "back"), None)
    if back is not None and back.at is not None:
        grown = next((t for e, t, r in seen if t >= back.at and e == "generation_started"
                      and r["world_size"] == out.worlds[0]), None)
        out.growth_s = None if grown is None else round(grown - back.at, 4)
    return out
