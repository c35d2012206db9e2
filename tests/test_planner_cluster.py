"""The planner on a Ray cluster of two nodes (one machine, ``ray.cluster_utils``): the cluster it describes,
the cross-node all-reduce of ``--calibrate``, and ``parallel.plan: auto`` choosing from what Ray offers."""

from __future__ import annotations

from elastictrain import build_config
from elastictrain.planner import cluster as clusters
from elastictrain.planner.calibrate import cross_node_all_reduce
from elastictrain.planner.job import plan_for_run

from tests.conftest import job


def test_two_nodes_are_described_measured_and_planned_for(cluster):
    seen = clusters.from_ray(use_gpu=False)
    assert (seen.nodes, seen.devices_per_node, seen.kind) == (2, 1, "cpu") and seen.source.startswith("Ray")
    bw = cross_node_all_reduce(use_gpu=False)
    assert bw is not None and bw > 1e6  # a real gloo all-reduce between actors on the two nodes
    config, choice = plan_for_run(build_config(job(parallel={"plan": "auto"})))
    assert choice.world == 2 and config.parallel.plan in ("ddp", "fsdp") and config.parallel.pp == 1
    assert "cluster: Ray: 2 nodes" in choice.reason
