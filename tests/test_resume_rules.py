"""Reruns, resumes and run isolation (issue 8 items 1, 2, 4, 9, 10): what a user meets running a job
again, changing it, starting over, or pointing it at a checkpoint that does not fit."""

from __future__ import annotations

import sys

import ray.cloudpickle

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_fixtures import trained

from elastictrain import Task, Trainer, build_config
from elastictrain.checkpoint import CheckpointStore, CheckpointWriter, app_state
from elastictrain.checkpoint.compat import compare, driver_fingerprint, refusal
from elastictrain.config import CheckpointConfig
from elastictrain.controller.admission import admit
from elastictrain.task import builtin_task
from tests.conftest import job, run_job

# the user tasks below travel to the Ray workers by value: the workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _ckpt(tmp_path: Path, **extra) -> dict:
    return {"uri": str(tmp_path / "ckpt"), "every_steps": 2, "keep_last": 2, "when_busy": "wait", **extra}


def _cli(tmp_path: Path, spec: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run([sys.executable, "-m", "elastictrain", "run", str(path), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


# Past the warm-up at step 4 (warmup_steps 1): the cosine of steps 2..4 depends on train.steps, so a longer
# run changes the schedule (the extension test); the other tests only need a finished run's commits.
_OPT = {"optimizer": {"lr": 3e-3, "warmup_steps": 1}}
# One worker: these rules (rerun, extend, start over, a corrupt shard) are decided by the driver and a rank's
# load whatever the world size; a second worker process would add a process start to each run, nothing more.
_ONE = {"min": 1, "max": 1}


def _finished_spec(root: Path, **train) -> dict:
    return job(name="base", train={"steps": 4, **train}, checkpoint=_ckpt(root), task=_OPT, workers=_ONE)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished run "base" (4 steps, commits 2 and 4) that the tests below rerun, extend, branch from or
    corrupt, each on its own copy of the checkpoint root (a test's writes never reach another's)."""
    from tests.conftest import _ensure_local_ray

    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("finished")
    run = run_job(tmp, _finished_spec(tmp), name="first")
    assert run.result.exit_code == 0 and run.summary["checkpoints_committed"] == [2, 4], run.summary

    def copy_to(tmp_path: Path) -> Path:
        import shutil

        shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
        return tmp_path / "ckpt" / "base"

    run.copy_to = copy_to
    return run


def test_rerun_of_a_finished_run_and_a_reused_run_dir(tmp_path, finished):
    """Item 1: the quickstart run twice says 'already finished' (exit 0, no traceback); a reused --run-dir is
    refused (exit 2) instead of appending a second run to its events.jsonl."""
    first = finished
    assert first.result.exit_code == 0 and first.summary["checkpoints_committed"] == [2, 4]
    root = first.copy_to(tmp_path)
    again = _cli(tmp_path, _finished_spec(tmp_path))
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr + again.stdout
    step4 = CheckpointStore(str(root)).step_uri(4)
    assert (f"run base already finished at step 4 from checkpoint {step4}; to train again use a new run_id "
            "or --set checkpoint.resume=never") in again.stdout
    before = (first.dir / "events.jsonl").read_text()
    reused = _cli(tmp_path, job(name="other", train={"steps": 2}), "--run-dir", str(first.dir))
    assert reused.returncode == 2 and "already holds a run" in reused.stderr and "Traceback" not in reused.stderr
    assert (first.dir / "events.jsonl").read_text() == before


def test_changed_schedule_refused_then_extended_on_purpose(tmp_path, ray_local, finished):
    """Item 2: more train.steps changes the cosine schedule: exit 3 naming it and the ways out; with
    checkpoint.accept_changes=[schedule] the run continues from its checkpoint to the new end."""
    root = finished.copy_to(tmp_path)  # the 4 steps of run "base", past the warm-up (_OPT)
    longer = _finished_spec(tmp_path, steps=6)
    refused = _cli(tmp_path, longer)
    assert refused.returncode == 3, refused.stderr
    err = refused.stderr
    assert "checkpoint error" in err and "schedule: the learning-rate multiplier at step" in err
    assert "checkpoint.accept_changes=[schedule]" in err and "checkpoint.resume=never" in err
    assert "Traceback" not in err
    ok = run_job(tmp_path, job(name="base", train={"steps": 6}, task=_OPT, workers=_ONE,
                               checkpoint=_ckpt(tmp_path, accept_changes=["schedule"])), name="ext")
    (resumed,) = ok.of("resumed")
    assert resumed["step"] == 4 and ok.summary["final_step"] == 6 and ok.result.exit_code == 0
    # the new manifest carries the new schedule: the next resume compares with the extended run
    newest = CheckpointStore(str(root)).committed()[-1]
    assert newest.step == 6 and newest.meta["fingerprint"]["schedule"][-1][0] == 5


def test_data_order_keys_can_never_be_accepted():
    cfg = build_config(job(checkpoint={"uri": "/x", "accept_changes": ["schedule", "data"]}))
    saved = driver_fingerprint(cfg, builtin_task(cfg).lr_fn, True)
    other = build_config(job(train={"global_batch": 32}))
    now = driver_fingerprint(other, builtin_task(other).lr_fn, True)
    diffs = compare(saved, now, builtin_task(other).lr_fn)
    assert {d.key for d in diffs} == {"train.global_batch"}
    why = refusal(diffs, cfg.checkpoint.accept_changes, "loc", "t")
    assert "train.global_batch: 16 in the checkpoint, 32 now" in why and "accept_changes" not in why


def test_resume_never_isolates_the_new_run(tmp_path, ray_local, finished):
    """Item 4: resume=never next to an existing run gets a new unique run id and its own root; the old
    run's commits are untouched (retention never deletes them, a fallback never loads them)."""
    old_root = finished.copy_to(tmp_path)  # run "base": commits 2 and 4
    old = {str(p): p.read_bytes() for p in old_root.glob("step_*/manifest.json")}
    assert len(old) == 2
    fresh = run_job(tmp_path, job(name="base", train={"steps": 6}, workers=_ONE,
                                  checkpoint=_ckpt(tmp_path, resume="never")), name="fresh")
    assert fresh.result.exit_code == 0 and not fresh.of("resumed")
    new_id = fresh.summary["run_id"]
    assert new_id.startswith("base-") and fresh.summary["checkpoint_root"] == str(tmp_path / "ckpt" / new_id)
    assert fresh.of("run_started")[0]["run_id"] == new_id and "another run" in fresh.of("run_started")[0]["note"]
    assert {str(p): p.read_bytes() for p in old_root.glob("step_*/manifest.json")} == old
    mine = CheckpointStore(fresh.summary["checkpoint_root"]).committed()
    assert [m.step for m in mine] == [4, 6] and {m.meta["lineage"] for m in mine} == {fresh.summary["lineage"]}
    assert mine[0].meta["run_id"] == new_id


def _save(root: str, steps: list[int], lineage: str) -> CheckpointStore:
    store = CheckpointStore(root)
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait"), root, 0, 1, None)
    try:
        for step in steps:
            model, opt = trained(seed=step)
            assert writer.save_async(step, app_state(model, opt))
            (report,) = writer.wait(30)
            store.commit(step, [report], {"world_size": 1, "lineage": lineage})
    finally:
        writer.close()
    return store


def test_retention_and_fallback_see_only_their_own_lineage(tmp_path):
    """Item 4 at the store: two trajectories under one root (an old run's commits, then ours)."""
    root = str(tmp_path / "run")
    _save(root, [2, 4, 6, 8], "theirs")
    store = _save(root, [10, 12], "mine")
    assert store.latest_valid(checksums=False, lineage="theirs")[0].step == 8
    assert store.latest_valid(checksums=False, lineage="mine")[0].step == 12
    assert store.older_valid(10, "mine") is None and store.older_valid(10, "theirs").step == 8
    assert store.retain(keep_last=1, keep_every=0, lineage="mine") == [10]
    assert [m.step for m in store.committed()] == [2, 4, 6, 8, 12]


class _Linear(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, width)

    def forward(self, x: torch.Tensor, *_: object) -> torch.Tensor:
        return self.fc(x)


def _user_task(width: int) -> Task:
    return Task(model_fn=lambda: _Linear(width), loss_fn=lambda m, b, _s: m(b["x"]).pow(2).mean(dim=1),
                optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.01),
                dataset_fn=lambda: [{"x": torch.full((8,), float(i))} for i in range(64)])


def test_incompatible_model_is_a_checkpoint_error_not_a_crash_loop(tmp_path, ray_local):
    """Item 9: a user task whose model does not fit the checkpoint ends with exit 3 and a clear reason,
    decided from the first worker's fingerprint, with no worker failure counted."""
    spec = job(name="fit", train={"steps": 2}, workers={"min": 1, "max": 1}, checkpoint=_ckpt(tmp_path))
    first = Trainer(build_config(spec), _user_task(4), run_dir=tmp_path / "a", console=None).fit()
    assert first.exit_code == 0
    bad = Trainer(build_config({**spec, "train": {**spec["train"], "steps": 4}}), _user_task(6),
                  run_dir=tmp_path / "b", console=None).fit()
    assert bad.exit_code == 3 and bad.summary["failures"] == 0
    (failed,) = [json.loads(x) for x in (tmp_path / "b" / "events.jsonl").read_text().splitlines()
                 if '"run_failed"' in x]
    assert "model:" in failed["reason"] and "Ways out" in failed["reason"]


def test_corrupt_explicit_checkpoint_found_by_the_rank_is_exit_3(tmp_path, ray_local, finished):
    """Items 9 and 15: the driver checks sizes only; the rank that reads a same-size corrupt file finds the
    SHA-256 mismatch, and that load error ends the run as a checkpoint error (exit 3), once."""
    step_dir = finished.copy_to(tmp_path) / "step_000000004"  # run "base"'s last commit, named explicitly
    shard = next(step_dir.glob("**/*.distcp"))  # inside the attempt directory (g0/)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    ck = _ckpt(tmp_path, resume=str(step_dir), accept_changes=["schedule"])
    run = run_job(tmp_path, job(name="base", train={"steps": 6}, task=_OPT, workers=_ONE, checkpoint=ck), name="b")
    assert run.result.exit_code == 3 and run.summary["failures"] == 0
    (failed,) = run.of("run_failed")
    assert "SHA-256 mismatch" in failed["reason"] and shard.name in failed["reason"]


def test_admission_by_fingerprint_is_pure():
    """Item 10: the first worker fixes the reference; a later one with other data is refused with the reason;
    a resume compares the first worker with the checkpoint (exit 3 unless accepted)."""
    a = {"model": {"sha256": "m"}, "optimizer": {"sha256": "o"}, "data": {"len": 10, "sha256": "d"}}
    b = {**a, "data": {"len": 11, "sha256": "e"}}
    first = admit(a, None, None, [], "r")
    assert first.action == "admit" and first.reference == a
    other = admit(b, first.reference, None, [], "r")
    assert other.action == "refuse" and 'data: {"len": 10, "sha256": "d"} in the group' in other.reason
    assert admit(b, None, {"fingerprint": a}, [], "r").action == "checkpoint_error"
    assert admit(b, None, {"fingerprint": a}, ["data"], "r").action == "admit"


def test_worker_with_other_data_is_refused_at_rendezvous(tmp_path, ray_local):
    """Item 10 with real workers: the dataset grows after the first two builds (a Parquet prefix that grew
    while the run trained); rank 1 is killed at step 2 and its replacement, which builds the grown data,
    is refused with a reason naming the data and never trained with: both slots are needed (min 2), so the
    run ends in a crash loop (exit 1: the kill and the refusal in a row) at the step where it lost rank 1."""
    counter = tmp_path / "builds"
    counter.mkdir()
    task = Task(model_fn=lambda: _Linear(4), loss_fn=lambda m, b, _s: m(b["x"]).pow(2).mean(dim=1),
                optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.01), dataset_fn=_GrowingData(str(counter)))
    spec = job(name="grow", train={"steps": 4}, workers={"min": 2, "max": 2},
               faults=[{"rank": 1, "step": 2, "point": "before_step", "kind": "kill"}],
               recovery={"max_failures": 10, "max_failures_per_rank": 1})  # the kill, one refusal: a loop
    result = Trainer(build_config(spec), task, run_dir=tmp_path / "g", console=None).fit()
    events = [json.loads(x) for x in (tmp_path / "g" / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["event"] == "failure"]
    refused = [e for e in failures if "refused" in (e.get("reason") or "")]
    assert refused and all("data:" in e["reason"] for e in refused), failures
    assert len(list(counter.iterdir())) >= 3  # two first builds, then the grown one (refused)
    assert result.exit_code == 1, result.summary
    error = result.summary["error"]
    assert "a crash loop" in error and "refused" in error and "data:" in error, error
    # Never trained with: no step after rank 1 was lost (a step event of the kill's step may be lost with it).
    lost_at = failures[0]["step"]
    assert all(e["step"] <= lost_at and e["world_size"] == 2 for e in events if e["event"] == "step")
    assert result.summary["final_step"] <= lost_at


class _GrowingData:
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self) -> list[dict[str, torch.Tensor]]:
        import os

        n = 0
        while True:
            try:
                os.close(os.open(os.path.join(self.folder, str(n)), os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                n += 1
        return [{"x": torch.full((8,), float(i))} for i in range(64 + (n >= 2))]


def test_resume_plan_rules(tmp_path):
    """Item 4, decided on the driver before Ray: which root a run writes to and what it continues."""
    from elastictrain.checkpoint import CheckpointError
    from elastictrain.checkpoint.resume import plan_resume

    def plan(**ck):
        cfg = build_config(job(name="p", checkpoint={"uri": str(tmp_path / "ck"), **ck}))
        return plan_resume(cfg, builtin_task(cfg).lr_fn, True, now=0.0)

    empty = plan(resume="never")
    assert empty.run_id == "p" and empty.manifest is None and empty.lineage
    _save(str(tmp_path / "ck" / "p"), [2, 4], "L1")
    again = plan(resume="never")
    assert again.run_id.startswith("p-19700101-000000-") and again.root_uri.endswith(again.run_id)
    assert again.lineage not in (None, "L1") and "another run" in again.note
    auto = plan(resume="auto")
    assert auto.run_id == "p" and auto.manifest.step == 4 and auto.lineage == "L1"
    branch = build_config(job(name="q", checkpoint={"uri": str(tmp_path / "ck"), "resume": auto.manifest.location}))
    b = plan_resume(branch, builtin_task(branch).lr_fn, True)
    assert b.run_id == "q" and b.manifest.step == 4 and b.lineage != "L1"
    for shard in (tmp_path / "ck" / "p").glob("step_*/*.distcp"):
        shard.write_bytes(shard.read_bytes()[:-1])  # every committed checkpoint truncated
    with pytest.raises(CheckpointError, match="every committed checkpoint .* is damaged"):
        plan(resume="auto")
