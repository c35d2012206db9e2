"""Bad config files get one clear line naming the problem and the fix, before Ray is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from elastictrain import ConfigError, build_config, load_config
from tests.conftest import job

REPO = Path(__file__).resolve().parents[1]


def _cli(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "elastictrain", "run", str(path), *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_shipped_job_is_valid():
    cfg = load_config(REPO / "jobs" / "tiny_gpt.yaml")
    assert cfg.workers.max == 2 and cfg.parallel.plan == "ddp"


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown key 'train.stpes'.*did you mean 'train.steps'"):
        build_config(job(train={"stpes": 3}))


def test_impossible_world_size_lists_valid_sizes():
    with pytest.raises(ConfigError, match=r"valid world sizes up to workers.max=3: \[1, 2\]"):
        build_config(job(workers={"min": 1, "max": 3}, train={"global_batch": 16, "micro_batch": 4}))


def test_timeouts_must_be_ordered():
    with pytest.raises(ConfigError, match="strictly increasing.*collective_s=50"):
        build_config(job(timeouts={"collective_s": 50, "step_watchdog_cap_s": 20}))


def test_override_parses_yaml_values():
    cfg = load_config(REPO / "jobs" / "tiny_gpt.yaml", ["train.steps=7", "workers.use_gpu=false"])
    assert cfg.train.steps == 7
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(REPO / "jobs" / "tiny_gpt.yaml", ["train.steps"])


def test_config_is_frozen():
    cfg = build_config(job())
    with pytest.raises(pydantic.ValidationError, match="frozen_instance"):
        cfg.train.steps = 5  # type: ignore[misc]
    assert cfg.train.steps == 20


@pytest.mark.parametrize("text, needle", [
    ("train: {stpes: 3}\n", "did you mean 'train.steps'"),
    ("train: {steps: -1}\n", "train.steps"),
    ("train: [unclosed\n", "not valid YAML at line"),
    ("workers: {min: 3, max: 2}\n", "workers.min=3 exceeds workers.max=2"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("parallel: {plan: zero7}\n", "parallel.plan"),
    ("parallel: {pp: 2, pp_schedule: dualpipev}\n",
     "parallel.pp_schedule: Input should be 'gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble' or 'zbv'"),
    ("parallel: {pp: 2, pp_schedule: zbv, stages_per_rank: 4}\n", "zbv runs exactly 2 stages per rank"),
    ("parallel: {pp: 2, pp_schedule: interleaved_1f1b}\nworkers: {min: 2, max: 2}\n",
     "task.model.n_layer=2 blocks cannot fill 4 pipeline stages"),
])
def test_cli_reports_bad_config_in_one_line(tmp_path, text, needle):
    proc = _cli(tmp_path, text)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing started


def test_cli_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_cli_help_listing_and_a_config_error_do_not_import_torch(tmp_path):
    """The command line answers ``--help``, ``ckpt ls`` of a missing path and a bad job file without importing
    torch (seconds on a busy machine); ``from elastictrain import Trainer`` still works (imported on use)."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module('elastictrain', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('rc', e.code, 'torch' in sys.modules)\n"
    )
    (tmp_path / "bad.yaml").write_text("train: {stpes: 3}\n")
    for args, rc in ((["--help"], 0), (["ckpt", "ls", str(tmp_path / "nothing")], 2), (["run", "bad.yaml"], 2)):
        proc = subprocess.run([sys.executable, "-c", probe, "elastictrain", *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
        assert proc.stdout.strip().splitlines()[-1] == f"rc {rc} False", (args, proc.stdout, proc.stderr)
    proc = subprocess.run([sys.executable, "-c", "import sys, elastictrain; assert 'torch' not in sys.modules; "
                           "from elastictrain import Trainer, Task; print(Trainer.__module__, Task.__module__)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["elastictrain.trainer", "elastictrain.task"], proc.stderr


def test_gpus_asked_of_a_local_ray_without_them_is_a_config_error(tmp_path):
    from elastictrain.preflight import check_local_gpus

    gpu = build_config(job(workers={"use_gpu": True, "reuse": False, "min": 2, "max": 4}))
    with pytest.raises(ConfigError, match=r"workers.use_gpu=true.*workers.min=2.*has 1 that torch can use"):
        check_local_gpus(gpu, 1)
    check_local_gpus(gpu, 2)  # min fits: the run starts and grows as GPUs appear (none will, locally)
    check_local_gpus(build_config(job(workers={"min": 2, "max": 4})), 0)  # no GPU asked
    import torch

    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU: the command below would train")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(REPO / "jobs" / "tiny_gpt.yaml"), "--set",
                           "workers.use_gpu=true", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "workers.use_gpu=false" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started, no run directory


def test_a_ray_address_where_nothing_answers_is_one_config_error_line(tmp_path):
    """Ray's own connect waits without end for a refused local port; the driver says it at once (exit 2)."""
    import socket

    from elastictrain.preflight import ray_endpoint

    assert ray_endpoint("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert ray_endpoint("ray://head.svc:10001") == ("head.svc", 10001)
    assert ray_endpoint("[::1]:6379") == ("::1", 6379)
    assert ray_endpoint("auto") is None and ray_endpoint("local") is None
    with socket.socket() as s:  # a port nothing listens on: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for extra, address_env, where in ((["--ray-address", f"127.0.0.1:{port}"], None, "--ray-address"),
                                      ([], f"127.0.0.1:{port}", "RAY_ADDRESS")):
        run_env = env if address_env is None else {**env, "RAY_ADDRESS": address_env}
        proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(REPO / "jobs" / "tiny_gpt.yaml"),
                               "--run-dir", str(tmp_path / "run"), *extra],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=run_env)
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.strip().splitlines() if "authentication" not in ln]  # Ray's notice
        assert len(lines) == 1 and f"cannot reach a Ray cluster at '127.0.0.1:{port}' ({where})" in lines[0], lines
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_every_config_key_is_documented():
    from elastictrain.config import JobConfig, _all_keys

    text = (REPO / "docs" / "config.md").read_text()
    keys = _all_keys(JobConfig)
    leaves = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    missing = [k for k in leaves if f"`{k}`" not in text]
    assert not missing, f"document these keys in docs/config.md: {missing}"


def test_peer_tier_is_on_by_default_and_its_budget_must_be_positive():
    spec = job()
    del spec["checkpoint"]  # BASE_JOB turns the tier off (its keeper process); the default is what is checked
    c = build_config(spec).checkpoint
    assert c.memory_every_steps == 10 and c.memory_budget_gib is None  # sized from the job (checkpoint/tier_budget.py)
    for bad in (0, -1.5, "nan"):
        with pytest.raises(ConfigError, match=r"checkpoint.memory_budget_gib: .*(greater than 0|finite)"):
            build_config(job(checkpoint={"memory_budget_gib": bad}))


def test_the_tests_base_job_starts_no_process_beyond_its_workers(tmp_path, monkeypatch):
    """The suite's time is mostly processes importing torch (#21 item 14): a run of tests/conftest.py's
    BASE_JOB starts no peer-tier keeper and no standby; the tests about those turn them on. Asked of the
    code that starts them (the gatherer's keepers, the group's first standby), beside a job that starts
    both, so that the check sees a start when there is one (no Ray here: the starts are recorded)."""
    import ray

    from elastictrain.controller.gather import SourceGatherer
    from elastictrain.controller.group import Slot, SlotState, WorkerGroup
    from elastictrain.events import EventLog

    def starts(spec: dict) -> list[str]:
        started: list[str] = []
        config = build_config(spec)
        # the keepers: one per alive node Ray lists (here one; none is created: the listing is recorded)
        monkeypatch.setattr(ray, "nodes", lambda: started.append("keeper") or [])
        sources = SourceGatherer(config, EventLog(tmp_path, console=None), None, None, None, None, lambda w: None)
        sources.start_keepers()
        group = object.__new__(WorkerGroup)  # the group's own decision, without placing processes on a Ray
        group.config, group._standby_started = config, False
        group.by_state = lambda *states: [Slot(0, state=SlotState.MEMBER)]
        group._start_standby = lambda index, phase=None: started.append("standby")
        group.start_first_standby()
        return started

    assert starts(job()) == []
    on = job(workers={"standby": True}, checkpoint={"memory_every_steps": 10})
    assert starts(on) == ["keeper", "standby"]


def test_version_option_prints_the_package_version() -> None:
    from click.testing import CliRunner

    import elastictrain
    from elastictrain.cli import main

    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output == f"elastictrain {elastictrain.__version__}\n", out.output


def test_hsdp_on_gpus_needs_whole_nodes_or_a_shard_size() -> None:
    """hsdp on GPUs with parallel.shard_size unset shards over a node's GPUs: a world that is not a
    multiple of them is a config error (exit 2 through the CLI) naming parallel.shard_size, found on the
    driver once it knows the cluster's GPUs per node -- not after every worker started (#21 item 9)."""
    from elastictrain.preflight import check_plan_on_gpus

    spec = job(workers={"min": 4, "max": 12, "use_gpu": True, "reuse": False}, parallel={"plan": "hsdp"},
               train={"global_batch": 96, "micro_batch": 1})
    cfg = build_config(spec)  # the node's GPUs are unknown here: only the data rule is checked
    with pytest.raises(ConfigError) as e:
        check_plan_on_gpus(cfg, gpus_per_node=8)
    msg = str(e.value)
    assert "parallel.shard_size" in msg and "workers.min=4" in msg and "8 GPUs" in msg and "\n" not in msg
    check_plan_on_gpus(cfg, gpus_per_node=4)  # 4 and 12 are whole 4-GPU groups
    check_plan_on_gpus(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"shard_size": 2})}), 8)
    check_plan_on_gpus(cfg, gpus_per_node=None)  # no GPU node (yet): the controller waits for capacity
