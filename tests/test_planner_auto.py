"""``parallel.plan: auto``: the choice as a pure function of (job, cluster), and a real run on local Ray
that trains with the layout it chose (the mesh its workers report building) and records it in
``run_started``."""

from __future__ import annotations

import pytest

from elastictrain import build_config
from elastictrain.config import ConfigError
from elastictrain.planner import GIB, Candidate, Cluster, evaluate
from elastictrain.planner import job as planner_job
from elastictrain.planner.cluster import CPU_DEFAULTS

from tests.conftest import job, run_job


def _cpu(devices: int, memory: float) -> Cluster:
    return Cluster(nodes=1, devices_per_node=devices, device_memory=memory, **CPU_DEFAULTS)


def test_auto_shards_when_replicas_do_not_fit():
    config = build_config(job(parallel={"plan": "auto"}, task={"model": {"n_layer": 8, "d_model": 256,
                                                                          "n_head": 4, "seq_len": 32}}))
    model, train = planner_job.model_shape(config), planner_job.training(config)
    roomy = _cpu(2, 64 * GIB)
    ddp = evaluate(model, train, roomy, Candidate(dp_replicate=2, micro_batch=4))
    fsdp = evaluate(model, train, roomy, Candidate(dp_shard=2, micro_batch=4))
    assert fsdp.memory.total < ddp.memory.total
    between = (ddp.memory.total + fsdp.memory.total) / 2  # a device where only the sharded state fits
    concrete, choice = planner_job.choose(config, _cpu(2, between), [1, 2])
    assert choice.world == 2 and choice.estimate.candidate.dp_shard == 2 and choice.estimate.fits
    assert concrete.parallel.plan == "fsdp" and choice.parallel["plan"] == "fsdp"
    assert "world size 2" in choice.reason and choice.as_event()["predicted_memory_bytes"] <= between
    _, roomy_choice = planner_job.choose(config, roomy, [1, 2])
    assert roomy_choice.world == 2


def test_auto_skips_a_layout_the_job_cannot_run_and_refuses_when_nothing_fits(monkeypatch):
    config = build_config(job(parallel={"plan": "auto"}, task={"model": {"n_layer": 2}}))
    model, train = planner_job.model_shape(config), planner_job.training(config)
    cl = _cpu(2, 64 * GIB)
    pp2 = evaluate(model, train, cl, Candidate(pp=2, micro_batch=4))  # not usable at workers.min=1
    ddp = evaluate(model, train, cl, Candidate(dp_replicate=2, micro_batch=4))
    with pytest.raises(ConfigError, match="world size 1 is not usable"):
        planner_job.concrete_config(config, planner_job.parallel_settings(pp2))
    monkeypatch.setattr(planner_job, "job_plan", lambda *a, **k: [pp2, ddp])
    concrete, choice = planner_job.choose(config, cl, [2])
    assert concrete.parallel.plan == "ddp" and concrete.parallel.pp == 1 and choice.estimate is ddp
    monkeypatch.undo()
    with pytest.raises(planner_job.PlannerInputError, match=r"no layout fits; closest: .* short by"):
        planner_job.choose(config, _cpu(2, 1e6), [1, 2])


def test_auto_run_trains_with_the_layout_it_chose(tmp_path, ray_local):
    run = run_job(tmp_path, job(train={"steps": 3}, parallel={"plan": "auto", "mixed_precision": "bf16"}))
    assert run.result.exit_code == 0
    started = run.of("run_started")[0]
    planned = started["planned"]
    assert planned["layout"]["plan"] == started["plan"] == "ddp"  # bf16 runs under ddp too (autocast)
    assert planned["world_size"] == 2 and planned["predicted_step_s"] > 0
    assert 0 < planned["predicted_memory_bytes"] and "best of" in planned["reason"]
    assert [e["world_size"] for e in run.of("step")] == [2, 2, 2]
    # what the workers built (the first step's ranks report their plan and mesh), not the controller's words
    assert [e.get("mesh") for e in run.of("step")] == ["ddp: dp_replicate=2", None, None], run.of("step")
