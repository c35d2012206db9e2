"""The controller's state machine driven one ``step()`` at a time against a fake worker group (light Ray
actors that follow a script instead of training), like Ray Train V2's controller tests: start-up failure,
FAILED, and a preemption that arrives while RECOVERING."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from elastictrain import build_config, worker_reply
from elastictrain.controller.controller import Controller
from elastictrain.controller.group import Slot, SlotState, WorkerGroup, describe_remote_error
from elastictrain.controller.state import State
from elastictrain.events import EventLog, read_events
from elastictrain.task import builtin_task
from tests.conftest import job


@ray.remote(max_concurrency=4, concurrency_groups={"reset": 1})
class ScriptedWorker:
    """Answers the controller's calls like a worker; ``script`` says how set-up and ``run`` go."""

    def __init__(self, slot: int, script: dict[str, Any]) -> None:
        self._start(slot, script)

    def _start(self, slot: int, script: dict[str, Any]) -> None:
        self.slot, self.script, self.step = slot, script, 0
        self.released = threading.Event()  # ``script["hold_run"]``: ``run`` answers once released

    @ray.method(concurrency_group="reset")  # its own thread: the default ones may be held in ``run``
    def reset(self, slot: int, script: dict[str, Any]) -> None:
        """Serve another slot and script, as a new actor would (tests/test_controller_paths.py parks them)."""
        held = self.released
        self._start(slot, script)
        held.set()  # a ``run`` an earlier controller left held answers now, to nobody

    def setup(self) -> dict[str, Any]:
        # a fresh process's set-up takes seconds, a warm (pooled) one's a fraction of one: the order in which
        # the slots' set-ups end is part of what a test scripts
        time.sleep(self.script.get("setup_s", 0.0))
        if self.script.get("setup_error"):
            raise FileNotFoundError(self.script["setup_error"])
        return {"slot": self.slot, "pid": None, "node_id": "fake", "ip": "fake", "setup_s": 0.0}

    def open_store(self, generation: int) -> tuple[str, int]:
        return "127.0.0.1", 0

    def join(self, generation: int, rank: int, world: int, host: str, port: int, layout: Any = None,
             restore: Any = None, sync_src: int | None = None) -> int | None:
        if self.script.get("join_error"):  # e.g. a joiner whose restore fails: its own error
            raise ValueError(self.script["join_error"])
        return None if restore is None and sync_src is None else self.step

    def abort_group(self, generation: int | None = None, sever: bool = False) -> str:
        return "noop"

    def hold_snapshot(self, expect: Any = None) -> Any:
        """Serves what ``script["holds"]`` says its runner holds: (generation, rank, step)."""
        from elastictrain.checkpoint.memory_dcp import SnapshotMeta

        if self.script.get("hold_error"):
            raise RuntimeError(self.script["hold_error"])
        gen, rank, step = self.script.get("holds") or expect
        return SnapshotMeta(rank, step, {}, frozenset(), {}, 0, gen)

    def own_snapshots(self) -> list:
        return []

    def sync(self, src: int) -> int:
        return self.step

    def run(self, target: int, joined: Any = None) -> bytes:
        status = self.script.get("run", "done")
        if status == "exit":  # the process dies mid-step
            os._exit(1)
        if self.script.get("hold_run") and not self.released.wait(timeout=120):
            raise TimeoutError("the test never released this run")
        return worker_reply.pack(status, self.step, self.script.get("error") if status != "done" else None,
                               self.slot)

    def release(self) -> None:
        """Let a held ``run`` answer (a survivor whose step fails once its peer's death is known)."""
        self.released.set()

    def poll(self, after: int | None = None) -> dict[str, Any]:
        return {"slot": self.slot, "status": "joined", "step": self.step, "phase": "idle",
                "phase_since": time.time(), "records": [], "ckpt": [], "now": time.time()}

    def request_stop(self, generation: int | None = None) -> None:
        pass

    def flush_checkpoints(self) -> list:
        return []

    def digest(self) -> dict[str, Any]:
        return {"step": self.step, "sha256": "0" * 64}

    def parameters(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


# ScriptedWorker actors a FakeGroup killed, served to the next spawn of this module's tests (:func:`_scripted`):
# each Ray actor is a process of its own, and the session Ray's processes import what it preloads (torch and
# the worker module, elastictrain/local_ray.py: seconds of CPU each), which a scripted fake never uses. Reused,
# the file starts a few processes instead of one per spawn (two or more per test). None (another module
# importing these helpers, tests/test_standby_join.py): a killed actor is killed.
_PARKED: list[Any] | None = None


def _scripted(index: int, script: dict[str, Any]) -> Any:
    """A ScriptedWorker for slot ``index`` following ``script``: a parked one reset, else a new one."""
    while _PARKED:
        actor = _PARKED.pop()
        try:
            ray.get(actor.reset.remote(index, script), timeout=120)  # a bound on a hang, not a timing
            return actor
        except Exception:  # noqa: BLE001 - it died (a script's "exit"), or its Ray went away
            continue
    return ScriptedWorker.options(num_cpus=0).remote(index, script)


@pytest.fixture(autouse=True, scope="module")
def _parked_actors():
    """Parking on for this module's tests; the parked actors killed after its last."""
    global _PARKED
    _PARKED = []
    yield
    parked, _PARKED = _PARKED, None
    for actor in parked:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class FakeGroup(WorkerGroup):
    """WorkerGroup's interface over ScriptedWorker actors; no placement groups, no processes to kill."""

    def __init__(self, n: int, scripts: dict[int, dict[str, Any]]) -> None:  # noqa: D107 - no super()
        self.slots = [Slot(i) for i in range(n)]
        self.scripts = scripts
        self.spawned: list[int] = []

    def spawn(self, index: int) -> Slot:
        slot = self.slots[index]
        slot.actor = _scripted(index, self.scripts.get(index, {}))
        slot.setup_ref = slot.actor.setup.remote()
        slot.state, slot.has_state, slot.rank, slot.info = SlotState.STARTING, False, None, {}
        self.spawned.append(index)
        return slot

    def collect_ready(self, timeout: float = 0.0) -> list[Slot]:
        pending = {s.setup_ref: s for s in self.slots if s.state is SlotState.STARTING}
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout) if pending else ([], [])
        for ref in done:
            slot = pending[ref]
            try:
                slot.info, slot.state = ray.get(ref), SlotState.READY
            except Exception as e:  # noqa: BLE001
                slot.info = {"error": describe_remote_error(e)}
                self.kill(slot)
        return [pending[r] for r in done]

    def kill(self, slot: Slot) -> None:
        if slot.actor is not None and _PARKED is not None:  # parked for the next spawn: a fake holds nothing
            _PARKED.append(slot.actor)                       # of its slot's run
        elif slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor, slot.setup_ref, slot.state, slot.rank, slot.has_state = None, None, SlotState.DEAD, None, False

    def process_gone(self, slot: Slot) -> bool:
        return False

    def start_first_standby(self) -> None:  # scripted actors: no process to start ahead
        pass

    def placed(self, slot: Slot) -> bool:
        return True

    def replace_lost_placement(self, index: int) -> bool:  # fake workers report node "fake": never alive
        return False

    def shortfall(self) -> str:
        return "nothing missing (fake)"

    def shutdown(self) -> None:
        for slot in self.slots:
            self.kill(slot)


def _step_until(c: Controller, done: Any, states: list[State] | None = None, timeout: float = 180.0) -> None:
    """``c.step()`` until ``done()`` holds (a bound on a hang, not a timing: a step waits at most a poll
    interval, so a count of steps was a wall-clock window that a loaded machine's late actor death or
    respawn outlasted). ``states`` collects the state after each step."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not there within {timeout:g} s: {c.sm.history}"
        c.step()
        if states is not None:
            states.append(c.sm.state)


def _controller(tmp_path: Path, scripts: dict[int, dict[str, Any]], **sections: Any) -> tuple[Controller, FakeGroup]:
    config = build_config(job(**sections))
    group = FakeGroup(config.workers.max + config.workers.spares, scripts)
    events = EventLog(tmp_path, console=None)
    return Controller(config, builtin_task(config), events, group=group), group


def test_startup_failure_of_every_worker_fails_once(tmp_path, ray_local) -> None:
    c, group = _controller(tmp_path, {0: {"setup_error": "x.parquet"}, 1: {"setup_error": "x.parquet"}})
    c.step()  # STARTING: both set-ups fail the same way -> FAILED, no respawn
    assert c.sm.state is State.FAILED and c.exit_code == 1
    assert "every worker (2) failed during set-up" in c.final_error and "x.parquet" in c.final_error
    # no respawn: a slot whose first set-up failed waits for the other's (its identical error decides)
    assert group.spawned.count(0) == 1 and group.spawned.count(1) == 1, group.spawned
    c._fail("a second ending")  # terminal states are final: no IllegalTransition, the first reason stands
    assert c.sm.state is State.FAILED and "x.parquet" in c.final_error
    assert [e["event"] for e in read_events(tmp_path)].count("run_failed") == 1
    group.shutdown()


def test_a_set_up_failure_is_not_respawned_while_another_first_set_up_is_in_flight(tmp_path, ray_local) -> None:
    """Slot 0's set-up fails at once (a warm process), slot 1's the same way 3 s later (a fresh one): slot 0
    is not respawned before slot 1's outcome is known, so the run ends once with each slot charged once
    (before: slot 0 was respawned and failed again while slot 1 was still setting up, [0, 0, 1] in a quiet
    full suite; here it loops until the crash-loop bound)."""
    scripts = {0: {"setup_error": "x.parquet"}, 1: {"setup_error": "x.parquet", "setup_s": 3.0}}
    c, group = _controller(tmp_path, scripts)
    c.step()  # STARTING: both set-ups fail the same way -> FAILED
    assert c.sm.state is State.FAILED and "every worker (2) failed during set-up" in c.final_error, c.final_error
    assert group.spawned.count(0) == 1 and group.spawned.count(1) == 1, group.spawned
    assert sorted(e["slot"] for e in read_events(tmp_path) if e["event"] == "failure") == [0, 1]
    group.shutdown()


def test_own_errors_in_a_row_fail_the_run_as_a_crash_loop(tmp_path, ray_local) -> None:
    scripts = {1: {"run": "error", "error": "ValueError: bad batch"}}
    c, group = _controller(tmp_path, scripts, recovery={"max_failures_per_rank": 1, "mode": "strict"})
    states: list[State] = []
    _step_until(c, lambda: c.sm.terminal, states)
    assert c.sm.state is State.FAILED, states
    assert "crash loop" in c.final_error and "ValueError: bad batch" in c.final_error
    assert State.RECOVERING in states
    group.shutdown()


def test_preempted_while_recovering_checkpoints_and_exits_75(tmp_path, ray_local) -> None:
    c, group = _controller(tmp_path, {1: {"run": "error", "error": "ValueError: boom"}})
    c.step()
    assert c.sm.state is State.RUNNING
    _step_until(c, lambda: c.sm.state is State.RECOVERING)
    c.request_preemption("SIGTERM during recovery")
    _step_until(c, lambda: c.sm.terminal)
    assert c.sm.state is State.PREEMPTED and c.exit_code == 75
    path = [b for _, b, _ in c.sm.history]
    assert path[-2:] == [State.CHECKPOINTING, State.PREEMPTED], path
    names = [e["event"] for e in read_events(tmp_path)]
    assert "failure" in names and "preempted" in names
    group.shutdown()


def test_the_monitor_is_an_object_the_controller_owns_not_a_mixin(tmp_path, ray_local) -> None:
    """WorkerMonitor is composed: built from what it observes with, it holds no reference to the
    controller, and the controller's state (the machine, the budget, the recovery) is not in it."""
    from elastictrain.controller.monitor import WorkerMonitor

    c, group = _controller(tmp_path, {})
    assert not isinstance(c, WorkerMonitor) and isinstance(c.monitor, WorkerMonitor)
    assert all(v is not c for v in vars(c.monitor).values())
    assert not any(hasattr(c.monitor, n) for n in ("sm", "budget", "open_failure", "_fail", "request_preemption"))
    c.step()  # STARTING -> RUNNING: the generation it watches is the controller's
    assert c.sm.state is State.RUNNING
    assert (c.monitor.generation, c.monitor.world_size) == (c.generation, c.world_size) == (0, 2)
    group.shutdown()


def test_replacement_starts_after_the_survivors_regroup_not_beside_their_recovery(tmp_path, ray_local) -> None:
    """Elastic: a failed worker's replacement is started once the survivors' next generation is formed --
    a starting worker takes a core for seconds and would slow the recovery it cannot join. (Strict mode,
    which must wait for it, starts it at once: test_own_errors_in_a_row_fail_the_run_as_a_crash_loop.)"""
    # slot 1's process dies in its step; slot 0's step fails on the dead peer once the controller knows of
    # the death (released at RECOVERING: an event, not a second's sleep that a loaded machine outlasts)
    c, group = _controller(tmp_path, {0: {"run": "peer_failed", "hold_run": True}, 1: {"run": "exit"}},
                           workers={"min": 1, "max": 2})
    order: list[tuple[str, int]] = []
    spawn, form = group.spawn, c._form_generation

    def spawn_logged(index: int) -> Slot:
        order.append(("spawn", index))
        return spawn(index)

    def form_logged(chosen: list[Slot], **kw: Any) -> bool:
        order.append(("formed", len(chosen)))
        return form(chosen, **kw)

    group.spawn, c._form_generation = spawn_logged, form_logged
    c.step()  # STARTING -> RUNNING at world 2
    assert c.sm.state is State.RUNNING and c.world_size == 2
    _step_until(c, lambda: c.sm.state is State.RECOVERING)
    group.slots[0].actor.release.remote()  # the death is known: the survivor's step fails now
    before = len(order)
    c.step()  # RECOVERING: the failure is accounted, the survivor regroups alone, then the replacement starts
    assert c.world_size == 1, (order, c.sm.history)
    assert order[before:] == [("formed", 1), ("spawn", 1)], order
    group.shutdown()


def test_a_lost_node_is_one_failure_of_the_node_not_one_per_worker(tmp_path, ray_local) -> None:
    """An 8-worker node lost twice within the window is two failures for the budget (default
    recovery.max_failures=10), not 16 that end the run; a worker of a lost node found by a later recovery
    is not counted again. Every lost worker still gets its own ``failure`` event (#21 item 8)."""
    from elastictrain.controller.detect import Failure
    from elastictrain.controller.kinds import FailureKind

    c, group = _controller(tmp_path, {}, workers={"min": 1, "max": 16}, train={"global_batch": 16, "micro_batch": 1})
    now = time.time()

    def lost(node: str, slots: range) -> list[tuple[Failure, FailureKind, str]]:
        return [(Failure(i, i, FailureKind.PROCESS_DIED, "worker process died", now, now, 30, 30, 0),
                 FailureKind.NODE_LOST, node)
                for i in slots]

    c._account_failures(lost("node-a", range(0, 8)))
    c._account_failures(lost("node-b", range(8, 14)) + lost("node-a", range(14, 16)))  # a straggler of node-a
    assert not c.sm.terminal, c.final_error
    assert [(r.kind, r.node) for r in c.budget.log] == [("node_lost", "node-a"), ("node_lost", "node-b")]
    assert "lost with 8 workers" in c.budget.log[0].reason
    events = [e for e in read_events(tmp_path) if e["event"] == "failure"]
    assert len(events) == 16 and c.ledger.failures == 16  # each lost worker is reported
    group.shutdown()


def test_a_rendezvous_error_is_charged_to_the_member_that_raised_it(tmp_path, ray_local) -> None:
    """Every member still answers, one member's join raises its own error: that member is the failure,
    quoted -- not the first chosen member, a healthy one (#21 item 6)."""
    c, group = _controller(tmp_path, {1: {"join_error": "CursorError: the snapshot's data order differs"}},
                           workers={"min": 2, "max": 2})
    c.step()  # STARTING: slot 1's join fails
    assert c.sm.state is State.RECOVERING, c.sm.history
    c.step()  # RECOVERING: the failed member is killed and accounted
    failures = [e for e in read_events(tmp_path) if e["event"] == "failure"]
    assert failures, c.sm.history
    first = failures[0]
    assert (first["slot"], first["kind"]) == (1, "exception"), failures
    assert "data order differs" in first["reason"] and "rendezvous of generation 0" in first["reason"]
    assert all(f["slot"] == 1 for f in failures), failures
    group.shutdown()


def _sharded_after_start(tmp_path: Path, scripts: dict[int, dict[str, Any]],
                         **sections: Any) -> tuple[Controller, FakeGroup]:
    """An fsdp controller whose generation 0 (two members) stands, both survivors at step 5."""
    c, group = _controller(tmp_path, scripts, parallel={"plan": "fsdp"}, workers={"min": 1, "max": 2}, **sections)
    c.step()
    assert c.sm.state is State.RUNNING and c.world_size == 2
    for s in group.slots:
        s.info["step"] = 5
    return c, group


def test_survivors_that_moved_on_are_not_served_as_the_old_layout(tmp_path, ray_local) -> None:
    """After a failed rendezvous the survivors' runners hold generation 1's layout at step 0 while the
    controller still describes them by generation 0 at step 5: the served snapshots are checked, found not
    to be what was asked, and another source is used -- never generation 1's shards as generation 0's, and
    no failure charged to the healthy survivors (#21 item 7)."""
    c, group = _sharded_after_start(tmp_path, {0: {"holds": (1, 0, 0)}, 1: {"holds": (1, 1, 0)}})
    members = group.members()
    got = c._recovery_source(members, 2, members)
    assert got is None and c.recovery.source == "scratch", (got, c.recovery.source)
    assert not c.monitor.pending_failures
    warning = [e for e in read_events(tmp_path) if e["event"] == "warning" and e["source"] == "recovery"][0]
    assert "served generation 1 rank 0 step 0, not generation 0 rank 0 step 5" in warning["reason"]
    group.shutdown()


def test_a_survivor_refusing_to_serve_is_not_charged_a_failure(tmp_path, ray_local) -> None:
    c, group = _sharded_after_start(tmp_path, {1: {"hold_error": "slot 1 holds generation 1 rank 0 step 0"}})
    members = group.members()
    assert c._recovery_source(members, 2, members) is None and c.recovery.source == "scratch"
    assert not c.monitor.pending_failures
    group.shutdown()


def test_sharded_survivors_serving_what_was_asked_restore_from_peers(tmp_path, ray_local) -> None:
    c, group = _sharded_after_start(tmp_path, {})
    members = group.members()
    got = c._recovery_source(members, 2, members)
    assert got.kind == "peer" and got.step == 5 and [s.meta.rank for s in got.sources] == [0, 1]
    group.shutdown()


class _Store:
    """A store that records whether it was asked (a stalled one would block the recovery)."""

    root_uri = "memory://unused"

    def __init__(self) -> None:
        self.asked = 0

    def latest_valid(self, **kw: Any) -> tuple[Any, list[str]]:
        self.asked += 1
        return None, []


def test_sharded_recovery_does_not_ask_storage_when_the_memory_tier_covers_the_state(tmp_path, ray_local) -> None:
    """fsdp lost a member: survivors do not cover the state, the peer memory tier does (step 4): storage is
    not drained nor listed -- unless this run committed a newer step than the tier holds (#21 item 11)."""
    c, group = _sharded_after_start(tmp_path, {})
    c.sources.store = store = _Store()
    survivor = group.members()[0]
    c.sources.peer_tier = lambda holders, generation: {4: (True, ["snapshot sources of step 4"])}
    got = c._recovery_source([survivor], 2, [survivor])
    assert (got.kind, got.step, got.sources) == ("memory", 4, ["snapshot sources of step 4"])
    assert store.asked == 0 and "storage not asked" in c.recovery.reason
    c.committer.committed_steps.append(5)  # a newer committed step than the tier's: storage is asked
    c._recovery_source([survivor], 2, [survivor])
    assert store.asked == 1
    group.shutdown()
