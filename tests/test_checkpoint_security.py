"""Nothing read back from checkpoint storage runs code (issue 21, security): bytes items load as plain
data only, only files the manifest lists are read, storage paths stay inside the checkpoint, the digest is
required, and an optional HMAC signature (``ELASTICTRAIN_CHECKPOINT_KEY``) detects tampering. The attack
is the one of the issue: a pickle that creates a file, put into a bytes item of a committed checkpoint,
the manifest rewritten to match (tests/tamper.py)."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from elastictrain.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointWriter,
    ManifestError,
    UnsafeBytesError,
    app_state,
    ckpt,
    load_checkpoint,
    loads_plain,
)
from elastictrain.checkpoint.signing import KEY_ENV, key_from_env
from elastictrain.config import CheckpointConfig
from tests.checkpoint_fixtures import fresh, trained
from tests.conftest import BackgroundRun, job, run_job
from tests.tamper import Plant, plant_payload, relist, repoint

KEY = b"a-secret-from-a-kubernetes-secret"


def _save(root: Path, steps: list[int], key: bytes | None = None) -> CheckpointStore:
    store = CheckpointStore(str(root), key=key)
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait"), str(root), 0, 1, None)
    try:
        for step in steps:
            model, opt = trained(seed=step)
            assert writer.save_async(step, app_state(model, opt))
            (report,) = writer.wait(30)
            assert report.error is None, report.error
            store.commit(step, [report], {"world_size": 1})
    finally:
        writer.close()
    return store


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


# ------------------------------------------------------------------------------------- the plain loader
def test_plain_loader_reads_real_entries_and_refuses_everything_else(tmp_path: Path) -> None:
    _, opt = trained()
    for value in opt.state_dict()["param_groups"][0].values():  # lr, betas, eps, amsgrad, foreach, params...
        buf = io.BytesIO()
        torch.save(value, buf)
        assert loads_plain(buf.getvalue()) == value
    for value in ({1, 2}, frozenset({"a"}), b"\x00\xff", 1 + 2j, {"a": [1, (2.5, None)]}):
        buf = io.BytesIO()
        torch.save(value, buf)
        assert loads_plain(buf.getvalue()) == value
    marker = tmp_path / "pwned"
    for evil, words in ((Plant(str(marker)), "io.open"), (torch.ones(2), "_rebuild_tensor")):
        buf = io.BytesIO()
        torch.save(evil, buf)
        with pytest.raises(UnsafeBytesError, match=words):
            loads_plain(buf.getvalue(), "entry 'x'")
    assert not marker.exists()
    with pytest.raises(UnsafeBytesError, match="tensor storage reference"):
        loads_plain(_archive(_persistent_pickle()), "entry 'x'")
    with pytest.raises(CheckpointError, match="found 2"):
        loads_plain(_archive(pickle.dumps(1, 2), twice=True))
    with pytest.raises(CheckpointError, match="not a torch.save archive"):
        loads_plain(b"\x80\x02garbage")


def _persistent_pickle() -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):  # noqa: ANN001, ANN202
            return ("storage", "0") if obj == "S" else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(["S"])
    return buf.getvalue()


def _archive(payload: bytes, twice: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", payload)
        if twice:
            z.writestr("other/data.pkl", payload)
    return buf.getvalue()


# ------------------------------------------------------------------------------ the reader, local files
def test_planted_payload_is_refused_by_load_and_export(tmp_path: Path) -> None:
    root, marker = tmp_path / "run", tmp_path / "pwned"
    store = _save(root, [1, 2])
    plant_payload(_step_dir(root, 2), marker)
    assert store.latest_valid()[0].step == 2  # sizes, SHA-256s and digest all match: only the loader can tell
    model, opt = fresh()
    with pytest.raises(CheckpointError, match="step_000000002.*optim.param_groups.0.lr.*io.open.*refusing"):
        load_checkpoint(store.read_manifest(2), store.root_uri, app_state(model, opt))
    out = CliRunner().invoke(ckpt, ["export", str(_step_dir(root, 2)), "--key", "optim", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "io.open" in out.output and len(out.output.strip().splitlines()) == 1, out.output
    assert not marker.exists()


def test_storage_paths_must_be_listed_and_inside_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = _save(root, [1, 2])
    step2 = _step_dir(root, 2)
    manifest = store.read_manifest(2)
    shard = next(p for p in manifest.data_files if p.endswith(".distcp"))
    data_dir = step2 / manifest.data_dir
    # a copy of a shard the manifest does not list: verify says so, and no reader opens it
    (data_dir / "extra.distcp").write_bytes((data_dir / shard).read_bytes())
    assert any("extra.distcp: not listed by the manifest" in p for p in store.verify(manifest))
    repoint(step2, "optim.param_groups.0.lr", relative_path="extra.distcp")
    model, opt = fresh()
    with pytest.raises(CheckpointError, match="'extra.distcp', which the manifest does not list"):
        load_checkpoint(store.read_manifest(2), store.root_uri, app_state(model, opt))
    # a path out of the checkpoint directory (to step 1's files, which are listed there, not here)
    other = f"../../step_000000001/{store.read_manifest(1).data_dir}/{shard}".replace("//", "/")
    repoint(step2, "optim.param_groups.0.lr", relative_path=other)
    with pytest.raises(CheckpointError, match="escapes the step directory"):
        load_checkpoint(store.read_manifest(2), store.root_uri, app_state(model, opt))


def test_reader_refuses_a_planner_that_would_unpickle_freely(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from elastictrain.checkpoint.dcp_io import SafeReader
    from elastictrain.checkpoint.loader import checkpoint_dir

    root, marker = tmp_path / "run", tmp_path / "pwned"
    store = _save(root, [1])
    plant_payload(_step_dir(root, 1), marker)
    manifest = store.read_manifest(1)
    reader = SafeReader(checkpoint_dir(manifest, None), expected=manifest.data_files)
    model, opt = fresh()
    with pytest.raises(BaseException, match="refusing to load with DefaultLoadPlanner"):
        dcp.load(app_state(model, opt), storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    assert not marker.exists()


def test_manifest_without_digest_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = _save(root, [1, 2])
    path = _step_dir(root, 2) / "manifest.json"
    body = json.loads(path.read_text())
    del body["digest"]
    path.write_text(json.dumps(body))
    with pytest.raises(ManifestError, match="has no digest field"):
        store.read_manifest(2)
    chosen, skipped = store.latest_valid()
    assert chosen.step == 1 and "has no digest field" in skipped[0]


# ---------------------------------------------------------------------------------- the keyed signature
def test_signature_good_bad_and_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    assert key_from_env() == KEY and key_from_env({KEY_ENV: ""}) is None
    root, marker = tmp_path / "run", tmp_path / "pwned"
    store = CheckpointStore(str(root))  # the key comes from the environment
    assert store.key == KEY
    _save(root, [1, 2, 3], key=KEY)
    assert json.loads((_step_dir(root, 3) / "manifest.json").read_text())["signature"].startswith("hmac-sha256:")
    assert [m.step for m in store.committed()] == [1, 2, 3]
    # the attacker rewrites sizes, SHA-256s and digest but cannot sign: refused, resume falls back
    plant_payload(_step_dir(root, 3), marker)
    with pytest.raises(ManifestError, match="signature does not match"):
        store.read_manifest(3)
    chosen, skipped = store.latest_valid(checksums=False)
    assert chosen.step == 2 and "signature does not match" in skipped[0]
    # stripping the signature does not help
    body = json.loads((_step_dir(root, 2) / "manifest.json").read_text())
    del body["signature"]
    relist(_step_dir(root, 2), body, [])
    with pytest.raises(ManifestError, match="it is not signed"):
        store.read_manifest(2)
    # another key is a mismatch; no key reads signed and unsigned manifests (digest still required)
    with pytest.raises(ManifestError, match="signature does not match"):
        CheckpointStore(str(root), key=b"other").read_manifest(1)
    unkeyed = CheckpointStore(str(root), key=None)
    assert unkeyed.read_manifest(1).step == 1 and unkeyed.read_manifest(2).step == 2
    assert not marker.exists()


def test_ckpt_sign_signs_trusted_checkpoints_rotates_keys_and_refuses_tampered_ones(tmp_path: Path) -> None:
    """``elastictrain ckpt sign``: checkpoints written before signing was on are signed (after their files
    are hashed), a key rotation re-signs what the previous key signed, and a tampered or damaged checkpoint
    is refused and stays untrusted; without the key it says so in one line."""
    root, marker = tmp_path / "run", tmp_path / "pwned"
    _save(root, [1, 2, 3])  # before the key was set: unsigned
    shard = next(p for p in _step_dir(root, 3).rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))  # damaged, same size
    runner = CliRunner()
    out = runner.invoke(ckpt, ["sign", str(root)], env={KEY_ENV: ""})
    assert out.exit_code == 2 and KEY_ENV in out.output and len(out.output.strip().splitlines()) == 1, out.output

    out = runner.invoke(ckpt, ["sign", str(root)], env={KEY_ENV: KEY.decode()})
    assert out.exit_code == 1, out.output
    assert "SIGNED" in out.output and "step_000000003: its files do not match the manifest" in out.output
    trusted = CheckpointStore(str(root), key=KEY)
    assert [m.step for m in trusted.committed()] == [1, 2] and "not signed" in trusted.refused()[3]
    out = runner.invoke(ckpt, ["sign", str(_step_dir(root, 1))], env={KEY_ENV: KEY.decode()})
    assert out.exit_code == 0 and out.output.startswith("OK") and "already signed" in out.output, out.output

    # the attacker rewrites step 2's files and digest (not its signature), then the key is rotated
    plant_payload(_step_dir(root, 2), marker)
    env = {KEY_ENV: "rotated-key", "OLD_KEY": KEY.decode()}
    out = runner.invoke(ckpt, ["sign", str(_step_dir(root, 1))], env=env)
    assert out.exit_code == 1 and "signed under another key" in out.output, out.output
    out = runner.invoke(ckpt, ["sign", str(root), "--previous-key-env", "OLD_KEY"], env=env)
    assert out.exit_code == 1, out.output
    assert "SIGNED" in out.output and "step_000000002: signed, but not under the previous key" in out.output
    rotated = CheckpointStore(str(root), key=b"rotated-key")
    assert [m.step for m in rotated.committed()] == [1]
    assert set(rotated.refused()) == {2, 3}
    with pytest.raises(ManifestError, match="signature does not match"):
        CheckpointStore(str(root), key=KEY).read_manifest(1)
    model, opt = fresh()
    load_checkpoint(rotated.read_manifest(1), str(root), app_state(model, opt))  # the re-signed one loads
    assert not marker.exists()


# ------------------------------------------------------------------------------- end to end, real runs
def _ckpt(tmp_path: Path, **extra) -> dict:
    return {"uri": str(tmp_path / "ckpt"), "every_steps": 5, "keep_last": 5, "resume": "auto",
            "when_busy": "wait", "memory_every_steps": 0, **extra}


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line and "warn(" not in line]
    assert "Traceback" not in stderr and len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_tampered_checkpoint_runs_no_code_on_export_or_resume(tmp_path: Path, ray_local) -> None:
    """One committed checkpoint of a real run, tampered, then read three ways: ``ckpt export`` and a run
    resuming it explicitly (two CLI processes) while a run with resume=auto trains beside them. The three
    only read step 10 (a committed step is never overwritten), so they run at once instead of in turn."""
    import ray
    import yaml

    marker = tmp_path / "pwned"
    ck = _ckpt(tmp_path)
    run_job(tmp_path, job(name="atk", train={"steps": 10}, checkpoint=ck), name="first")
    step10 = _step_dir(tmp_path / "ckpt" / "atk", 10)
    plant_payload(step10, marker)
    export = subprocess.Popen([sys.executable, "-m", "elastictrain", "ckpt", "export", str(step10), "--key", "optim",
                               "--out", str(tmp_path / "optim.pt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    # the checkpoint named explicitly, in the CLI
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(name="atk2", train={"steps": 15},
                                       checkpoint={**ck, "resume": str(step10), "accept_changes": ["schedule"]})))
    address = ray.get_runtime_context().gcs_address
    explicit = subprocess.Popen([sys.executable, "-m", "elastictrain", "run", str(path), "--ray-address", address,
                                 "--run-dir", str(tmp_path / "explicit")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        # resume=auto: the ranks refuse step 10, the run says so and continues from step 5
        again = run_job(tmp_path, job(name="atk", train={"steps": 15},
                                      checkpoint={**ck, "accept_changes": ["schedule"]}), name="again")
        export_out, export_err = export.communicate(timeout=120)
        explicit_out, explicit_err = explicit.communicate(timeout=300)
    finally:
        for proc in (export, explicit):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    # export: one line, exit 2, nothing run
    assert export.returncode == 2 and "io.open" in _one_line_error(export_err), export_out
    (bad,) = [e for e in again.of("checkpoint_failed") if "could not load" in e["reason"]]
    assert bad["step"] == 10 and "io.open" in bad["reason"] and "trying step 5" in bad["reason"], bad
    assert [e["step"] for e in again.of("resumed")] == [5] and again.result.exit_code == 0
    # the checkpoint named explicitly: one line, exit 3 (the documented checkpoint error), no traceback
    assert explicit.returncode == 3, explicit_out[-2000:] + explicit_err[-2000:]
    said = [line for line in explicit_err.splitlines() if "io.open" in line]
    assert len(said) == 1 and said[0].startswith("elastictrain: failed"), explicit_err[-2000:]
    assert "Traceback" not in explicit_err + explicit_out
    assert not marker.exists()  # by none of the three


def test_durable_recovery_refuses_a_tampered_checkpoint(tmp_path: Path, ray_local) -> None:
    """One worker, no peer tier: a killed worker's replacement loads the durable checkpoint. The worker's
    step 14 sleeps (generation 0 only), before step 15's save, while the worker answers the controller's
    polls: the save of step 10 is collected and committed whenever the machine gets to it (step 5's is
    committed while steps 6 to 10 run); the watchdog would act only after 4 minutes. Step 10 is tampered
    and the worker SIGKILLed: the recovery refuses step 10, says so, and recovers from step 5."""
    marker = tmp_path / "pwned"
    # 4 micro-batches of 100 s: step 14 outlasts any wait below; the run's promise needs no timing
    faults = [{"rank": 0, "step": 14, "kind": "slow", "seconds": 100.0, "generation": 0}]
    spec = job(name="rec", train={"steps": 16}, workers={"min": 1, "max": 1}, faults=faults,
               timeouts={"collective_s": 15, "step_watchdog_cap_s": 240, "watchdog_floor_s": 240, "poll_s": 250,
                         "restart_grace_s": 260},
               checkpoint=_ckpt(tmp_path))
    bg = BackgroundRun(tmp_path, spec)
    bg.wait_for(lambda e: e["event"] == "checkpoint_saved" and e["step"] == 10, timeout=200)
    plant_payload(_step_dir(tmp_path / "ckpt" / "rec", 10), marker)
    (started,) = [e for e in bg.events() if e["event"] == "worker_started" and e["generation"] == 0]
    os.kill(started["pid"], signal.SIGKILL)
    run = bg.finish(timeout=240)
    (bad,) = [e for e in run.of("checkpoint_failed") if "could not load" in e["reason"]]
    assert bad["step"] == 10 and "io.open" in bad["reason"] and "trying step 5" in bad["reason"], bad
    assert [e["source"] for e in run.of("recovered")] == ["checkpoint"]
    assert run.result.exit_code == 0 and run.summary["final_step"] == 16
    assert not marker.exists()


def test_retention_never_deletes_a_refused_checkpoint(tmp_path: Path) -> None:
    """A manifest refused on read (unsigned once a key is set, or tampered) is not an abandoned save:
    retention keeps its directory for the operator instead of sweeping it."""
    root = tmp_path / "run"
    _save(root, [1, 2])  # before the key was set: unsigned
    signed = _save(root, [3], key=KEY)
    assert [m.step for m in signed.committed()] == [3]
    (_step_dir(root, 4)).mkdir()  # an abandoned save (no manifest) older than nothing: kept (may be in flight)
    (_step_dir(root, 0)).mkdir()  # an abandoned save older than the newest commit: swept
    assert signed.retain(keep_last=1, keep_every=0) == [0]
    assert all(_step_dir(root, s).is_dir() for s in (1, 2, 3, 4))
    assert CheckpointStore(str(root), key=None).read_manifest(1).step == 1


def test_resume_auto_does_not_start_over_refused_checkpoints(tmp_path: Path, monkeypatch) -> None:
    from elastictrain import build_config
    from elastictrain.checkpoint.resume import plan_resume

    _save(tmp_path / "ckpt" / "t", [1, 2])  # written without a key
    config = build_config(job(checkpoint={"uri": str(tmp_path / "ckpt")}))
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    with pytest.raises(CheckpointError, match=r"every committed checkpoint .*steps \[1, 2\].*it is not signed"):
        plan_resume(config, None, builtin_task=True)
