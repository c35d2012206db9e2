"""`ray job submit` of the default job against a real `ray start --head`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_runs_the_default_job(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # head and client must agree (Ray 2.60 token auth)
    env.pop("RAY_ADDRESS", None)
    # Every port its own: the session's local Ray already holds the default agent port (52365).
    gcs, dash, agent = _free_port(), _free_port(), _free_port()
    # Its own temp dir: other local Ray instances (the session's) live under /tmp/ray. Kept short for the
    # unix socket path limit.
    temp_dir = tempfile.mkdtemp(prefix="etray", dir="/tmp")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
         f"--dashboard-agent-listen-port={agent}",
         "--dashboard-host=127.0.0.1", "--num-cpus=3", "--include-dashboard=true", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 90
        while time.time() < deadline:
            probe = subprocess.run(["ray", "job", "list", "--address", address], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            time.sleep(1)
        else:
            pytest.fail("ray head did not come up")
        run_dir = tmp_path / "run"
        cmd = (
            ["ray", "job", "submit", "--address", address, "--working-dir", str(REPO),
             "--runtime-env-json", json.dumps({"excludes": ["runs", "checkpoints", ".git"]}), "--",
             sys.executable, "-m", "elastictrain", "run", "jobs/tiny_gpt.yaml", "--set", "train.steps=6",
             "--set", "checkpoint.uri=null", "--run-dir", str(run_dir)])
        for _ in range(20):  # the job agent starts a little after the dashboard answers
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if "No available agent" not in proc.stderr + proc.stdout:
                break
            time.sleep(2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "succeeded" in proc.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["final_step"] == 6 and summary["state"] == "finished"
        assert summary["world_size_history"][0]["world_size"] == 2
    finally:
        os.killpg(head.pid, 15)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
