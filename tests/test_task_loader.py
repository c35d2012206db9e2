"""`task.kind: python`: the entry is imported from the working directory on the driver; mistakes are config
errors (exit 2) that name what was tried; the transformers example trains on 2 workers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain import ConfigError, Task, build_config
from elastictrain.task_loader import load_entry, task_from_config

REPO = Path(__file__).resolve().parents[1]

USER_MODULE = '''
import torch
from elastictrain import Task

def make_task(width=4):
    return Task(model_fn=lambda: torch.nn.Linear(width, 1), loss_fn=None, optimizer_fn=None, dataset_fn=None)

def not_a_task():
    return {"model": "nope"}
'''


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [n for n in sys.modules if n == "mypkg" or n.startswith("mypkg.")]:
        del sys.modules[name]


def test_entry_found_in_working_directory_with_args(user_dir: Path) -> None:
    config = build_config({"task": {"kind": "python", "entry": "mypkg.tasks:make_task", "args": {"width": 3}}})
    task = task_from_config(config)
    assert isinstance(task, Task)
    assert task.model_fn().in_features == 3


@pytest.mark.parametrize(("entry", "args", "expected"), [
    ("nopkg.tasks:make_task", {}, "no module named 'nopkg.tasks' (looked in the working directory"),
    ("mypkg.tasks:make_tsk", {}, "has no function 'make_tsk'; its functions: make_task, not_a_task"),
    ("mypkg.tasks:not_a_task", {}, "not_a_task() returned dict, not an elastictrain.Task"),
    ("mypkg.tasks:make_task", {"depth": 2}, "calling make_task(**task.args) with task.args={'depth': 2}"),
])
def test_wrong_entry_is_a_config_error_naming_what_was_tried(user_dir: Path, entry: str, args: dict,
                                                             expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_entry(entry, args)
    assert f"task.entry={entry!r}" in str(info.value)
    assert expected in str(info.value)


def test_cli_exits_2_before_ray_on_a_wrong_entry(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: bad\ntask: {kind: python, entry: 'nopkg.mod:make_task'}\n")
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(job), "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "127.0.0.1:1"})
    assert proc.returncode == 2, proc.stderr
    assert "config error" in proc.stderr and "no module named 'nopkg.mod'" in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started: no run directory, no Ray (RAY_ADDRESS is bogus)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (optional extra: pip install 'elastictrain[hf]')")
def test_hf_causal_lm_job_trains(ray_local, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictrain import Trainer, load_config

    from tests.conftest import Run

    monkeypatch.chdir(REPO)  # as under `ray job submit --working-dir .`
    config = load_config(REPO / "jobs" / "hf_causal_lm.yaml", [
        "train.steps=8", "train.global_batch=16", "train.micro_batch=4", "checkpoint.uri=null",
        "task.args.seq_len=32", "task.args.model={n_embd: 32, n_layer: 1, n_head: 2}", "task.args.warmup_steps=2",
        "task.args.total_steps=8",
        "workers.reuse=true", "workers.standby=false", "checkpoint.memory_every_steps=0"])  # as BASE_JOB
    run = Run(Trainer(config, run_dir=tmp_path / "hf", console=None).fit())
    assert run.result.ok, run.summary
    losses = run.losses()
    assert sorted(losses) == list(range(1, 9))
    assert run.summary["world_size_history"][0]["world_size"] == 2
    assert losses[8] < losses[1] - 0.5, losses  # starts near ln(256) = 5.5 and learns byte statistics


@pytest.mark.parametrize("path", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_file_loads_with_its_task(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `ray job submit --working-dir . -- python -m elastictrain run jobs/<job>.yaml` does first."""
    from elastictrain import load_config

    monkeypatch.chdir(REPO)
    config = load_config(path)
    if config.task.kind == "python" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (optional extra: pip install 'elastictrain[hf]')")
    assert isinstance(task_from_config(config), Task)
