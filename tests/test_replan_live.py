"""``parallel.plan: auto`` re-plans a live run when the world changes size (issue 24): the planner's
decision (pure, from the figures the job gives in ``parallel.calibration``), then a real run on local Ray
(gloo, a real SIGKILL, no spare) whose workers build each generation's layout from the ``Layout`` they join
with, the state moving between layout families through the survivors' snapshots, never storage."""

from __future__ import annotations

import copy
import json

from elastictrain import build_config
from elastictrain.parallel.layout import resolve, spec_from_config
from elastictrain.planner.cluster import CPU_DEFAULTS
from elastictrain.planner.inputs import Cluster
from elastictrain.planner.live import Replanner

from tests.audit import assert_cursor_audit
from tests.conftest import BASE_JOB, job, run_job
from tests.grow_gate import assert_held_one_step, hold_until_grown
from tests.parallel_fixtures import (RECOVERY_PARAM_ATOL, InProcessRun, assert_grew_back_from_the_last_step,
                                     assert_same_numbers)

# the fsdp 3 generation after the kill at step 4 runs 4 s a step (below): 16 such steps leave a cold
# replacement on a loaded machine a minute to come up (the grow-back cuts them short: no cost otherwise)
STEPS = 20
MODEL = {**BASE_JOB["task"]["model"], "n_layer": 2}  # two blocks: pp2 has one per stage
TASK = {**copy.deepcopy(BASE_JOB["task"]), "model": MODEL}
TRAIN = {"steps": STEPS, "global_batch": 24, "micro_batch": 2}  # data-parallel sizes 1, 2, 3, 4 all valid
# The planner's figures for this machine, as a calibration file gives them: 2 MB per worker and 100 kB/s
# between workers. Then (tiny GPT above): at 4 workers the replicas of ddp 4 do not fit and pipelining
# moves the least, so pp2 x ddp2 is planned (~1.9 s a step); at 3 no whole pipelines and only fsdp 3 fits
# (ddp 3 does not); back at 4 the running family, fsdp 4, is ~10 s a step slower than pp2 x ddp2 and
# the move costs ~6 s: a switch that pays for itself with a single step left.
FIGURES = {"device_memory": 2.0e6, "runtime_bytes": 1e6, "intra_node_bw": 1e5}


def _cluster() -> Cluster:
    return Cluster(nodes=1, devices_per_node=4, **{**CPU_DEFAULTS, **FIGURES})


def _spec(calibration: str | None, **sections) -> dict:
    parallel = {"plan": "auto", "calibration": calibration} if calibration else {"plan": "ddp", "pp": 2}
    base = dict(task=TASK, train=TRAIN, workers={"min": 2, "max": 4}, parallel=parallel)
    return copy.deepcopy(job(**{**base, **sections}))


def test_replanner_moves_when_it_must_and_switches_back_when_the_move_pays():
    config = build_config(_spec(None))  # the run's concrete config as auto makes it: ddp x pp2
    spec = spec_from_config(config)
    start = resolve(spec, 4)
    planner = Replanner(config, _cluster())
    assert planner.runs_at(4) and planner.runs_at(3) and planner.runs_at(2)
    down = planner.decide(start, spec, 3, steps_left=8)
    assert down.decision.action == "required" and "cannot run at this size" in down.decision.reason
    assert (down.spec.plan, down.spec.pp, down.layout.dims.dp_shard) == ("fsdp", 1, 3)
    event = down.as_event()
    assert event["old_layout"] == "ddp 2, pp 2 1f1b, mb 2" and event["new_layout"] == "fsdp 3, mb 2"
    assert event["saved_s"] is None and event["predicted_memory_bytes"] <= FIGURES["device_memory"]
    assert event["old_world_size"] == 4 and event["old_step_s"] > 0 and event["mesh"] == {"dp_shard": 3}
    up = planner.decide(down.layout, down.spec, 4, steps_left=3)
    assert up.decision.action == "switch" and up.decision.pays_for_itself, up.decision.reason
    assert (up.spec.plan, up.spec.pp, up.layout.dims.dp_replicate) == ("ddp", 2, 2)
    assert up.decision.kept.candidate.describe() == "fsdp 4, mb 2"  # the running family at 4: slower
    # no steps left: nothing pays for a move, fsdp 4 is kept
    assert planner.decide(down.layout, down.spec, 4, steps_left=0).decision.action == "keep"
    # a world where nothing fits is never chosen (the membership rule under auto)
    tight = Replanner(config, Cluster(nodes=1, devices_per_node=4, **{**CPU_DEFAULTS, **FIGURES,
                                                                        "device_memory": 1.82e6}))
    assert not tight.runs_at(3) and tight.decide(start, spec, 3, steps_left=8) is None


def _slow(ranks: int, seconds: float, generation: int | None = None) -> list[dict]:
    return [{"rank": r, "step": 1, "kind": "slow", "seconds": seconds, "generation": generation}
            for r in range(ranks)]


def _audit(run) -> None:
    assert_cursor_audit(run, STEPS, MODEL["seq_len"], TRAIN["global_batch"])


def killed_auto_run(tmp_path, spec_fn, name: str):
    """A ``plan: auto`` run of ``spec_fn(calibration_path, **sections)`` (the calibration: :data:`FIGURES`) on 4
    workers, checkpoints every 2 steps, the sample audit on: rank 1 SIGKILLed mid-step 4 with no spare, the
    generation after it (the 3 survivors) held before its first step until the replacement is ready and the
    run grows back (tests/grow_gate.py). Returns the run, checked to have trained every step with that one
    failure."""
    calibration = tmp_path / "figures.json"
    calibration.write_text(json.dumps(FIGURES))
    kill = {"rank": 1, "step": 4, "point": "mid_step", "kind": "kill"}
    t = job()["timeouts"]
    spec = spec_fn(str(calibration), faults=_slow(4, 0.03) + [kill] + hold_until_grown(3),
                   train={**TRAIN, "audit_samples": True},
                   checkpoint={"uri": str(tmp_path / "ckpt"), "every_steps": 2},
                   recovery={"min_workers_wait_s": 240},
                   timeouts={**t, "watchdog_floor_s": 10, "restart_grace_s": 240})
    run = run_job(tmp_path, spec, name=name)
    assert run.result.exit_code == 0 and run.summary["final_step"] == STEPS, run.summary
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    assert_held_one_step(run)
    return run


def test_auto_run_replans_at_each_resize_and_moves_state_through_memory(tmp_path, ray_local):
    """4 workers plan pp2 x ddp2; rank 1 is SIGKILLed with no spare: 3 survivors cannot hold whole
    pipelines, so the next generation runs fsdp 3 (``replanned``: required), restored from the survivors'
    snapshots; the replacement comes up and the group grows back to pp2 x ddp2 (``replanned``: switch,
    its move paid for). Every generation's ranks report the mesh they built; the run ends at the loss of an
    uninterrupted one, every step seeing exactly its samples."""
    run = killed_auto_run(tmp_path, _spec, "auto")
    planned = run.of("run_started")[0]["planned"]
    assert (planned["layout"]["plan"], planned["layout"]["pp"], planned["world_size"]) == ("ddp", 2, 4), planned
    replans = run.of("replanned")
    assert [(e["action"], e["world_size"], e["new_layout"]) for e in replans] == [
        ("required", 3, "fsdp 3, mb 2"), ("switch", 4, "ddp 2, pp 2 1f1b, mb 2")], replans
    assert replans[0]["old_layout"] == "ddp 2, pp 2 1f1b, mb 2" and replans[1]["old_layout"] == "fsdp 3, mb 2"
    # what does not fit is never chosen: ddp 3 (faster, 2.15 MB per worker) is not, fsdp 3 is
    assert all(e["predicted_memory_bytes"] <= FIGURES["device_memory"] for e in replans), replans
    up = replans[1]
    assert up["saved_s"] > up["move_s"] > 0 and up["kept_step_s"] > up["predicted_step_s"], up
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes == [(4, 3), (3, 4)], sizes
    # the workers built what the controller chose: each generation's first step names its ranks' mesh
    meshes = [(e["step"], e["mesh"]) for e in run.of("step") if "mesh" in e]
    assert [m for _, m in meshes] == ["ddp: pp=2 x dp_replicate=2", "fsdp: dp_shard=3",
                                      "ddp: pp=2 x dp_replicate=2"], meshes
    # both moves came from the survivors' memory (a committed checkpoint was there to fall back on)
    assert run.of("checkpoint_saved")
    assert [r["source"] for r in run.of("recovered")] == ["peer"], run.of("recovered")
    # the grow-back (its move to pp2 x ddp2) continued from the last step trained: no reload from storage
    assert_grew_back_from_the_last_step(run)
    assert not run.of("resumed")
    _audit(run)
    # every step's loss (a redone one too) and the final parameters: pp2 x ddp2, fsdp 3 and one process
    # differ by fp32 sum order only (tests/parallel_fixtures.py)
    clean = job(task=TASK, train=TRAIN, workers={"min": 1, "max": 1})
    assert_same_numbers(run, InProcessRun(clean), param_atol=RECOVERY_PARAM_ATOL)


def test_a_replicated_generation_followed_by_a_sharded_one_serves_snapshots(ray_local, tmp_path):
    """ddp on 3 (every survivor a whole replica) re-planned to fsdp on 4: the broadcast path cannot fill the
    rebuilt shards, so the gatherer asks a survivor for its snapshot (a peer restore read by name); the
    same generation followed by ddp keeps the broadcast."""
    import ray

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta
    from elastictrain.controller.gather import PeerRestore, Previous, SourceGatherer
    from elastictrain.controller.group import Slot, SlotState
    from elastictrain.events import EventLog
    from elastictrain.parallel.layout import Layout, MeshDims

    @ray.remote(num_cpus=0)
    class Survivor:
        def own_snapshots(self) -> list:
            return []

        def hold_snapshot(self, expect):
            gen, rank, step = expect
            return SnapshotMeta(rank, step, {}, frozenset(), {}, 0, gen)

    actor = Survivor.remote()
    # started before the gatherer's calls, which are bounded by timeouts.poll_s (a worker process can take
    # longer than that to start on a loaded machine: seen at 30 s, the gatherer then chose "scratch")
    assert ray.get(actor.own_snapshots.remote(), timeout=300) == []
    ddp3 = Layout(MeshDims(dp_replicate=3, plan="ddp"), 4, "ddp 3")
    g = SourceGatherer(build_config(job()), EventLog(tmp_path, console=None), None, None, None, None,
                       lambda world: ddp3)
    slots = [Slot(r, actor=actor, state=SlotState.MEMBER, info={"step": 5}, rank=r, has_state=True)
             for r in range(3)]
    prev = Previous(1, {r: r for r in range(3)}, 3, ddp3)
    fsdp4 = Layout(MeshDims(dp_shard=4, plan="fsdp"), 3, "fsdp 4")
    moved = g.gather(slots, slots, prev, 2, [5], next_layout=fsdp4)
    assert moved.kind == "peer" and isinstance(moved.resume, PeerRestore) and moved.resume.step == 5
    assert [s.meta.rank for s in moved.resume.sources] == [0]  # one replica holds it all
    kept = g.gather(slots, slots, prev, 2, [5], next_layout=Layout(MeshDims(dp_replicate=4), 3, "ddp 4"))
    assert kept.kind == "peer" and kept.resume is None  # survivors broadcast, as before


def _sim_run(tmp_path, planned) -> list[dict]:
    """The real controller over 8 simulated ddp workers (elastictrain/sim), one killed at step 6 (its slot
    respawns and the group grows back); the events it wrote."""
    from elastictrain.controller.controller import Controller
    from elastictrain.events import EventLog, read_events
    from elastictrain.sim.group import SimGroup
    from elastictrain.sim.scenarios import sim_config
    from elastictrain.sim.world import Fault, SimWorld
    from elastictrain.task import builtin_task

    config = sim_config(8, 20, 0.01)
    world = SimWorld(step_s=0.01, setup_s=0.05)
    world.faults = [Fault(6, "kill", lambda w, t: w.crash(w.workers[5], t))]
    events = EventLog(tmp_path, console=None)
    group = SimGroup(world, config.workers.max)
    c = Controller(config, builtin_task(config), events, group=group, planned=planned)
    summary = c.run()
    events.close()
    assert summary["state"] == "finished", summary
    return read_events(tmp_path)


def test_a_fixed_layout_is_never_replanned_and_auto_asks_the_planner_at_each_resize(tmp_path):
    from types import SimpleNamespace

    fixed = _sim_run(tmp_path / "fixed", planned=None)
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in fixed if e["event"] == "resized"]
    assert sizes and sizes[0][0] == 8 and not [e for e in fixed if e["event"] == "replanned"], sizes
    roomy = Cluster(nodes=1, devices_per_node=8, **{**CPU_DEFAULTS, "device_memory": 64e9})
    auto = _sim_run(tmp_path / "auto", planned=SimpleNamespace(cluster=roomy, world=8))
    replans = [e for e in auto if e["event"] == "replanned"]
    resized = [e for e in auto if e["event"] == "resized"]
    assert len(replans) == len(resized) >= 1, (replans, resized)  # one decision per generation of another size
    for r, s in zip(replans, resized):
        assert r["world_size"] == s["new_world_size"] and r["old_world_size"] == s["old_world_size"]
        assert r["action"] in ("keep", "switch", "required") and r["reason"]
