"""The private local Ray's daemon settings (elastictrain/local_ray.py): ``Trainer`` starts its own Ray with
them in the environment and leaves the caller's environment as it was (a value the user set wins), and the
daemons of a Ray started so run with them (the log monitor, and the raylet, which starts the dashboard agent):
checked on the session's Ray (tests/conftest.py starts it through ``init_local_ray``), no timing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import ray

from elastictrain.local_ray import local_ray_env, local_ray_system_config
from elastictrain.trainer import Trainer


def _fresh_trainer_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Run ``Trainer._init_ray`` as a fresh ``elastictrain run`` process would, recording each ``ray.init``
    call with the daemon settings in the environment at that moment."""
    calls: list[dict[str, Any]] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: calls.append(
        {**kwargs, "env": {k: os.environ.get(k) for k in local_ray_env()}}))
    Trainer({"name": "env-probe"}, console=None, run_dir=tmp_path / "run")._init_ray()
    return calls


def test_trainer_starts_its_ray_with_the_daemon_settings_and_restores_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in local_ray_env():
        monkeypatch.delenv(key, raising=False)  # (the suite's conftest sets them for every Ray it starts)
    (call,) = _fresh_trainer_init(tmp_path, monkeypatch)
    assert call["address"] == "local" and call["_system_config"] == local_ray_system_config()
    assert call["env"] == local_ray_env()
    assert not any(key in os.environ for key in local_ray_env())  # the caller's environment as it was


def test_a_setting_the_user_made_wins_and_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in local_ray_env():
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REPORTER_UPDATE_INTERVAL_MS", "5000")
    (call,) = _fresh_trainer_init(tmp_path, monkeypatch)
    assert call["env"] == {**local_ray_env(), "REPORTER_UPDATE_INTERVAL_MS": "5000"}
    assert os.environ["REPORTER_UPDATE_INTERVAL_MS"] == "5000"
    assert not any(key in os.environ for key in local_ray_env() if key != "REPORTER_UPDATE_INTERVAL_MS")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_the_local_rays_daemons_run_with_them(ray_local) -> None:
    node = ray._private.worker._global_node
    procs = {kind: infos[0].process.pid for kind, infos in node.all_processes.items() if infos}
    want = local_ray_env()
    # (the raylet's agents inherit the raylet's environment; their /proc environ is overwritten by their
    # process title, so it is not read here)
    for kind in ("raylet", "log_monitor"):
        env = _environ(procs[kind])
        assert {k: env.get(k) for k in want} == want, kind
