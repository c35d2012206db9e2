"""Pure parts: manifest JSON, path validation, retention decisions, the restricted metadata unpickler."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastictrain.checkpoint import (
    CheckpointError,
    FileInfo,
    ManifestError,
    ShardReport,
    UnsafeMetadataError,
    loads_metadata,
    retention_victims,
)
from elastictrain.checkpoint.manifest import (
    build_manifest,
    check_relpath,
    manifest_digest,
    manifest_from_json,
    parse_step_dir,
    step_dir_name,
)

SHA = "a" * 64


def _manifest_json(files: dict) -> str:
    reports = [ShardReport(5, 0, {".metadata": FileInfo(3, SHA)}, None, 0.1, 0.2)]
    text = build_manifest(5, 1, reports, {"world_size": 1, "seed": 0}, 123.0).to_json()
    import json

    body = json.loads(text)
    body["files"].update(files)
    body["digest"] = manifest_digest(body)  # a consistent digest: the field checks still apply
    return json.dumps(body)


def _digested(body: dict) -> str:
    import json

    return json.dumps({**body, "digest": manifest_digest(body)})


def test_manifest_digest_catches_an_edit() -> None:
    """The manifest's own integrity check (item 15: the hot path verifies sizes + this, not every byte)."""
    import json

    reports = [ShardReport(5, 0, {".metadata": FileInfo(3, SHA)}, None, 0.1, 0.2)]
    text = build_manifest(5, 1, reports, {"world_size": 1, "seed": 0}, 123.0).to_json()
    assert manifest_from_json(text).step == 5
    body = json.loads(text)
    body["meta"]["seed"] = 1
    with pytest.raises(ManifestError, match="digest does not match"):
        manifest_from_json(json.dumps(body), "m")


def test_roundtrip() -> None:
    reports = [
        ShardReport(5, 0, {".metadata": FileInfo(3, SHA), "__0_0.distcp": FileInfo(10, "b" * 64)}, None, 0.1, 0.2),
        ShardReport(5, 1, {"__1_0.distcp": FileInfo(11, "c" * 64)}, None, 0.1, 0.3),
    ]
    m = build_manifest(5, 2, reports, {"world_size": 2, "config": {"a": [1, 2]}}, 1.5)
    back = manifest_from_json(m.to_json())
    assert back == m and back.total_bytes == 24 and back.shards[1]["files"] == ["__1_0.distcp"]


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a//b", "C:/x", "a\\b", "", "manifest.json"])
def test_manifest_rejects_paths_outside_the_step_dir(bad: str) -> None:
    with pytest.raises(ManifestError, match="manifest"):
        manifest_from_json(_manifest_json({bad: {"size": 1, "sha256": SHA}}), "manifest")


@pytest.mark.parametrize(
    "text, words",
    [("{", "not valid JSON"), ("[]", "not an object"), (_digested({"version": 1}), "missing field 'step'"),
         ('{"version": 1}', "has no digest field"),
     (_manifest_json({"x": {"size": -1, "sha256": SHA}}), "invalid size"),
     (_manifest_json({"x": {"size": 1, "sha256": "zz"}}), "invalid sha256")],
)
def test_manifest_parse_errors_are_clear(text: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        manifest_from_json(text, "s3://b/run/step_000000005/manifest.json")


def test_build_refuses_conflicting_reports_and_missing_metadata() -> None:
    a = ShardReport(1, 0, {".metadata": FileInfo(1, SHA), "f": FileInfo(1, SHA)}, None, 0, 0)
    b = ShardReport(1, 1, {"f": FileInfo(2, SHA)}, None, 0, 0)
    with pytest.raises(CheckpointError, match="different contents"):
        build_manifest(1, 2, [a, b], {}, 0.0)
    with pytest.raises(CheckpointError, match=".metadata"):
        build_manifest(1, 1, [b], {}, 0.0)


def test_step_dir_names_sort_and_parse() -> None:
    assert step_dir_name(42) == "step_000000042" and parse_step_dir("step_000000042") == 42
    assert parse_step_dir("step_42") is None and parse_step_dir("tmp") is None
    assert check_relpath("sub/file.distcp") == "sub/file.distcp"


def test_retention_examples() -> None:
    assert retention_victims([10, 20, 30, 40, 50], [], keep_last=2, keep_every=20) == [10, 30]
    assert retention_victims([10, 20, 30], [5, 25, 35], keep_last=1, keep_every=0, in_use=frozenset({10})) == [5, 20, 25]
    assert retention_victims([], [1, 2], keep_last=1, keep_every=0) == []
    with pytest.raises(ValueError, match="keep_last"):
        retention_victims([1], [], keep_last=0, keep_every=0)


@given(
    st.sets(st.integers(0, 300), max_size=30),
    st.sets(st.integers(0, 300), max_size=10),
    st.integers(1, 5),
    st.integers(0, 7),
    st.sets(st.integers(0, 300), max_size=4),
)
def test_retention_invariants(committed: set, uncommitted: set, keep_last: int, keep_every: int, in_use: set) -> None:
    uncommitted -= committed
    delete = set(retention_victims(committed, uncommitted, keep_last, keep_every, frozenset(in_use)))
    assert not delete & in_use
    if committed:
        newest = max(committed)
        assert newest not in delete
        assert not delete & set(sorted(committed)[-keep_last:])
        assert all(s % keep_every for s in delete & committed) if keep_every else True
        assert all(s < newest for s in delete & uncommitted)
    else:
        assert not delete


class _Evil:
    """Unpickled, it runs a shell command that creates ``marker`` (the test's own path: a fixed /tmp name is
    shared with every other session on the machine)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_safe_metadata_refuses_code_execution(tmp_path) -> None:
    marker = tmp_path / "pwned"
    for payload in (_Evil(str(marker)), {"x": _Evil(str(marker))}):
        with pytest.raises(UnsafeMetadataError, match="refusing"):
            loads_metadata(pickle.dumps(payload), "s3://b/step_1/.metadata")
    assert not marker.exists()
    with pytest.raises(UnsafeMetadataError, match="not DCP Metadata"):
        loads_metadata(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="corrupt"):
        loads_metadata(b"\x80\x04garbage")


def test_safe_metadata_refuses_a_storage_reference_as_tampering_like_the_bytes_loader() -> None:
    """Both restricted unpicklers share one shape (checkpoint/restricted_pickle.py): a persistent id, which a
    DCP metadata file never holds, is refused as tampering (UnsafeMetadataError), not read as mere damage."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):  # noqa: ANN001, ANN202
            return ("storage", "0") if obj == "S" else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(["S"])
    with pytest.raises(UnsafeMetadataError, match="s3://b/step_1/.metadata.*tensor storage reference.*refusing"):
        loads_metadata(buf.getvalue(), "s3://b/step_1/.metadata")


def test_safe_metadata_accepts_real_dcp_metadata(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(3, dtype=torch.bfloat16), "o": {"lr": 0.1, "betas": (0.9, 0.99)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    md = loads_metadata((tmp_path / ".metadata").read_bytes())
    assert md.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert md.state_dict_metadata["w"].size == torch.Size([3])
