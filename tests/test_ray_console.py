"""Ray's paragraph on a dead worker stays off the console (elastictrain/ray_console.py): the ``failure``
event says what happened, once; Ray's text goes to RUN_DIR/ray_errors.log."""

from __future__ import annotations

import time
from pathlib import Path

from elastictrain.ray_console import is_worker_death

PARAGRAPH = ("A worker died or was killed while executing a task by an unexpected system error. To "
             "troubleshoot the problem, check the logs for the dead worker. ... Worker exit type: SYSTEM_ERROR "
             "Worker exit detail: Worker unexpectedly exits ... OOM killer ...")


def test_only_rays_worker_death_paragraph_is_diverted() -> None:
    assert is_worker_death({"lines": [PARAGRAPH], "pid": "raylet", "is_err": False})
    assert not is_worker_death({"lines": ["[rank 1/2] step 5"], "pid": 1234, "is_err": False})  # a worker log
    assert not is_worker_death({"lines": ["Failed to register worker to Raylet"], "pid": "raylet", "is_err": False})


def assert_paragraph_diverted(run_dir: Path, capfd) -> None:  # noqa: ANN001 - pytest's capfd
    """Ray's paragraph on the run's dead worker lands in ``ray_errors.log`` and never on the console. Used
    by a test that kills a worker anyway (test_recovery.py: the spare), so no run of its own is needed."""
    log, printed = run_dir / "ray_errors.log", ""
    deadline = time.monotonic() + 120  # Ray publishes the paragraph asynchronously: wait for it to land
    while not (log.exists() and "A worker died or was killed" in log.read_text()):
        printed += "".join(capfd.readouterr())
        assert "A worker died or was killed" not in printed, "Ray's paragraph was printed on the console"
        assert time.monotonic() < deadline, "Ray's paragraph on the dead worker never reached the driver"
        time.sleep(0.2)
    printed += "".join(capfd.readouterr())
    assert "A worker died or was killed" not in printed


def test_the_hook_installs_only_over_rays_known_function_and_never_breaks_its_calls(monkeypatch) -> None:
    """A Ray upgrade cannot crash the driver's error listener through the hook: over a function of another
    shape nothing is installed; once installed, calls it does not recognise go to Ray's function unchanged."""
    import ray._private.worker as ray_worker

    from elastictrain import ray_console

    seen: list[tuple] = []

    def moved(data, ignore_prefix, sink):  # noqa: ANN001, ANN202 - a future Ray's signature
        seen.append((data, ignore_prefix, sink))

    monkeypatch.setattr(ray_console, "_installed", False)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", moved)
    ray_console.install()
    assert ray_worker.print_to_stdstream is moved, "hooked a function of a shape it was not written for"

    def known(data, ignore_prefix):  # noqa: ANN001, ANN202 - Ray 2.60's
        seen.append((data, ignore_prefix))

    monkeypatch.setattr(ray_console, "_installed", False)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", known)
    ray_console.set_run_dir(None)
    ray_console.install()
    hooked = ray_worker.print_to_stdstream
    assert hooked is not known
    seen.clear()
    hooked({"lines": [PARAGRAPH], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert seen == [], "the worker-death paragraph reached Ray's printer"
    odd = [None, {"lines": 7, "pid": "raylet", "is_err": False}, "text"]
    for data in odd:
        hooked(data, False)
    hooked(data={"lines": ["x"], "pid": 1, "is_err": False}, ignore_prefix=True)
    assert seen == [(d, False) for d in odd] + [({"lines": ["x"], "pid": 1, "is_err": False}, True)]
