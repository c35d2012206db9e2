"""The Ray variant of the simulation: the real :class:`~elastictrain.controller.controller.Controller` over
Ray (:class:`~elastictrain.controller.runtime.RayRuntime`, the production worker group's kill, death and
set-up paths) driving lightweight actors (:mod:`elastictrain.sim.ray_actors`: ``num_cpus=0``, no torch)
that speak the worker protocol. A fault is a real SIGKILL of an actor's process by its pid, at a step.

:class:`ActorGroup` is the production :class:`~elastictrain.controller.group.WorkerGroup` with another actor
class to start and no placement groups (the actors hold no resources); every other path is the group's own.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from elastictrain.config import JobConfig
from elastictrain.controller.controller import Controller
from elastictrain.controller.group import Slot, SlotState, WorkerGroup
from elastictrain.events import EventLog
from elastictrain.sim.phases import Phases
from elastictrain.sim.ray_actors import sim_actor_class
from elastictrain.sim.scenarios import sim_config
from elastictrain.task import builtin_task


class _Counted:
    """An actor method whose calls the group counts (by method name)."""

    __slots__ = ("method", "name", "calls")

    def __init__(self, method: Any, name: str, calls: Counter[str]) -> None:
        self.method, self.name, self.calls = method, name, calls

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.name] += 1
        return self.method.remote(*args, **kwargs)


class _Join:
    __slots__ = ("actor", "calls")

    def __init__(self, actor: Any, calls: Counter[str]) -> None:
        self.actor, self.calls = actor, calls

    def remote(self, generation: int, rank: int, world_size: int, host: str, port: int, layout: Any = None,
               restore: Any = None, sync_src: int | None = None) -> Any:
        self.calls["join"] += 1
        return self.actor.join.remote(generation, rank, world_size, host, port, getattr(layout, "accum", 1),
                                      restore is not None, sync_src)


class _Handle:
    """An actor handle that sends ``join`` what a simulated actor needs of the layout and the restore
    sources (the accumulation; whether to report a step) instead of the objects: unpickling them would
    import elastictrain.parallel and elastictrain.data, hence torch, in the actor. Every other call is the
    handle's own. Every call the controller makes is counted in ``calls`` (by method name)."""

    def __init__(self, actor: Any, calls: Counter[str]) -> None:
        self.actor, self.calls = actor, calls
        self.join = _Join(actor, calls)

    def __getattr__(self, name: str) -> Any:
        return _Counted(getattr(self.actor, name), name, self.calls)


class ActorGroup(WorkerGroup):
    """A worker group of :class:`~elastictrain.sim.ray_actors.SimActor` actors, one per slot, placed by Ray
    anywhere (``num_cpus=0``: no placement groups, every slot is placed)."""

    def __init__(self, config: JobConfig, step_s: float,  # noqa: D107 - no placement groups to make
                 degraded_step_s: float | None = None) -> None:
        self.config, self.step_s, self.degraded_step_s = config, step_s, degraded_step_s
        self.calls: Counter[str] = Counter()  # the controller's calls on the actors, by method
        self.slots = [Slot(i) for i in range(config.workers.max + config.workers.spares)]
        self._actor_cls = sim_actor_class()
        self._pgs: list[Any] = []

    def spawn(self, index: int) -> Slot:
        slot = self.slots[index]
        slot.from_standby = False
        slot.actor = _Handle(self._actor_cls.options(num_cpus=0, max_restarts=0, max_task_retries=0).remote(
            self.step_s, self.config.timeouts.collective_s, self.config.workers.max, self.degraded_step_s), self.calls)
        slot.setup_ref = slot.actor.setup.remote(index)
        slot.state, slot.has_state, slot.rank, slot.info = SlotState.STARTING, False, None, {}
        slot.started_at = time.time()
        slot.incarnation += 1
        return slot

    def kill(self, slot: Slot) -> None:
        if isinstance(slot.actor, _Handle):  # ray.kill takes the handle itself
            slot.actor = slot.actor.actor
        super().kill(slot)

    def placed(self, slot: Slot) -> bool:
        return True

    def shortfall(self) -> str:
        return "nothing: simulated actors ask for no resources"

    def replace_lost_placement(self, index: int) -> bool:
        return False


def _pids(group: ActorGroup) -> list[int]:
    return [s.info["pid"] for s in group.slots if s.state is SlotState.MEMBER and "pid" in s.info]


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far, from /proc (on this node)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class RayRunResult:
    actors: int
    state: str
    steps: int
    lost_steps: int
    worlds: list[int]
    torch_in_actor: bool  # asked of every actor at the first step (True also when it could not be asked)
    kill_to_next_step_s: float | None = None  # from the SIGKILL to the end of the next generation's first step
    kill_to_generation_s: float | None = None   # from the SIGKILL to the next generation's start
    extra: dict[str, Any] = field(default_factory=dict)


def run_ray_actors(actors: int, *, steps: int = 60, step_s: float = 0.05, kill_at: int | None = 20,
                   kill_slot: int | None = None, degraded_step_s: float | None = None) -> RayRunResult:
    """Run the real controller over ``actors`` simulated actors (Ray must be initialized) and, at step
    ``kill_at`` (None: no fault), SIGKILL the process of slot ``kill_slot`` (default: one in the middle,
    not rank 0's). ``degraded_step_s``: the step time of a generation below ``actors`` (None: ``step_s``),
    so the replacement's start falls inside the degraded generation however slow it is, and the grow-back
    cuts those steps short (a test's bound, not a timing window); figures are taken without it."""
    # the start waits for every actor: Ray starts their processes a few at a time (one per CPU at once)
    config = sim_config(actors, steps, step_s, restart_grace_s=max(60.0, 5.0 * actors),
                        slowest_step_s=degraded_step_s)
    victim = actors // 2 + 1 if kill_slot is None else kill_slot
    with tempfile.TemporaryDirectory() as tmp:
        events = EventLog(Path(tmp), console=None)
        group = ActorGroup(config, step_s, degraded_step_s)
        marks: dict[str, float] = {}
        checked: dict[str, Any] = {}
        phases = Phases()

        def on_event(r: dict[str, Any]) -> None:
            now = time.time()
            if r["event"] == "step" and "torch" not in checked:  # once every actor runs this module's code
                live = [s.actor.actor for s in group.slots if isinstance(s.actor, _Handle)]
                checked["torch"] = any(ray.get([a.imported.remote("torch") for a in live], timeout=60))
            if r["event"] == "step" and "steady" not in marks and r["step"] >= 5:
                marks["steady"], marks["steady_cpu"] = now, _cpu_s(_pids(group))
            if r["event"] == "step" and kill_at is not None and r["step"] >= kill_at and "kill" not in marks:
                if "steady" in marks:  # what the actors took while they trained, before the fault
                    busy = (_cpu_s(_pids(group)) - marks["steady_cpu"]) / max(1e-9, now - marks["steady"])
                    checked["actors_busy"] = round(busy, 3)
                slot = group.slots[victim]
                marks["kill"] = time.time()
                os.kill(slot.info["pid"], signal.SIGKILL)
                phases.killed(slot.info["pid"], c.monitor.run_ref_of.get(victim), marks["kill"])
            elif r["event"] == "failure" and "kill" in marks and "failure" not in marks:
                marks["failure"] = now
                phases.mark("failure_event", now)
            elif r["event"] == "generation_started" and "kill" in marks and "formed" not in marks:
                marks["formed"] = now
                phases.mark("generation_started", now)
            elif r["event"] == "resized" and "kill" in marks and r["new_world_size"] == actors:
                marks.setdefault("growth_resized", now)
            elif r["event"] == "step" and "formed" in marks and "next" not in marks:
                marks["next"], marks["next_seen"] = r["finished_at"], now
                phases.mark("next_step_end", r["finished_at"])
                phases.mark("next_step_seen", now)

        events.listeners.append(on_event)
        c = Controller(config, builtin_task(config), events, group=group)
        phases.instrument(c)
        spawn, setup_done = group.spawn, c._on_setup_done

        def spawned(index: int) -> Slot:  # the replacement's start and set-up, for the growth back
            if "kill" in marks and index == victim:
                marks.setdefault("growth_spawned", time.time())
            return spawn(index)

        def set_up(slot: Slot) -> None:
            if "growth_spawned" in marks and slot.index == victim:
                marks.setdefault("growth_ready", time.time())
            setup_done(slot)

        group.spawn, c._on_setup_done = spawned, set_up
        try:
            c.run()
            summary = c.summary()
        finally:
            phases.close()
            group.shutdown()
            events.close()
    out = RayRunResult(actors, summary["state"], summary["final_step"], summary["lost_steps"],
                       [h["world_size"] for h in summary["world_size_history"]], checked.get("torch", True))
    out.extra["reason"] = summary.get("reason")
    out.extra["calls"] = dict(group.calls)
    out.extra["actors_cpu_per_s"] = checked.get("actors_busy")  # CPU-s per s of all actors, steady state
    out.extra["phases"] = phases.relative()
    out.extra["driver_cpu_ms"] = {k: round(v, 2) for k, v in phases.cpu_ms.items()}
    out.extra["growth"] = {k: round(v - marks["kill"], 3) for k, v in marks.items() if k.startswith("growth_")}
    if "next" in marks:
        out.kill_to_next_step_s = round(marks["next"] - marks["kill"], 4)
        out.extra["kill_to_next_step_seen_s"] = round(marks["next_seen"] - marks["kill"], 4)
    if "failure" in marks:
        out.extra["kill_to_detect_s"] = round(marks["failure"] - marks["kill"], 4)
    if "formed" in marks:
        out.kill_to_generation_s = round(marks["formed"] - marks["kill"], 4)
    return out
