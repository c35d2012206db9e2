"""The ``ray_local`` teardown guard (tests/ray_leaks.py) names what holds the session Ray's CPUs, and frees them."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group

from tests.ray_leaks import check_all_cpus_free, cpus_held


@ray.remote(num_cpus=1)
class _Holder:
    def pid(self) -> int:
        import os

        return os.getpid()


def test_nothing_held_is_one_check(ray_local):
    assert check_all_cpus_free(bound_s=0) is None


def test_a_left_placement_group_and_actor_are_named_then_released(ray_local):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK", name="left-behind")
    ray.get(pg.ready(), timeout=120)
    holder = _Holder.remote()
    pid = ray.get(holder.pid.remote(), timeout=120)
    line = check_all_cpus_free(bound_s=0)
    assert line is not None and line.startswith("3 of the session Ray's "), line
    assert "name=left-behind" in line and "{'CPU': 1.0}" in line and "CREATED" in line, line
    assert "(this driver)" in line and " s ago" in line, line
    assert f"actor _Holder pid {pid} CPU 1" in line, line
    # released: the tests after a leaking one start on a free Ray (the fixture's own teardown checks it too)
    assert check_all_cpus_free() is None, cpus_held()
