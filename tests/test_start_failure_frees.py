"""A controller whose construction raises after it made its worker group gives the group's placement groups
back (issue #40: left behind, they held the session Ray's CPUs for the driver's life, and every later run
that needed them waited for workers that could not be placed)."""

from __future__ import annotations

import pytest

from conftest import job
from elastictrain.config import build_config
from elastictrain.controller.controller import Controller
from elastictrain.events import EventLog
from elastictrain.task_loader import task_from_config
from tests.ray_leaks import check_all_cpus_free


class _BadResumePlan:
    """A resume decision whose fingerprint is not a mapping: the construction raises after the group."""
    lineage = None
    fingerprint = 5


def test_a_controller_that_fails_to_start_gives_back_its_placement_groups(tmp_path, ray_local) -> None:
    # a core group of 2 bundles and two groups of one (max 4)
    config = build_config(job(workers={"min": 2, "max": 4}))
    events = EventLog(tmp_path, console=None)
    try:
        with pytest.raises(TypeError):
            Controller(config, task_from_config(config), events, resume_plan=_BadResumePlan())
    finally:
        events.close()
    assert check_all_cpus_free() is None  # (before: all 4 CPUs held by its three placement groups)


def test_a_calibration_file_that_is_not_an_object_is_a_cluster_error(tmp_path) -> None:
    """The path that found it: ``parallel.calibration`` naming a JSON list raised AttributeError inside the
    controller's construction, after its group was made (now the file's own error, which the MFU figure skips)."""
    from elastictrain.planner.cluster import ClusterError, read_calibration

    path = tmp_path / "calibration.json"
    path.write_text("[1]")
    with pytest.raises(ClusterError, match="content not positive numbers; write it again with --calibrate"):
        read_calibration(path)
