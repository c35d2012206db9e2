"""Single-process save/commit/verify/resume on a local (POSIX) path: corruption of every kind, retention,
create-only commit, explicit resume, disk full on a real tiny tmpfs, and the ``ckpt`` CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import fresh, same_state, trained
from click.testing import CliRunner

from elastictrain.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointWriter,
    app_state,
    apply_app_state,
    ckpt,
    load_checkpoint,
)
from elastictrain.checkpoint.manifest import manifest_digest
from elastictrain.config import CheckpointConfig


def save_steps(root: str, steps: list[int], seed: int = 0, **cfg) -> tuple[CheckpointStore, list]:
    store = CheckpointStore(root)
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait", **cfg), root, 0, 1, None)
    manifests = []
    try:
        for step in steps:
            model, opt = trained(seed=seed + step)
            assert writer.save_async(step, app_state(model, opt))
            (report,) = writer.wait(30)
            assert report.error is None, report.error
            manifests.append(store.commit(step, [report], {"world_size": 1, "samples_seen": step * 16}))
    finally:
        writer.close()
    return store, manifests


def test_save_commit_load_roundtrip_with_fresh_optimizer(tmp_path: Path) -> None:
    store, (m,) = save_steps(str(tmp_path / "run"), [3])
    assert m.meta["samples_seen"] == 48 and m.world_size == 1
    assert store.latest_valid() == (m, [])
    model, opt = fresh()
    state = app_state(model, opt)
    load_checkpoint(store.resolve("auto"), store.root_uri, state)
    apply_app_state(model, opt, state)
    assert same_state((model, opt), trained(seed=3))
    assert store.resolve("never") is None


def test_commit_is_create_only_and_refuses_bad_reports(tmp_path: Path) -> None:
    store, (m,) = save_steps(str(tmp_path / "run"), [1])
    from elastictrain.checkpoint import ShardReport

    reports = [ShardReport(1, 0, dict(m.files), None, 0, 0)]
    with pytest.raises(CheckpointError, match="already exists"):
        store.commit(1, reports, {"world_size": 1})
    with pytest.raises(CheckpointError, match="missing=\\[1\\]"):
        store.commit(2, [ShardReport(2, 0, dict(m.files), None, 0, 0)], {"world_size": 2})
    with pytest.raises(CheckpointError, match="rank 0: boom"):
        store.commit(2, [ShardReport(2, 0, {}, "boom", 0, 0)], {"world_size": 1})
    with pytest.raises(CheckpointError, match="absent"):
        store.commit(9, [ShardReport(9, 0, dict(m.files), None, 0, 0)], {"world_size": 1})


def test_writer_refuses_to_overwrite_a_committed_step(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    save_steps(root, [1])
    writer = CheckpointWriter(CheckpointConfig(), root, 0, 1, None)
    model, opt = trained()
    writer.save_async(1, app_state(model, opt))
    (report,) = writer.wait(30)
    writer.close()
    assert "already committed" in report.error


def _corrupt(step_dir: Path, how: str) -> None:
    shard = next(step_dir.glob("*.distcp"))
    if how == "truncate":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "missing_manifest":
        (step_dir / "manifest.json").unlink()
    elif how == "missing_file":
        shard.unlink()
    elif how in ("dotdot", "absolute"):
        body = json.loads((step_dir / "manifest.json").read_text())
        body["files"]["../x" if how == "dotdot" else "/etc/passwd"] = {"size": 1, "sha256": "0" * 64}
        body["digest"] = manifest_digest(body)  # a forger recomputes the digest: the path checks still refuse it
        (step_dir / "manifest.json").write_text(json.dumps(body))
    elif how == "garbage_manifest":
        (step_dir / "manifest.json").write_text("{not json")


@pytest.mark.parametrize(
    "how, words",
    [("truncate", "size"), ("flip", "SHA-256 mismatch"), ("missing_manifest", "never committed"),
     ("missing_file", "missing"), ("dotdot", "escapes the step directory"), ("absolute", "is absolute"),
     ("garbage_manifest", "not valid JSON")],
)
def test_corruption_detected_and_latest_valid_falls_back(tmp_path: Path, how: str, words: str) -> None:
    store, (m1, m2) = save_steps(str(tmp_path / "run"), [1, 2])
    _corrupt(tmp_path / "run" / "step_000000002", how)
    chosen, skipped = store.latest_valid()
    assert chosen == m1
    assert len(skipped) == 1 and "step_000000002" in skipped[0] and words in skipped[0], skipped
    if how == "flip":
        # the hot path (resolve) checks sizes and the manifest's digest only; the rank that reads the
        # file finds the SHA-256 mismatch while loading it
        m = store.resolve(str(tmp_path / "run" / "step_000000002"))
        assert store.latest_valid(checksums=False)[0] == m2
        model, opt = fresh()
        with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
            load_checkpoint(m, store.root_uri, app_state(model, opt))
        return
    with pytest.raises(CheckpointError):
        store.resolve(str(tmp_path / "run" / "step_000000002"))


def test_crash_mid_write_is_not_a_checkpoint(tmp_path: Path) -> None:
    store, (m1,) = save_steps(str(tmp_path / "run"), [1])
    crashed = tmp_path / "run" / "step_000000002"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half a shard")
    assert [m.step for m in store.committed()] == [1]
    chosen, skipped = store.latest_valid()
    assert chosen == m1 and "no manifest.json" in skipped[0]


def test_resolve_explicit_uri(tmp_path: Path) -> None:
    store, (m1, m2) = save_steps(str(tmp_path / "run"), [1, 2])
    other = CheckpointStore(str(tmp_path / "elsewhere"))
    assert other.resolve(str(tmp_path / "run" / "step_000000001")) == m1
    assert other.resolve(str(tmp_path / "run" / "step_000000002" / "manifest.json")) == m2
    with pytest.raises(CheckpointError, match="does not exist .*resume=auto"):
        other.resolve(str(tmp_path / "run" / "step_000000009"))


def test_retention_on_storage(tmp_path: Path) -> None:
    store, _ = save_steps(str(tmp_path / "run"), [10, 20, 30, 40, 50])
    stale = tmp_path / "run" / "step_000000015"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x")
    inflight = tmp_path / "run" / "step_000000060"
    inflight.mkdir()
    deleted = store.retain(keep_last=2, keep_every=20, in_use={10})
    assert deleted == [15, 30]
    assert [m.step for m in store.committed()] == [10, 20, 40, 50]
    assert inflight.exists() and not stale.exists()
    assert store.retain(keep_last=1, keep_every=0) == [10, 20, 40]
    assert [m.step for m in store.committed()] == [50]


def test_when_busy_skip_reports_the_skip(tmp_path: Path) -> None:
    writer = CheckpointWriter(CheckpointConfig(when_busy="skip", max_in_flight=1), str(tmp_path), 0, 1, None)
    model, opt = trained()
    writer._slots.acquire()  # hold the only slot: the writer is "busy"
    assert writer.save_async(1, app_state(model, opt)) is False
    (report,) = writer.wait(10)
    writer._slots.release()
    assert report.step == 1 and "skipped" in report.error
    # a later save of the skipped step (a just-in-time save on that step) is allowed: it wrote nothing
    assert writer.has_saved(1) and writer.save_async(1, app_state(model, opt)) is False
    assert writer.forget_unwritten(1) and writer.save_async(1, app_state(model, opt), wait=True) is True
    (again,) = writer.wait(10)
    assert again.step == 1 and again.error is None and again.files
    assert not writer.forget_unwritten(1)  # written: one save per (step, generation) stands
    assert writer.save_async(2, app_state(model, opt)) is True
    writer.close()
    assert writer.in_flight == 0
    with pytest.raises(CheckpointError, match="closed"):
        writer.save_async(3, app_state(model, opt))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs to fake a full disk: {proc.stderr.strip() or proc.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_is_reported_clearly(tiny_tmpfs: Path) -> None:
    root = str(tiny_tmpfs / "run")
    writer = CheckpointWriter(CheckpointConfig(), root, 0, 1, None)
    big = {"model": {"w": torch.randn(256, 1024)}}  # 1 MiB > 256 KiB of disk
    writer.save_async(1, big)
    (report,) = writer.wait(30)
    writer.close()
    assert report.error and "no space left on device; free space" in report.error, report.error
    assert CheckpointStore(root).committed() == []
    from elastictrain.checkpoint import storage

    fs, path = storage.open_fs(root)
    with pytest.raises(CheckpointError, match="no space left on device; free space"):
        storage.write_atomic(fs, path + "/blob", b"x" * 2**20, create_only=False, uri=root + "/blob")


def test_cli_ls_show_verify_export(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store, (m1, m2) = save_steps(str(root), [1, 2])
    runner = CliRunner()
    out = runner.invoke(ckpt, ["ls", str(root)])
    assert out.exit_code == 0 and "committed" in out.output and "         2" in out.output
    out = runner.invoke(ckpt, ["show", str(root / "step_000000001")])
    assert out.exit_code == 0 and json.loads(out.output)["step"] == 1
    assert runner.invoke(ckpt, ["verify", str(root / "step_000000002")]).exit_code == 0
    target = tmp_path / "model.pt"
    out = runner.invoke(ckpt, ["export", str(root), "--out", str(target)])
    assert out.exit_code == 0, out.output
    exported = torch.load(target, weights_only=True)
    expect = trained(seed=2)[0].state_dict()
    assert exported.keys() == expect.keys() and all(torch.equal(exported[k], expect[k]) for k in expect)
    # safetensors is installed with the test extra (transformers needs it): the file holds the same tensors.
    from safetensors.torch import load_file

    out = runner.invoke(ckpt, ["export", str(root), "--out", str(tmp_path / "m.st"), "--format", "safetensors"])
    assert out.exit_code == 0, out.output
    st = load_file(str(tmp_path / "m.st"))
    assert st.keys() == expect.keys() and all(torch.equal(st[k], expect[k]) for k in expect)
    # Without the package (an import of it fails): one line naming the fix, exit 2, no file.
    import sys

    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "safetensors" or k.startswith("safetensors.")}
    sys.modules["safetensors"] = None  # type: ignore[assignment] - makes `import safetensors...` raise ImportError
    try:
        out = runner.invoke(ckpt, ["export", str(root), "--out", str(tmp_path / "n.st"), "--format", "safetensors"])
    finally:
        del sys.modules["safetensors"]
        sys.modules.update(saved)
    assert out.exit_code == 2 and "pip install safetensors" in out.output and not (tmp_path / "n.st").exists()
    _corrupt(root / "step_000000002", "flip")
    out = runner.invoke(ckpt, ["verify", str(root / "step_000000002")])
    assert out.exit_code == 1 and "SHA-256 mismatch" in out.output
    out = runner.invoke(ckpt, ["show", str(tmp_path / "nothing" / "step_000000001")])
    assert out.exit_code == 2 and "no manifest.json" in out.output
    out = runner.invoke(ckpt, ["ls", str(tmp_path / "nothing")])  # a wrong path: one line, not an empty table
    assert out.exit_code == 2 and "no checkpoint here" in out.output and "ranks" not in out.output
