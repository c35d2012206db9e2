"""Checkpoints inside real training runs: periodic async saves, preemption with a just-in-time save,
resume on a fresh start (also at another world size), corrupt checkpoints skipped, S3 through moto."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastictrain.checkpoint import CheckpointStore
from elastictrain.events import read_events
from tests.checkpoint_fixtures import DUMMY_SECRET, s3_bucket, s3_server  # noqa: F401 - fixtures
from tests.cluster_fixtures import SLOW
from tests.conftest import CLEAN_40, job, run_job


def _ckpt(tmp_path: Path, **extra) -> dict:
    # when_busy=wait: under load a save may still be writing at the next interval; skipping is tested apart
    return {"uri": str(tmp_path / "ckpt"), "every_steps": 5, "keep_last": 2, "resume": "auto", "when_busy": "wait",
            **extra}


@pytest.fixture(scope="module")
def periodic(tmp_path_factory):
    """Run "per": 20 steps on 2 workers, a checkpoint every 5, the last 2 kept (15 and 20). The periodic test
    reads it; the resume and corrupt-checkpoint tests each work on their own copy of its checkpoint root."""
    from tests.conftest import _ensure_local_ray

    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("periodic")
    run = run_job(tmp, job(name="per", train={"steps": 20}, checkpoint=_ckpt(tmp)))

    def copy_to(tmp_path: Path) -> Path:
        import shutil

        shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
        return tmp_path / "ckpt" / "per"

    run.copy_to = copy_to
    run.root = tmp / "ckpt" / "per"
    return run


def test_periodic_checkpoints_commit_and_retain(periodic):
    run = periodic
    saved = [e["step"] for e in run.of("checkpoint_saved")]
    assert saved == [5, 10, 15, 20], run.of("checkpoint_failed")
    store = CheckpointStore(str(run.root))
    assert [m.step for m in store.committed()] == [15, 20]  # keep_last=2
    newest, skipped = store.latest_valid()
    assert newest.step == 20 and not skipped and newest.world_size == 2
    assert not store.verify(newest)


def _write_job(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_preempted_then_resumed_run_is_bitwise_identical(tmp_path, ray_local, clean_run):
    import ray

    # a hang bound of 15 s at least: the first run's steps turn slow mid-run (below), which a bound of 10x
    # the median step time so far (2 s) could take for a hang on a loaded machine
    spec = job(name="pre", train={"steps": 40}, faults=SLOW, checkpoint=_ckpt(tmp_path, every_steps=0),
               timeouts={**job()["timeouts"], "watchdog_floor_s": 15})
    # the first run's steps from 13 on take a second more (no number changes): the SIGTERM lands mid-run
    # however late this process sees step 12 on a loaded machine (28 steps at the SLOW pace were its window)
    late = {"rank": 0, "step": 13, "kind": "slow", "seconds": 0.5, "generation": 0}
    path = _write_job(tmp_path, {**spec, "faults": SLOW + [late]})
    # Both drivers join the session's Ray (a driver that starts its own is run by test_readme.py)
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "elastictrain", "run", "--ray-address", address, "--run-dir"]
    proc = subprocess.Popen(cmd + [str(tmp_path / "a"), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not ((tmp_path / "a" / "events.jsonl").exists()
               and any(e["event"] == "step" and e["step"] >= 12 for e in read_events(tmp_path / "a"))):
        assert time.time() < deadline and proc.poll() is None, "the first run never reached step 12"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what `ray job stop` and Kubernetes send
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]
    first = read_events(tmp_path / "a")
    (pre,) = [e for e in first if e["event"] == "preempted"]
    assert pre["checkpoint"] is True and pre["step"] >= 12
    # Resubmit the same job (a new cluster would do the same): resume: auto picks up the committed step.
    # (Its job file without the late slow steps: they would slow its steps 13.. too, changing no number.)
    again = subprocess.run(cmd + [str(tmp_path / "b"), str(_write_job(tmp_path, spec))], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    second = [json.loads(line) for line in (tmp_path / "b" / "events.jsonl").read_text().splitlines()]
    (resumed,) = [e for e in second if e["event"] == "resumed"]
    assert resumed["step"] == pre["step"]
    assert [e["step"] for e in second if e["event"] == "step"][0] == pre["step"] + 1
    clean = clean_run(CLEAN_40)  # the same 40 steps on 2 workers, uninterrupted
    resumed_summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert resumed_summary["final_model_sha256"] == clean.summary["final_model_sha256"]


def test_resume_at_another_world_size_and_skip_corrupt(tmp_path, ray_local, periodic):
    ck = _ckpt(tmp_path, keep_last=5)
    root = periodic.copy_to(tmp_path)  # run "per" on 2 workers: commits 15 and 20
    store = CheckpointStore(str(root))
    newest = store.committed()[-1]
    assert newest.step == 20
    shard = next(p for p in root.glob("step_*20/**/*") if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte
    shard.write_bytes(bytes(data))
    # 25 steps instead of 20 changes the cosine schedule: accepted on purpose (checkpoint.accept_changes)
    one = run_job(tmp_path, job(name="per", train={"steps": 25}, workers={"min": 1, "max": 1},
                                checkpoint={**ck, "accept_changes": ["schedule"]}), name="one")
    # the driver checks sizes only; the rank that read step 20 found the SHA-256 mismatch, step 15 was loaded
    (bad,) = [e for e in one.of("checkpoint_failed") if "could not load" in e["reason"]]
    assert "SHA-256 mismatch" in bad["reason"] and bad["step"] == 20, bad
    (resumed,) = one.of("resumed")
    assert resumed["step"] == 15 and resumed["world_size"] == 1 and resumed["from_world_size"] == 2
    assert one.summary["final_step"] == 25 and one.result.exit_code == 0


def test_explicit_corrupt_checkpoint_is_a_clear_error(tmp_path, periodic):
    ck = _ckpt(tmp_path)
    step_dir = periodic.copy_to(tmp_path) / "step_000000020"  # run "per"'s last commit
    (step_dir / "manifest.json").write_text("{not json")
    spec = job(name="per", train={"steps": 25}, checkpoint={**ck, "resume": str(step_dir)})
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(_write_job(tmp_path, spec))],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "checkpoint error" in proc.stderr and str(step_dir) in proc.stderr and "Traceback" not in proc.stderr


def test_checkpoints_to_s3(tmp_path, ray_local, s3_server, s3_bucket):
    opts = s3_server.options()
    ck = {"uri": f"{s3_bucket}/runs", "every_steps": 4, "storage_options": opts, "resume": "auto",
          "when_busy": "wait"}
    run = run_job(tmp_path, job(name="s3", train={"steps": 8}, checkpoint=ck))
    assert [e["step"] for e in run.of("checkpoint_saved")] == [4, 8], run.of("checkpoint_failed")
    store = CheckpointStore(f"{s3_bucket}/runs/s3", opts)
    newest, _ = store.latest_valid()
    assert newest.step == 8
    # Credentials never reach the events or the manifest.
    assert DUMMY_SECRET not in (run.dir / "events.jsonl").read_text()
    assert DUMMY_SECRET not in json.dumps(newest.meta)
