"""Placement by topology on a real multi-node Ray (the session's ``cluster``: 2 worker nodes of one CPU, two
workers of half a CPU on each): Ray's SPREAD strategy puts the workers' bundles on alternate nodes, and the
controller gives ranks so that a pipeline's stages (and a TP group's ranks) share a node, as the
``worker_started`` events show. (On a cluster of its own, two nodes of 2 CPUs, it cost a head and two
nodes' starts: GCS, raylets, agents.)"""

from __future__ import annotations

import copy

import pytest

from tests.conftest import BASE_JOB, job, run_job

MODEL = {**BASE_JOB["task"]["model"], "n_layer": 2}  # one block per stage of pp2
TASK = {**copy.deepcopy(BASE_JOB["task"]), "model": MODEL}


def _nodes_by_rank(run) -> list[str]:
    first = min(e["generation"] for e in run.of("worker_started"))
    started = {e["rank"]: e["node_id"] for e in run.of("worker_started") if e["generation"] == first}
    return [started[r] for r in range(len(started))]


def _spec(**parallel) -> dict:
    return copy.deepcopy(job(task=TASK, train={"steps": 2, "global_batch": 16, "micro_batch": 2},
                             workers={"min": 4, "max": 4, "cpus_per_worker": 0.5, "placement_strategy": "SPREAD"},
                             parallel=parallel))


@pytest.mark.parametrize("factor", ["pp", "tp"])
def test_each_stage_or_tp_group_of_a_2x2_layout_is_on_one_node(tmp_path, cluster, factor) -> None:
    """pp2 x dp2: stage 0 is ranks 0,1 and stage 1 ranks 2,3; tp2 x dp2: ranks 0,1 and ranks 2,3 are TP
    groups. The bundles alternate nodes (a, b, a, b); in slot order each pair would span both nodes: placed
    by topology, each stage (or TP group, whose all-reduces then stay inside a node) is on a node of its own."""
    run = run_job(tmp_path, _spec(plan="ddp", **{factor: 2}), name=f"{factor}2dp2")
    assert run.result.exit_code == 0, run.summary
    slots = {e["slot"]: e["node_id"] for e in run.of("worker_started")}
    assert slots[0] != slots[1], "SPREAD did not alternate the bundles: the test proves nothing"
    nodes = _nodes_by_rank(run)
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    assert not [w for w in run.of("warning") if w.get("source") == "placement"]
