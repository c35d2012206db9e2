"""`ray job submit` against a real `ray start --head` (plus, for one test, a second local node):
the default job runs unchanged; `ray job stop` makes the driver stop at a step boundary, commit a
just-in-time checkpoint and exit 75; a resubmission with a new submission id continues the same run
(ELASTICTRAIN_RUN_ID) from the committed step and ends with the loss of an uninterrupted run (the default job's
own submission: the same job without the stop); a relative checkpoint URI is refused on several nodes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastictrain.events import read_events
from tests.checkpoint_fixtures import free_port

REPO = Path(__file__).resolve().parents[1]
EXCLUDES = json.dumps({"excludes": ["runs", "checkpoints", ".git"]})


class LocalCluster:
    """`ray start --head` (and on demand one more node), every port its own (the session's local Ray holds the
    defaults)."""

    def __init__(self) -> None:
        # RAY_JOB_STOP_WAIT_TIME_S is read by the job supervisor on the head: time between `ray job stop`'s
        # SIGTERM and its SIGKILL. The default (3 s) is too short for a just-in-time checkpoint.
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_JOB_STOP_WAIT_TIME_S": "120"}
        self.env.pop("RAY_ADDRESS", None)
        # Short temp dir of its own: other local Rays live under /tmp/ray; unix socket paths have a length limit.
        self.temp_dir = tempfile.mkdtemp(prefix="etray", dir="/tmp")
        gcs, dash = free_port(), free_port()
        self.address = f"http://127.0.0.1:{dash}"
        self.procs = [self._start(["--head", f"--port={gcs}", f"--dashboard-port={dash}", "--num-cpus=2",
                                   "--include-dashboard=true", "--dashboard-host=127.0.0.1"])]
        try:
            self._wait_for(lambda: self._get("/api/jobs/") is not None, "ray head did not come up")
        except BaseException:
            self.close()
            raise
        self.gcs = gcs
        self.nodes = 1

    def add_node(self) -> bool:
        """Start a second node (``ray start --address``). Ray gives a raylet a fixed 30 s to register
        (ray/_private/node.py, not configurable); on a loaded machine that can fail: start it again, up to
        five times, then report False (the caller fails and says why: a skip would hide the promise)."""
        for _ in range(5):
            node = self._start([f"--address=127.0.0.1:{self.gcs}", "--num-cpus=1"])
            self.procs.append(node)
            deadline = time.time() + 60
            while time.time() < deadline and node.poll() is None and self.alive_nodes() < 2:
                time.sleep(1)
            if self.alive_nodes() >= 2:
                self.nodes = 2
                return True
        return False

    def remove_nodes(self) -> None:
        """Stop every node but the head. Two nodes on one machine share the head's runtime_resources
        directory, and one node's runtime-env agent may delete a working_dir package the other still runs
        from: the jobs that train run on the head alone."""
        for proc in self.procs[1:]:
            _stop(proc, grace_s=60)  # an orderly leave: the test waits for the node to be gone
        del self.procs[1:]
        self._wait_for(lambda: self.alive_nodes() == 1, "second node did not leave")
        self.nodes = 1

    def _start(self, args: list[str]) -> subprocess.Popen:
        ports = [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
        # Only the head takes the temp dir: a second node in the same one would collide on its socket names.
        temp = [f"--temp-dir={self.temp_dir}"] if "--head" in args else []
        return subprocess.Popen(["ray", "start", "--block", *temp, "--disable-usage-stats", *ports, *args], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    @staticmethod
    def _wait_for(predicate, message: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            time.sleep(1)
        pytest.fail(message)

    def _get(self, path: str) -> Any:
        """The head dashboard's JSON answer to GET ``path``, None while it does not answer. The tests' waits
        ask it in this process: a `ray job list` / `ray list nodes` CLI a second (each imports Ray) was most
        of the CLI processes this module started."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never a proxy
        try:
            with opener.open(self.address + path, timeout=10) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def alive_nodes(self) -> int:
        """Nodes the head's state API lists as ALIVE (``ray list nodes``'s source); 0 while it does not answer."""
        answer = self._get("/api/v0/nodes?limit=1000&detail=false")
        try:
            rows = answer["data"]["result"]["result"]
        except (TypeError, KeyError):
            return 0
        return sum(1 for n in rows if n.get("state") == "ALIVE")

    def ray(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        # `ray job submit ... -- ENTRYPOINT`: options must come before `--`, so --address goes right after the
        # two words of the subcommand ("job submit", "job stop", "list nodes").
        argv = ["ray", *args[:2], "--address", self.address, *args[2:]]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    def submit(self, job_args: list[str], *, runtime_env: dict | None = None, wait: bool = True,
               submission_id: str | None = None) -> subprocess.CompletedProcess:
        env = {**json.loads(EXCLUDES), **(runtime_env or {})}
        cmd = ["job", "submit", "--working-dir", str(REPO), "--runtime-env-json", json.dumps(env)]
        cmd += [] if wait else ["--no-wait"]
        cmd += ["--submission-id", submission_id] if submission_id else []
        cmd += ["--", sys.executable, "-m", "elastictrain", "run", *job_args]
        for _ in range(20):  # the job agent starts a little after the dashboard answers
            proc = self.ray(*cmd)
            if "No available agent" not in proc.stderr + proc.stdout:
                return proc
            time.sleep(2)
        return proc

    def close(self) -> None:
        # Every job has ended by now: nothing is left to save, and SIGTERM reached each Ray process of a node's
        # session at once (gcs, raylet, agents, workers). The head's `ray start` itself then spent ~30 s in an
        # orderly stop that saves nothing: a short grace, then SIGKILL to what is left of the session.
        for proc in reversed(self.procs):
            _stop(proc, grace_s=2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Stop a `ray start --block` and every process of its session: SIGTERM (Ray's own orderly stop), then
    SIGKILL for what is left after ``grace_s`` (the head's orderly stop took ~30 s here, spent waiting on
    processes that have nothing left to save)."""
    _signal_session(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_session(proc, signal.SIGKILL)
    proc.wait(timeout=30)


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the whole session is gone already
        pass


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster()  # stops what it started if it fails to come up
    try:
        yield c
    finally:
        c.close()


# The default job, 30 steps: submitted as it is by test_ray_job_submit_runs_the_default_job, and stopped then
# resubmitted by test_ray_job_stop_then_resubmit_resumes_the_same_run.
DEFAULT_30 = ["jobs/tiny_gpt.yaml", "--set", "train.steps=30"]


@pytest.fixture(scope="module")
def default_job(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """The default job (30 steps, no checkpoint) submitted once per module: test_ray_job_submit_runs_the_default_job
    checks it ran, and it is the uninterrupted run test_ray_job_stop_then_resubmit_resumes_the_same_run compares
    its final loss and weights with."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    proc = cluster.submit([*DEFAULT_30, "--set", "checkpoint.uri=null", "--run-dir", str(run_dir)])
    return proc, run_dir


def _events(run_dir: Path) -> list[dict]:
    """The events written so far (read_events leaves out a record still being written)."""
    return read_events(run_dir) if (run_dir / "events.jsonl").exists() else []


@pytest.mark.slow
def test_ray_job_submit_runs_the_default_job(default_job: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, run_dir = default_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 30 and summary["state"] == "finished"
    assert summary["world_size_history"][0]["world_size"] == 2


@pytest.mark.slow
def test_relative_checkpoint_uri_is_refused_on_several_nodes(cluster: LocalCluster, tmp_path: Path) -> None:
    try:
        assert cluster.add_node(), "the second local Ray node did not register in 5 tries of Ray's fixed 30 s"
        # jobs/tiny_gpt.yaml says checkpoint.uri: ./checkpoints; in a Ray working dir on 2 nodes that is refused.
        proc = cluster.submit(["jobs/tiny_gpt.yaml", "--run-dir", str(tmp_path / "rel")])
    finally:
        cluster.remove_nodes()
    out = proc.stdout + proc.stderr
    assert "config error" in out and "relative path" in out and "cluster of 2 nodes" in out, out[-3000:]
    assert "failed" in proc.stdout and not (tmp_path / "rel").exists()


@pytest.mark.slow
def test_ray_job_stop_then_resubmit_resumes_the_same_run(cluster: LocalCluster, tmp_path: Path,
                                                         default_job: tuple[subprocess.CompletedProcess, Path]) -> None:
    ckpt = tmp_path / "ckpt"
    # every step 1 s longer (0.5 s a micro-batch): `ray job stop` (a CLI that imports Ray, then the
    # supervisor's SIGTERM) lands mid-run however long it takes on a loaded machine -- 24 steps after step 6,
    # cut short by the stop (at 0.3 s a step, a window that a loaded CLI start could outlast). From
    # step 1, not from step 6: the hang bound follows the median step time, and steps that turned slow
    # mid-run would look hung under it
    slow = "[{rank: 0, step: 1, kind: slow, seconds: 0.5, generation: null}]"
    # no standby process and no peer-tier keeper (the default job's, each a process importing torch beside
    # both submissions): the stop's promise is the driver's (a step boundary, a just-in-time checkpoint, exit
    # 75) and neither changes a number; the default job's own submission keeps both
    args = [*DEFAULT_30, "--set", f"checkpoint.uri={ckpt}", "--set", "checkpoint.every_steps=0",
            "--set", "checkpoint.memory_every_steps=0", "--set", "workers.standby=false"]
    slow_steps = ["--set", f"faults={slow}"]  # only the first submission: the stop lands mid-run
    # The stable run id comes from the environment, as the k8s manifests set it; the job file has none.
    runtime_env = {"env_vars": {"ELASTICTRAIN_RUN_ID": "lifecycle-1"}}
    submission = f"lifecycle-{uuid.uuid4().hex[:8]}"
    first = cluster.submit([*args, *slow_steps, "--run-dir", str(tmp_path / "a")], runtime_env=runtime_env,
                           wait=False, submission_id=submission)
    assert first.returncode == 0, first.stdout + first.stderr
    deadline = time.time() + 240
    while not any(e.get("step", 0) >= 6 for e in _events(tmp_path / "a") if e["event"] == "step"):
        assert time.time() < deadline, f"the first submission never reached step 6: {_events(tmp_path / 'a')[-3:]}"
        time.sleep(0.2)
    stop = cluster.ray("job", "stop", submission)  # SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S
    assert stop.returncode == 0, stop.stdout + stop.stderr
    first_events = _events(tmp_path / "a")
    (pre,) = [e for e in first_events if e["event"] == "preempted"]
    assert pre["checkpoint"] is True and 6 <= pre["step"] < 30
    (done,) = [e for e in first_events if e["event"] == "run_finished"]
    assert done["exit_code"] == 75 and done["state"] == "preempted"
    assert first_events[0]["run_id"] == "lifecycle-1"

    # A new submission id, as a RayJob retry on a fresh cluster has: only ELASTICTRAIN_RUN_ID links the two.
    # (Without the slow steps: they change no number.)
    second = cluster.submit([*args, "--run-dir", str(tmp_path / "b")], runtime_env=runtime_env,
                            submission_id=f"lifecycle-{uuid.uuid4().hex[:8]}")
    assert second.returncode == 0 and "succeeded" in second.stdout, second.stdout[-3000:] + second.stderr[-3000:]
    second_events = _events(tmp_path / "b")
    (resumed,) = [e for e in second_events if e["event"] == "resumed"]
    assert resumed["step"] == pre["step"]
    assert [e["step"] for e in second_events if e["event"] == "step"][0] == pre["step"] + 1
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["final_step"] == 30

    # The same job, uninterrupted (no stop, no slow step, no checkpoint, with the standby and the keeper: none
    # changes a number), submitted to the
    # same cluster once for the module: same final loss and weights.
    clean_proc, clean_dir = default_job
    assert clean_proc.returncode == 0, clean_proc.stdout[-3000:] + clean_proc.stderr[-3000:]
    clean = json.loads((clean_dir / "summary.json").read_text())
    assert clean["final_step"] == 30 and clean["failures"] == 0
    assert summary["final_loss"] == clean["final_loss"]
    assert summary["final_model_sha256"] == clean["final_model_sha256"]
