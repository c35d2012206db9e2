"""S3 against a real moto server: save/commit/load, create-only commit, clear errors for a missing bucket
and missing credentials, and the server going away in the middle of a save's data write."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch
from checkpoint_fixtures import CuttingProxy, S3Server, fresh, s3_bucket, s3_server, same_state, start_moto, trained  # noqa: F401

from elastictrain.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointWriter,
    ShardReport,
    app_state,
    apply_app_state,
    load_checkpoint,
)
from elastictrain.config import CheckpointConfig


def _save(root: str, opts: dict, step: int, state: dict, s3_mode: str = "buffer") -> ShardReport:
    writer = CheckpointWriter(CheckpointConfig(storage_options=opts), root, 0, 1, None, s3_mode=s3_mode)
    try:
        writer.save_async(step, state)
        (report,) = writer.wait(60)
    finally:
        writer.close()
    return report


@pytest.mark.parametrize("s3_mode", ["buffer", "stream"])
def test_s3_save_commit_verify_load(s3_server: S3Server, s3_bucket: str, s3_mode: str) -> None:
    root = f"{s3_bucket}/runs/job"
    opts = s3_server.options()
    model, opt = trained(seed=4)
    report = _save(root, opts, 4, app_state(model, opt), s3_mode)
    assert report.error is None, report.error
    store = CheckpointStore(root, opts)
    manifest = store.commit(4, [report], {"world_size": 1})
    assert store.verify(manifest) == []
    with pytest.raises(CheckpointError, match="never overwritten"):
        store.commit(4, [report], {"world_size": 1})
    resolved = store.resolve("auto")
    target = fresh()
    state = app_state(*target)
    load_checkpoint(resolved, root, state, storage_options=opts)
    apply_app_state(*target, state)
    assert same_state(target, (model, opt))
    assert store.retain(keep_last=1, keep_every=0) == []


def test_s3_missing_bucket_is_named(s3_server: S3Server) -> None:
    opts = s3_server.options()
    report = _save("s3://no-such-bucket-xyz/run", opts, 1, {"w": torch.ones(4)})
    assert "bucket 'no-such-bucket-xyz' does not exist" in report.error, report.error
    store = CheckpointStore("s3://no-such-bucket-xyz/run", opts)
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket-xyz' does not exist; create it"):
        store.latest_valid()


def test_s3_without_credentials_says_so(s3_server: S3Server, s3_bucket: str, tmp_path) -> None:
    # a clean process: no key env vars, credential files that do not exist, no instance metadata
    code = textwrap.dedent(
        f"""
        import torch
        from elastictrain.checkpoint import CheckpointStore, CheckpointWriter
        from elastictrain.config import CheckpointConfig
        opts = {{"client_kwargs": {{"endpoint_url": {s3_server.endpoint!r}}}, "config_kwargs": {{"retries": {{"max_attempts": 1}}}},
                "skip_instance_cache": True}}
        w = CheckpointWriter(CheckpointConfig(storage_options=opts), "{s3_bucket}/run", 0, 1, None)
        w.save_async(1, {{"w": torch.ones(2)}})
        (r,) = w.wait(60); w.close()
        print("REPORT:", r.error)
        """
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": ".",
        "HOME": str(tmp_path),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "no usable S3 credentials were found" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_s3_server_down_during_save_then_recovers(s3_server: S3Server, s3_bucket: str) -> None:
    """The endpoint goes away in the middle of the save's data write: a proxy in front of moto cuts the PUT
    of the first ``.distcp`` file after its head and part of its body, and stops the server. The save
    reports the outage, nothing of it is committed or left behind, and after the server is back the next
    save commits."""
    root = f"{s3_bucket}/run"
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    store = CheckpointStore(root, s3_server.options())
    proxy = CuttingProxy(port, rb"PUT [^ ]*step_000000002/[^ ]*\.distcp", on_cut=lambda: s3_server.server.stop())
    opts = {**s3_server.options(), "client_kwargs": {"endpoint_url": proxy.endpoint}}
    model, opt = trained(seed=1)
    state = app_state(model, opt)
    writer = CheckpointWriter(CheckpointConfig(storage_options=opts), root, 0, 1, None)
    try:
        writer.save_async(1, state)
        (ok,) = writer.wait(60)
        assert ok.error is None and proxy.cut_head is None, ok.error
        store.commit(1, [ok], {"world_size": 1})
        writer.save_async(2, state)
        (failed,) = writer.wait(60)
        assert proxy.cut_head is not None and proxy.cut_head.startswith(b"PUT "), "the fault never landed"
        assert failed.error and "unreachable" in failed.error and ".distcp" in failed.error, failed.error
        s3_server.server = start_moto(port)  # moto keeps its buckets in-process: like S3 after an outage
        writer.save_async(3, state)
        (again,) = writer.wait(60)
    finally:
        writer.close()
        proxy.close()
    assert again.error is None, again.error
    with pytest.raises(CheckpointError, match="rank 0"):
        store.commit(2, [failed], {"world_size": 1})
    assert [m.step for m in store.committed()] == [1]
    manifest = store.commit(3, [again], {"world_size": 1})
    chosen, skipped = store.latest_valid()
    assert chosen == manifest and skipped == []
    assert store.retain(keep_last=1, keep_every=0) == [1]  # the cut step 2 left nothing behind
