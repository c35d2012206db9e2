"""Storage cannot exhaust a reader (issue 40 item 7): what a checkpoint's pickles build is bounded by their
own bytes (no ``bytes(N)`` / ``bytearray(N)``, no archive member bigger than its item), the tensors its
``.metadata`` declares by the bytes the manifest lists, and a listed file is read only up to its recorded
size and only if it is a regular file (a symlink to ``/dev/zero`` read until memory ran out). The attacks
forge a committed checkpoint and rewrite its manifest to match (tests/tamper.py), so only the reader can
tell. In-process, one rank, no Ray; the end-to-end resume is in test_checkpoint_security.py."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint import CheckpointError, UnsafeBytesError, app_state, load_checkpoint, loads_plain
from elastictrain.checkpoint.export import export_state
from tests.checkpoint_fixtures import fresh
from tests.tamper import Alloc, forge_metadata
from tests.test_checkpoint_security import _save, _step_dir

MB50 = 50 * 2**20


def _saved(b: object) -> bytes:
    buf = io.BytesIO()
    torch.save(b, buf)
    return buf.getvalue()


def test_plain_pickles_build_nothing_bigger_than_themselves() -> None:
    for kind in (bytearray, bytes):
        item = _saved(Alloc(MB50, kind))
        assert len(item) < 2000
        with pytest.raises(UnsafeBytesError, match=f"{MB50} zero bytes out of nothing"):
            loads_plain(item, "entry 'x'")
    for value in (b"", b"\x00\xff", bytearray(), bytearray(b"ab"), {"k": [bytearray(b"q"), b"r"]}):
        assert loads_plain(_saved(value)) == value  # what a pickler writes still loads
    # a deflated data.pkl that unpacks to far more than the item's own bytes
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(b"\x00" * 2**20, protocol=2))
    assert len(buf.getvalue()) < 10_000
    with pytest.raises(UnsafeBytesError, match="unpacks to"):
        loads_plain(buf.getvalue(), "entry 'x'")


def test_forged_metadata_cannot_allocate(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = _save(root, [1, 2, 3])
    model, opt = fresh()

    def alloc(md) -> None:  # noqa: ANN001
        md.storage_meta = dataclasses.replace(md.storage_meta, save_id=Alloc(MB50))

    forge_metadata(_step_dir(root, 2), alloc)
    with pytest.raises(CheckpointError, match=f"step_000000002.*.metadata.*builtins.bytes for {MB50} zero bytes"):
        load_checkpoint(store.read_manifest(2), store.root_uri, app_state(model, opt))

    def huge(md) -> None:  # noqa: ANN001  - a shape no file holds: export would allocate it
        fqn = next(k for k in md.state_dict_metadata if k.startswith("model."))
        md.state_dict_metadata[fqn] = dataclasses.replace(md.state_dict_metadata[fqn], size=torch.Size([2**40]))

    forge_metadata(_step_dir(root, 3), huge)
    with pytest.raises(CheckpointError, match="declares tensors of more than .* bytes"):
        export_state(store.read_manifest(3), str(tmp_path / "o.pt"), "torch", "model", None)
    assert not (tmp_path / "o.pt").exists()


def _shard(store, step: int) -> tuple[Path, str]:  # noqa: ANN001
    manifest = store.read_manifest(step)
    rel = next(p for p in manifest.data_files if p.endswith(".distcp"))
    return _step_dir(Path(store.root_uri), step) / manifest.data_dir / rel, rel


@pytest.mark.parametrize("attack", ["symlink_to_a_copy", "symlink_to_dev_zero", "grown"])
def test_listed_files_must_be_regular_and_are_read_up_to_their_size(tmp_path: Path, attack: str) -> None:
    root = tmp_path / "run"
    store = _save(root, [1])
    model, opt = fresh()
    shard, _ = _shard(store, 1)
    if attack == "grown":  # refused after reading one byte more than recorded, not the whole file
        with open(shard, "ab") as f:
            f.truncate(os.path.getsize(shard) + 2**28)  # sparse: reading it whole would allocate 256 MiB
        with pytest.raises(CheckpointError, match="more bytes than the .* recorded"):
            load_checkpoint(store.read_manifest(1), store.root_uri, app_state(model, opt))
        return
    # a symlink to a genuine copy (the same bytes and SHA-256) or to /dev/zero (an endless read before)
    target = tmp_path / "copy" if attack == "symlink_to_a_copy" else Path("/dev/zero")
    if attack == "symlink_to_a_copy":
        target.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(target)
    with pytest.raises(CheckpointError, match="is a symbolic link, not a regular file; refusing"):
        load_checkpoint(store.read_manifest(1), store.root_uri, app_state(model, opt))
    assert any("is a symbolic link" in p for p in store.verify(store.read_manifest(1)))


def test_resume_refuses_a_forged_metadata_and_uses_the_previous_checkpoint(tmp_path: Path, ray_local) -> None:
    """A real run commits steps 5 and 10; step 10's ``.metadata`` is forged to ask for 50 MB out of nothing
    (the manifest rewritten to match). ``elastictrain run`` with resume=auto (a CLI process, its console
    captured): the ranks refuse step 10 with one line naming what it asked for, the run resumes from step 5,
    retraces steps 6-10 with the first run's losses, finishes, and keeps step 10's files for the operator.
    Its console shows neither a traceback nor DCP's single-process notice (which every load printed, once
    per worker)."""
    import subprocess
    import sys

    import ray
    import yaml

    from elastictrain.events import read_events
    from tests.conftest import job, run_job
    from tests.test_checkpoint_security import _ckpt

    ck = _ckpt(tmp_path)
    # every step in the warm-up: the learning rate of a step does not depend on train.steps (10, then 15)
    task = {**job()["task"], "optimizer": {"lr": 3e-3, "warmup_steps": 20}}
    first = run_job(tmp_path, job(name="forged", task=task, train={"steps": 10}, checkpoint=ck), name="first")
    step10 = _step_dir(tmp_path / "ckpt" / "forged", 10)
    forge_metadata(step10, lambda md: setattr(md, "storage_meta", dataclasses.replace(md.storage_meta,
                                                                                      save_id=Alloc(MB50))))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(name="forged", task=task, train={"steps": 15},
                                       checkpoint={**ck, "accept_changes": ["schedule"]})))
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "run", str(path), "--run-dir", str(tmp_path / "again"),
                           "--ray-address", ray.get_runtime_context().gcs_address],
                          capture_output=True, text=True, timeout=300)
    console = proc.stdout + proc.stderr
    (tmp_path / "console.txt").write_text(console)  # for a reader of a failure
    assert proc.returncode == 0, console[-3000:]
    events = read_events(tmp_path / "again")
    (bad,) = [e for e in events if e["event"] == "checkpoint_failed" and "could not load" in e["reason"]]
    assert bad["step"] == 10 and "zero bytes out of nothing" in bad["reason"] and "trying step 5" in bad["reason"]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [5]
    said = [line for line in console.splitlines() if "zero bytes out of nothing" in line]
    assert len(said) == 1, said
    again = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    assert [again[s] for s in range(6, 11)] == [first.losses()[s] for s in range(6, 11)]
    assert max(again) == 15 and (step10 / "manifest.json").exists()
    assert "Traceback" not in console and "torch.distributed is disabled" not in console, console[-3000:]
