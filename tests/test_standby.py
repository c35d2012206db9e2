"""``workers.standby``: after a first replacement the group keeps one worker process started ahead, and the
next replacement runs in that process (no process start, no imports) while another standby is started.
A real WorkerGroup on the session's local Ray; the evidence is the process id, no timing."""

from __future__ import annotations

import os
import time

import ray
from conftest import job

from elastictrain.config import build_config
from elastictrain.controller.group import SlotState, WorkerGroup
from elastictrain.task_loader import task_from_config


def _ready(group: WorkerGroup, index: int, timeout: float = 180.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        group.collect_ready(timeout=1.0)
        slot = group.slots[index]
        if slot.state is SlotState.READY:
            return slot.info
        assert slot.state is SlotState.STARTING, slot.info
    raise AssertionError(f"slot {index} not ready within {timeout} s")


def _pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=180)


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_second_replacement_runs_in_the_standby_process(ray_local) -> None:
    config = build_config(job(workers={"min": 1, "max": 1}))
    assert config.workers.standby  # the default
    group = WorkerGroup(config, task_from_config(config))
    try:
        group.spawn(0)
        first = _ready(group, 0)
        assert group._standby is None and first["standby"] is False  # no failure yet: nothing started ahead

        group.kill(group.slots[0])
        group.spawn(0)  # the first replacement starts cold ...
        assert _ready(group, 0)["standby"] is False
        standby = group._standby  # ... and once it is up, a standby is started
        assert standby is not None
        standby_pid = _pid_of(standby)
        ray.get(group._standby_probe, timeout=180)  # what spawn looks at: up, and on which node

        group.kill(group.slots[0])
        group.spawn(0)
        info = _ready(group, 0)
        assert info["standby"] is True and info["pid"] == standby_pid and info["slot"] == 0
        assert group._standby is not None and group._standby is not standby  # the next one is on its way
        next_pid = _pid_of(group._standby)
        assert next_pid != standby_pid
    finally:
        group.shutdown()
    assert _gone(next_pid), "shutdown left the standby process running"


def test_no_standby_when_turned_off(ray_local) -> None:
    config = build_config(job(workers={"min": 1, "max": 1, "standby": False}))
    group = WorkerGroup(config, task_from_config(config))
    try:
        group._start_standby(0)  # what a replacement's set-up calls
        assert group._standby is None
    finally:
        group.shutdown()
