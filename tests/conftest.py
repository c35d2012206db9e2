"""Shared fixtures: one local Ray for the session (multi-node tests start their own cluster), and helpers
to run small jobs and read what they wrote."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import ray

from elastictrain import Trainer, build_config
from elastictrain.events import read_events
from elastictrain.local_ray import init_local_ray, local_ray_env
from tests import durations
from tests.base_workers import guarded_fit
from tests.ray_leaks import check_all_cpus_free

# The daemon settings of the private local Ray `elastictrain run` starts (elastictrain/local_ray.py: the log
# monitor's scan for new logs once a second, the dashboard agent's node report once a minute; what each saves:
# docs/perf/2026-11-28-idle-ray.md), for every Ray a test starts: the session's, the multi-node fixture's,
# those of `elastictrain run` subprocesses. Idle daemons take CPU the tests need.
for _key, _value in local_ray_env().items():
    os.environ.setdefault(_key, _value)

# The multi-node fixture (``cluster``), registered once for the session (see the module).
pytest_plugins = ("tests.cluster_fixtures",)

# A small but real job: the byte-level GPT on Python's docs, 2 workers, seconds per run on 2 CPU cores.
BASE_JOB: dict[str, Any] = {
    "name": "t",
    "task": {"model": {"seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.1},
             "optimizer": {"lr": 3e-3, "warmup_steps": 5}},
    "train": {"steps": 20, "seed": 0, "global_batch": 16, "micro_batch": 4, "log_every": 100},
    # no standby process started ahead (workers.standby, on by default): a run starts one once it trained a
    # step, an extra process importing torch beside every short test run; tests/test_standby.py turns it on
    # worker processes reused across the suite's runs (workers.reuse, off by default): a run that ended cleanly
    # leaves its processes to the next run of the session under the same key (elastictrain/controller/
    # warm_pool.py), instead of each run starting its own (~4 CPU-s each); tests whose promise is about fresh
    # processes, memory high-water marks or the standby set it false
    "workers": {"min": 1, "max": 2, "standby": False, "reuse": True},
    # no peer memory tier (checkpoint.memory_every_steps, 10 by default): it starts (or, under workers.reuse,
    # takes from the pool: controller/keeper_pool.py) a ShardKeeper process per
    # node, importing torch, beside every run; the tests whose promise involves the tier turn it on
    "checkpoint": {"memory_every_steps": 0},
    "timeouts": {"collective_s": 15, "step_watchdog_cap_s": 20, "poll_s": 30, "restart_grace_s": 90,
                 "watchdog_floor_s": 2},
}


def job(**sections: Any) -> dict[str, Any]:
    """BASE_JOB with sections merged one level deep, e.g. job(train={"steps": 5})."""
    out = copy.deepcopy(BASE_JOB)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _ensure_local_ray() -> None:
    # The private local Ray `elastictrain run` starts (its system config: workers preload the worker actor's
    # module; its daemons' settings): tests run on the Ray the CLI runs on, and tests/test_worker_preload.py
    # and tests/test_local_ray.py check it on this one.
    if not ray.is_initialized():
        init_local_ray(4, log_to_driver=False)


@pytest.fixture
def ray_local():
    """A local Ray shared by the session (re-created if a multi-node test shut it down). Its teardown fails
    the test that leaves the Ray's CPUs held (a placement group or a CPU-holding actor outliving its run),
    naming what holds them (then frees them), instead of a later test waiting for workers that cannot be
    placed (tests/ray_leaks.py); one check when nothing is held."""
    _ensure_local_ray()
    yield
    if ray.is_initialized():
        leak = check_all_cpus_free()
        if leak is not None:
            pytest.fail(leak, pytrace=False)


@pytest.fixture(autouse=True)
def _base_workers_kept(monkeypatch):
    """Every run trained in the test's process states ``workers.reuse`` and ``workers.standby``: a spec that
    replaced BASE_JOB's whole ``workers`` section fails its test once its run returned
    (tests/base_workers.py; tests/test_base_workers.py)."""
    from elastictrain.trainer import Trainer as _Trainer

    monkeypatch.setattr(_Trainer, "fit", guarded_fit(_Trainer.fit))


def pytest_configure(config):
    """``pytest -n N`` distributes the units :func:`pytest_collection_modifyitems` marks, in its order
    (pytest-xdist's ``loadgroup``, without its reordering of units by their number of tests)."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "load":  # the controller
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False
    if hasattr(config, "workerinput"):  # an xdist process: its options are parsed anew from the command line
        config.option.loadgroup = True


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups marked here
def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    """Order the tests, and group them for ``pytest -n 2`` (pytest-xdist, ``--dist loadgroup``).

    Tests that shut the session's local Ray down run together: those on the multi-node ``cluster``
    (tests/cluster_fixtures.py), so it is started once. Run among the others, each would make the next
    test on ``ray_local`` start the session's Ray again (its raylet, and its prestarted workers importing
    torch). Run alone (no ``-n``) they come last.

    Under xdist every module is one unit of work, sent whole to one process (its module-scoped runs are
    made once), and the tests above are one unit (their Ray is started once). A process takes the next
    unit when it runs out; the units go out longest first (the seconds tests/durations.json recorded; one
    not recorded counts as 30 s when its tests run on a Ray or start one, ``slow``, else 1 s): that one unit
    first (minutes), then the modules by their time, so the last units to start are short ones and both
    processes finish together. (In file order a 100 s module came last and ran alone for half a minute.)"""
    def on_cluster(item: Any) -> bool:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.get("cluster", ()) if info is not None else ()
        return any(d.func.__module__ == "tests.cluster_fixtures" for d in defs)

    alone = {id(item) for item in items if on_cluster(item)}
    if not getattr(config.option, "loadgroup", False):  # set in each xdist process (see pytest_configure)
        items.sort(key=on_cluster)
        return
    heavy = {item.path for item in items
             if "ray_local" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slow")}
    recorded = durations.load()

    def unit(item: Any) -> str:
        return "own-ray" if id(item) in alone else item.nodeid.split("::")[0]

    def seconds(item: Any) -> float:  # a unit not recorded yet: a guess by its kind
        return recorded.get(unit(item), 30.0 if item.path in heavy else 1.0)

    items.sort(key=lambda item: (id(item) not in alone, -seconds(item), unit(item)))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item)))


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    if ray.is_initialized():
        ray.shutdown()


class Run:
    """A finished run: its result, events and summary."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.dir: Path = result.run_dir
        self.events = read_events(self.dir)
        self.summary = json.loads((self.dir / "summary.json").read_text())

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.of("step")}

    def final_params(self) -> dict[str, Any]:
        """The final model the workers wrote (RUN_DIR/final_model, or the committed final checkpoint), loaded
        into this process as a plain state dict; its digest is checked against the run's."""
        from elastictrain.checkpoint.final import load_final_model
        from elastictrain.parallel.digest import digest_of

        params = load_final_model(self.summary["final_model"])
        assert digest_of(params) == self.summary["final_model_sha256"], "final model on disk != the run's digest"
        return params


def run_job(tmp_path: Path, spec: dict[str, Any], task: Any = None, name: str = "run") -> Run:
    result = Trainer(build_config(spec), task, run_dir=tmp_path / name, console=None).fit()
    return Run(result)


class BackgroundRun:
    """A job running in a thread, so a test can inject real faults from outside while it trains."""

    def __init__(self, tmp_path: Path, spec: dict[str, Any], name: str = "bg") -> None:
        import threading

        self.dir = tmp_path / name
        self.trainer = Trainer(build_config(spec), run_dir=self.dir, console=None)
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.result = self.trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in finish()
            self.error = e

    def wait_for(self, predicate: Any, timeout: float = 180.0) -> dict[str, Any]:
        """Block until an event satisfying ``predicate`` is in events.jsonl; return it."""
        import time

        deadline = time.time() + timeout
        while time.time() < deadline:
            path = self.dir / "events.jsonl"
            if path.exists():
                for e in read_events(self.dir):
                    if predicate(e):
                        return e
            if not self.thread.is_alive():
                if self.error is not None:
                    raise AssertionError(f"the run ended with {self.error!r} before a matching event") from self.error
                break
            self.thread.join(0.05)
        raise AssertionError(f"no matching event within {timeout}s in {self.dir}")

    def events(self) -> list[dict[str, Any]]:
        """The events written so far."""
        path = self.dir / "events.jsonl"
        return read_events(self.dir) if path.exists() else []

    def finish(self, timeout: float = 300.0) -> Run:
        """The finished run. ``timeout`` bounds a hang, not the run's speed: it stays far above what a run
        with a fault and a cold replacement takes on a loaded 2-core machine."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run did not finish"
        if self.error:
            raise self.error
        return Run(self.result)


# ---------------------------------------------------------------- shared clean reference runs
# A run without faults is a pure function of its math (model, data, seed, steps, world size): retries, spares,
# checkpoints, memory snapshots, sample audits and slow-step faults change no number. Tests that compare a
# faulty run with a clean one share one clean run per spec instead of each training its own.
CLEAN_40 = job(train={"steps": 40})


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory):
    """``clean_run(spec)``: the finished fault-free run of ``spec``, trained once per session."""
    done: dict[str, Run] = {}

    def get(spec: dict[str, Any]) -> Run:
        key = json.dumps(spec, sort_keys=True)
        if key not in done:
            _ensure_local_ray()
            run = run_job(tmp_path_factory.mktemp("clean"), spec, name="clean")
            assert run.result.exit_code == 0 and not run.of("failure"), run.summary
            done[key] = run
        return done[key]

    return get


@pytest.fixture(scope="session")
def raised_run(tmp_path_factory) -> Run:
    """One run in which rank 1 raises in its backward of step 5 (its own error, while its peer waits in the
    collectives) and recovers: 12 steps on 2 workers, a checkpoint every 4 steps. Trained once per session
    for the tests that read such a run (tests/test_failures.py: the failure verdict; tests/test_report.py:
    the report of a run with a failure and checkpoints). Read-only for them."""
    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("raised")
    boom = {"rank": 1, "step": 5, "point": "backward", "kind": "raise"}
    spec = job(name="report", train={"steps": 12}, checkpoint={"uri": str(tmp / "ckpt"), "every_steps": 4},
               faults=[boom])
    return run_job(tmp, spec, name="raised")
