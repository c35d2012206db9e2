"""``parallel.plan: auto`` with a mixture-of-experts model re-plans expert parallel at each resize (issue 39):
the planner's decisions (pure, from the figures the job gives in ``parallel.calibration``), then one real run
on local Ray (gloo, a real SIGKILL, no spare) whose generations run three expert-parallel degrees, the state
moving between them through the survivors' snapshots (by name: DCP reshards the experts), never storage.

The model is tests/test_ep_wiring.py's tiny MoE GPT (4 experts, top 2, dropout off). With the figures below
(2 MB per worker, 100 kB/s between workers) the planner picks ddp 4 x ep 2 at 4 workers (ep 4 is faster but
does not run at workers.min = 2, which a fixed layout must); at 3, ep 2 divides no data-parallel size and
only fsdp 3 (ep 1) fits; back at 4 the running family (fsdp 4) is far slower than ddp 4 x ep 4, whose move
pays for itself.

Against the build before this file (``same_family`` building the running ep at the new size): the shrink to
3 raised PlannerInputError ("MeshDims.ep=2 must divide the data-parallel size 3") in the controller, and the
run failed there; the pure test fails the same way.
"""

from __future__ import annotations

import copy

import pytest

from tests.conftest import job
from tests.test_ep_wiring import TASK
# test_replan_live's run length, batch (data-parallel sizes 1, 2, 3, 4 all valid) and calibration
from tests.test_replan_live import FIGURES, STEPS, TRAIN


def _spec(calibration: str | None, **sections) -> dict:
    parallel = {"plan": "auto", "calibration": calibration} if calibration else {"plan": "ddp", "ep": 2}
    base = dict(task=TASK, train=TRAIN, workers={"min": 2, "max": 4}, parallel=parallel)
    return copy.deepcopy(job(**{**base, **sections}))


def test_replanner_moves_ep_when_it_must_and_switches_when_the_move_pays() -> None:
    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.planner.cluster import CPU_DEFAULTS
    from elastictrain.planner.inputs import Cluster
    from elastictrain.planner.job import choose
    from elastictrain.planner.live import Replanner

    cluster = Cluster(nodes=1, devices_per_node=4, **{**CPU_DEFAULTS, **FIGURES})
    auto = build_config(_spec(None, parallel={"plan": "auto"}))
    config, choice = choose(auto, cluster, [2, 3, 4])
    assert (choice.world, config.parallel.plan, config.parallel.ep) == (4, "ddp", 2), choice.reason
    spec = spec_from_config(config)
    planner = Replanner(config, cluster)
    assert planner.runs_at(3)
    down = planner.decide(resolve(spec, 4), spec, 3, steps_left=16)
    assert down.decision.action == "required" and "cannot run at this size" in down.decision.reason
    assert (down.spec.plan, down.spec.ep, down.layout.dims.dp_shard) == ("fsdp", 1, 3)
    assert down.as_event()["mesh"] == {"dp_shard": 3}
    up = planner.decide(down.layout, down.spec, 4, steps_left=10)
    assert up.decision.action == "switch" and up.decision.pays_for_itself, up.decision.reason
    assert (up.spec.plan, up.spec.ep) == ("ddp", 4) and up.as_event()["mesh"] == {"dp_replicate": 4, "ep": 4}
    assert up.decision.kept.candidate.describe() == "fsdp 4, mb 2"


@pytest.mark.slow
def test_auto_moe_run_replans_ep_at_each_resize_and_moves_the_experts_through_memory(tmp_path, ray_local):
    """ddp 4 x ep 2 planned; rank 1 SIGKILLed at step 4 with no spare: the 3 survivors run fsdp 3 (ep 1,
    ``replanned``: required), restored from the survivors' snapshots (each ep coordinate's experts from a
    survivor holding them); the replacement comes up and the group grows back to ddp 4 x ep 4
    (``replanned``: switch). The run ends with every step's loss (a redone one too) and the final parameters
    of an uninterrupted one-process run, every step seeing exactly its samples, the token counts of every
    step the global batch's."""
    from tests.audit import assert_cursor_audit
    from tests.parallel_fixtures import (RECOVERY_PARAM_ATOL, InProcessRun, assert_grew_back_from_the_last_step,
                                         assert_same_numbers)
    from tests.test_replan_live import killed_auto_run

    run = killed_auto_run(tmp_path, _spec, "auto-moe")  # (the fsdp 3 generation is held until the grow-back)
    planned = run.of("run_started")[0]["planned"]
    assert (planned["layout"]["plan"], planned["layout"]["ep"], planned["world_size"]) == ("ddp", 2, 4), planned
    replans = run.of("replanned")
    assert [(e["action"], e["world_size"], e["new_layout"], e["mesh"]) for e in replans] == [
        ("required", 3, "fsdp 3, mb 2", {"dp_shard": 3}),
        ("switch", 4, "ddp 4, ep 4, mb 2", {"dp_replicate": 4, "ep": 4})], replans
    assert replans[0]["old_layout"] == "ddp 4, ep 2, mb 2" and replans[1]["old_layout"] == "fsdp 3, mb 2"
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes == [(4, 3), (3, 4)], sizes
    meshes = [e["mesh"] for e in run.of("step") if "mesh" in e]  # the dense mesh each generation built
    assert meshes == ["ddp: dp_replicate=4", "fsdp: dp_shard=3", "ddp: dp_replicate=4"], meshes
    assert [r["source"] for r in run.of("recovered")] == ["peer"], run.of("recovered")
    assert_grew_back_from_the_last_step(run)
    assert not run.of("resumed")  # no reload from storage
    assert_cursor_audit(run, STEPS, TASK["model"]["seq_len"], TRAIN["global_batch"])
    slots = TRAIN["global_batch"] * TASK["model"]["seq_len"] * TASK["model"]["moe"]["top_k"]
    assert all(sum(e["tokens_per_expert"]["blocks.0.moe"]) == slots for e in run.of("step")), run.of("step")
    clean = job(task=TASK, train=TRAIN, workers={"min": 1, "max": 1})
    assert_same_numbers(run, InProcessRun(clean), param_atol=RECOVERY_PARAM_ATOL)
