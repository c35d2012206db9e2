"""Shared by the tests that act on a running job: ``SLOW`` (every step of both ranks 30 ms longer, so a test
can act between steps) and ``cluster``, a multi-node local Ray on one machine.

Import into a test module with ``from tests.cluster_fixtures import SLOW, cluster  # noqa: F401``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

SLOW = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.03, "generation": None} for r in (0, 1)]


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, list[Any]]]:
    """A head with no CPUs and two 1-CPU worker nodes: each worker lives on its own node. The session's
    local Ray is shut down first (``ray_local`` brings it back for the next test that asks)."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
    })
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def node_of(nodes: list[Any], node_id: str) -> Any:
    """The node (of ``cluster``'s list) with this Ray node id."""
    return next(n for n in nodes if n.node_id == node_id)
