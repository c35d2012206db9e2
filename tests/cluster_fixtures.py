"""Shared by the tests that act on a running job: ``SLOW`` (every step of both ranks 30 ms longer, so a test
can act between steps) and ``cluster``, a multi-node local Ray on one machine.

The fixtures are registered once, for the whole session, by tests/conftest.py (``pytest_plugins``): a test asks
for ``cluster`` by name and imports only ``SLOW`` / ``node_of``. (Imported into each module instead, a fixture
is defined once per module, and a session-scoped one would start a cluster per module and keep them all.)
tests/conftest.py runs every test on the cluster after the others, so it is started once (the placement
tests, tests/test_placement_nodes.py, and the simulator's actors, tests/test_sim_ray.py, share it too).

The test process stays connected to the cluster from one ``cluster`` test to the next (one Ray job): a run
that finished leaves its worker processes and keepers in the pool (``workers.reuse``, the suite's
``BASE_JOB``; elastictrain/controller/warm_pool.py), and the next test's run takes those on the nodes it
kept instead of starting and importing new ones (~4 CPU-s each). A test that failed, or a test that is not a
``cluster`` test, disconnects first (:func:`pytest_runtest_setup`): its Ray job, with whatever it left, goes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

SLOW = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.03, "generation": None} for r in (0, 1)]

WORKER_NODES = 2
_DRAINING = 3  # ray.rpc.NodeSnapshot.DRAINING (as elastictrain/controller/drain.py reads it)
# No test on these clusters reads Ray's metrics (tests/test_metrics.py reads ours on the session's local Ray).
# Collected, they cost the head's dashboard agent a third of a core: Ray 2.60's agent rebuilds every
# histogram observation of the GCS and the driver one Python call at a time (``record_histogram_aggregated_
# batch``), 77 s of CPU over the cluster tests of one suite run.
NO_METRICS = {"enable_metrics_collection": False}


@pytest.fixture(scope="session")
def _session_cluster() -> Iterator[Cluster]:
    """One local multi-node Ray for every module's ``cluster`` tests (its head, and each node, start a
    raylet, agents and a log monitor: seconds of CPU each; a test gets it topped up)."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3, **NO_METRICS},
    })
    try:
        yield c
    finally:
        _disconnect()
        c.shutdown()


def _top_up(c: Cluster, timeout: float = 90.0) -> None:
    """Bring ``c`` back to what a new cluster is: a 0-CPU head and ``WORKER_NODES`` live, undrained 1-CPU
    worker nodes, all their CPUs free. A node a test drained (or that died) is removed, a lost one replaced."""
    from ray._raylet import GcsClient

    infos = GcsClient(address=c.address).get_all_node_info(timeout=10)
    state = {nid.hex(): info for nid, info in infos.items()}
    for node in list(c.worker_nodes):
        info = state.get(node.node_id)
        if info is None or info.state != 0 or info.state_snapshot.state == _DRAINING:  # 0: GcsNodeInfo.ALIVE
            c.remove_node(node)
    while len(c.worker_nodes) > WORKER_NODES:
        c.remove_node(c.worker_nodes[-1])
    while len(c.worker_nodes) < WORKER_NODES:
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    want = {n.node_id for n in c.list_all_nodes()}
    deadline = time.time() + timeout
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        if (alive == want and ray.cluster_resources().get("CPU") == WORKER_NODES
                and ray.available_resources().get("CPU") == WORKER_NODES):
            return
        if time.time() > deadline:
            raise AssertionError(f"cluster not back to {WORKER_NODES} free worker nodes: alive {alive}, want "
                                 f"{want}, {ray.available_resources()} of {ray.cluster_resources()}")
        time.sleep(0.1)


_DRIVER: dict[str, str | None] = {"address": None}  # the cluster this process's driver is connected to, if any


def _disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()
    _DRIVER["address"] = None


def _uses_cluster(item: Any) -> bool:
    """True if ``item`` runs on this module's ``cluster`` (not a module's own fixture of the same name)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("cluster", ()) if info is not None else ()
    return bool(defs) and defs[-1].func.__module__ == __name__


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    """Before any fixture of a test that is not a ``cluster`` test: the driver's connection to the cluster
    goes (``ray_local`` then starts the session's local Ray, and a test that starts its own Ray finds none)."""
    if _DRIVER["address"] is not None and not _uses_cluster(item):
        _disconnect()


@pytest.fixture
def cluster(_session_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, list[Any]]]:
    """A head with no CPUs and two 1-CPU worker nodes: each worker lives on its own node. The session's
    local Ray is shut down first (``ray_local`` brings it back for the next test that asks).

    The Ray processes are shared by the session's cluster tests, and so is the driver's Ray job while they
    pass (see the module): each test gets the cluster topped back up to two live, undrained, free worker
    nodes (nodes a test removed or drained are replaced; processes pooled on the nodes kept stay). A test
    that fails ends the job (``ray.shutdown``): what it left (actors, placement groups, a run still going)
    goes with it, and the next test connects anew."""
    c = _session_cluster
    if _DRIVER["address"] != c.address:
        _disconnect()
        ray.init(address=c.address, log_to_driver=False)
        _DRIVER["address"] = c.address
    failed = request.session.testsfailed
    _top_up(c)
    yield c, list(c.worker_nodes)
    if request.session.testsfailed != failed:
        _disconnect()


def node_of(nodes: list[Any], node_id: str) -> Any:
    """The node (of ``cluster``'s list) with this Ray node id."""
    return next(n for n in nodes if n.node_id == node_id)
