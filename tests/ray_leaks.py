"""What holds the session Ray's CPUs after a test: the ``ray_local`` fixture's teardown guard.

A test whose run leaves a placement group or a CPU-holding actor behind makes a later test on the same
session Ray wait for workers that cannot be placed, and fail there (issue #40: 4-worker runs waited 120 s for
CPUs a test minutes earlier had kept). The guard makes the leaking test fail instead, naming what holds them, and then frees them so the
tests after it are not its victims too.
"""

from __future__ import annotations

import os
import signal
import time

import ray

# Generous: a run's workers killed at shutdown give their CPUs back within a second or two on a quiet machine
# (the raylet reports freed resources to the GCS asynchronously); a loaded 2-core one may take far longer.
RELEASE_BOUND_S = 60.0
POLL_S = 0.1


def cpus_held() -> float:
    """How many of the cluster's CPUs are not available now (0.0 when all are free)."""
    total = ray.cluster_resources().get("CPU", 0.0)
    return max(0.0, total - ray.available_resources().get("CPU", 0.0))


def wait_all_cpus_free(bound_s: float = RELEASE_BOUND_S) -> float:
    """Wait, at most ``bound_s``, until every CPU of the connected Ray is free; return the CPUs still held
    (0.0: all free). One check and no wait when nothing is held."""
    held = cpus_held()
    deadline = time.monotonic() + bound_s
    while held > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)  # polling a condition, bounded: Ray offers no event for "resources returned"
        held = cpus_held()
    return held


def holders() -> str:
    """One line: the placement groups not REMOVED (with their bundles, name, creator) and the live actors
    that hold CPU (class, pid, placement group), from the GCS tables."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    accessor = state._connect_and_get_accessor()
    parts: list[str] = []
    own_job = ray.get_runtime_context().get_job_id()
    removed = gcs_pb2.PlacementGroupTableData.REMOVED
    for raw in accessor.get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if pg.state == removed:
            continue
        state_name = gcs_pb2.PlacementGroupTableData.PlacementGroupState.Name(pg.state)
        bundles = [dict(b.unit_resources) for b in pg.bundles]
        job = pg.creator_job_id.hex()
        creator = f"job {job}" + (" (this driver)" if job == own_job else " (another driver)") + (
            f" actor {pg.creator_actor_id.hex()}" if pg.creator_actor_id.strip(b"\x00\xff") else "")
        created_ms = pg.placement_group_creation_timestamp_ms
        age = time.time() - created_ms / 1000 if created_ms else None
        parts.append(f"placement group {pg.placement_group_id.hex()[:12]} {state_name} "
                     f"name={pg.name or '-'} bundles={bundles} creator={creator}"
                     + (f" created {age:.0f} s ago" if age is not None else ""))
    for raw in accessor.get_actor_table(None, "ALIVE"):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        cpu = dict(actor.required_resources).get("CPU", 0.0)
        in_pg = actor.placement_group_id.strip(b"\x00\xff")
        if cpu > 0 or in_pg:
            where = f" in placement group {actor.placement_group_id.hex()[:12]}" if in_pg else ""
            parts.append(f"actor {actor.class_name} pid {actor.pid} CPU {cpu:g}{where}")
    return "; ".join(parts) or "nothing listed (tasks in flight?)"


def release_all() -> None:
    """Remove every placement group not REMOVED and kill every live actor that holds CPU: what a leaking
    test left, so the tests after it start on a free Ray (the leaking test already failed, naming them)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    accessor = state._connect_and_get_accessor()
    for raw in accessor.get_actor_table(None, "ALIVE"):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if dict(actor.required_resources).get("CPU", 0.0) > 0 and actor.pid:
            try:  # the session Ray is local: its actors are processes of this machine
                os.kill(actor.pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
    for raw in accessor.get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if pg.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass


def check_all_cpus_free(bound_s: float = RELEASE_BOUND_S) -> str | None:
    """None when the connected Ray's CPUs are all free (at once, or within the bound); else one line naming
    how many are held and by what, after which what holds them is released (:func:`release_all`)."""
    held = wait_all_cpus_free(bound_s)
    if held <= 0:
        return None
    total = ray.cluster_resources().get("CPU", 0.0)
    line = (f"{held:g} of the session Ray's {total:g} CPUs still held {bound_s:g} s after the test: "
            f"{holders()}")
    release_all()
    return line

