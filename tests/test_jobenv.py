"""Edge decisions for `ray job submit`: the stable run id and relative checkpoint URIs (pure functions)."""

from __future__ import annotations

import json

import pytest

from elastictrain import ConfigError, build_config
from elastictrain.jobenv import decide_checkpoint_uri, ray_working_dir, resolve_for_driver, resolve_run_id
from tests.conftest import job

IN_WD = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}})}


def test_run_id_from_environment_unless_the_job_sets_one() -> None:
    env = {"ELASTICTRAIN_RUN_ID": "attempt-proof"}
    assert resolve_run_id(build_config({"name": "n"}), env).stable_id == "attempt-proof"
    assert resolve_run_id(build_config({"name": "n", "run_id": "mine"}), env).stable_id == "mine"
    assert resolve_run_id(build_config({"name": "n"}), {}).stable_id == "n"
    assert resolve_run_id(build_config({"name": "n"}), {"ELASTICTRAIN_RUN_ID": "  "}).stable_id == "n"


def test_working_dir_detected_from_the_job_config_ray_sets() -> None:
    assert ray_working_dir(IN_WD) == "gcs://_ray_pkg_abc.zip"
    assert ray_working_dir({}) is None
    assert ray_working_dir({"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {}})}) is None


@pytest.mark.parametrize(("uri", "wd", "nodes", "expected"), [
    ("./checkpoints", None, 3, "/home/me/checkpoints"),           # the user's own directory
    ("s3://b/p", "gcs://pkg", 3, "s3://b/p"),                      # never touched
    ("/mnt/fsx/ckpt", "gcs://pkg", 3, "/mnt/fsx/ckpt"),
    ("ckpt", "gcs://pkg", 1, "/home/ray/ckpt"),                    # one node: the Ray user's home
    (None, "gcs://pkg", 3, None),
])
def test_checkpoint_uri_decision(uri, wd, nodes, expected) -> None:
    d = decide_checkpoint_uri(uri, cwd="/home/me", working_dir=wd, alive_nodes=nodes, home="/home/ray")
    assert d.uri == expected
    assert (d.note is not None) == (uri == "ckpt")


def test_relative_uri_refused_under_a_working_dir_on_several_nodes() -> None:
    with pytest.raises(ConfigError, match=r"relative path .* cluster of 2 nodes.*s3://"):
        decide_checkpoint_uri("./checkpoints", cwd="/tmp/x", working_dir="gcs://pkg", alive_nodes=2, home="/h")
    cfg = build_config({"checkpoint": {"uri": "./checkpoints"}})
    with pytest.raises(ConfigError):
        resolve_for_driver(cfg, IN_WD, alive_nodes=2)
    resolved, notes = resolve_for_driver(cfg, {}, alive_nodes=2)
    assert resolved.checkpoint.uri.endswith("/checkpoints") and resolved.checkpoint.uri.startswith("/") and not notes


def test_relative_input_paths_made_absolute_outside_a_working_dir(tmp_path, monkeypatch) -> None:
    """A relative corpus or model directory is opened by the workers from their Ray's directory, not the
    driver's: made absolute against the driver's directory, unless the job ships a working directory."""
    from elastictrain.jobenv import absolute_input

    assert absolute_input("prepared", cwd="/home/u/job", working_dir=None) == "/home/u/job/prepared"
    assert absolute_input("./a/../b", cwd="/w", working_dir=None) == "/w/b"
    for unchanged in ("builtin:pydoc", "s3://bucket/corpus", "/abs/corpus", None):
        assert absolute_input(unchanged, cwd="/w", working_dir=None) == unchanged
    assert absolute_input("prepared", cwd="/w", working_dir="/tmp/ray/pkg") == "prepared"

    monkeypatch.chdir(tmp_path)
    config = build_config(job(task={"data": {"source": "corpus.parquet"}}))
    resolved, _ = resolve_for_driver(config, {})
    assert resolved.task.data.source == str(tmp_path / "corpus.parquet")
    assert resolved.task.init_from is None
