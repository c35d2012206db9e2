"""What an attacker with write access to the checkpoint bucket can do to a committed checkpoint: forge its
``.metadata`` (:func:`forge_metadata`: allocations out of nothing, shapes no file holds), put a
pickle that runs code into a bytes item of a ``.distcp`` shard (appended to the shard, the ``.metadata``
entry pointed at it), point a storage entry at another file, then rewrite the manifest's sizes, SHA-256s and
digest to match (the digest is unkeyed: anyone can recompute it)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from elastictrain.checkpoint.manifest import manifest_digest

LR = "optim.param_groups.0.lr"


class Plant:
    """Unpickling this opens (creates) ``path``: the stand-in for any code an attacker would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "manifest.json").read_text())


def _data_dir(body: dict[str, Any]) -> str:
    meta = next(p for p in body["files"] if p.endswith(".metadata"))
    return meta[: -len(".metadata")]


def relist(step_dir: Path, body: dict[str, Any], rels: list[str]) -> None:
    """Record the current size and SHA-256 of ``rels`` in the manifest and recompute its digest."""
    for rel in rels:
        data = (step_dir / rel).read_bytes()
        body["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body["digest"] = manifest_digest(body)
    (step_dir / "manifest.json").write_text(json.dumps(body))


def repoint(step_dir: Path, fqn: str, **changes: Any) -> None:
    """Change the ``.metadata`` storage entry of ``fqn`` (e.g. ``relative_path``), manifest kept consistent."""
    body = _manifest(step_dir)
    meta = _data_dir(body) + ".metadata"
    md = pickle.loads((step_dir / meta).read_bytes())  # noqa: S301 - our own test file
    index = next(i for i in md.storage_data if i.fqn == fqn)
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], **changes)
    (step_dir / meta).write_bytes(pickle.dumps(md))
    relist(step_dir, body, [meta])


def plant_payload(step_dir: Path, marker: Path, fqn: str = LR) -> None:
    """Make the bytes item ``fqn`` of the committed checkpoint in ``step_dir`` a pickle that creates
    ``marker`` when loaded with a full unpickler; the manifest is rewritten to match."""
    body = _manifest(step_dir)
    data_dir = _data_dir(body)
    meta = data_dir + ".metadata"
    md = pickle.loads((step_dir / meta).read_bytes())  # noqa: S301 - our own test file
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(Plant(str(marker)), buf)
    shard = step_dir / data_dir / info.relative_path
    old = shard.read_bytes()
    shard.write_bytes(old + buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=len(old), length=len(buf.getvalue()))
    (step_dir / meta).write_bytes(pickle.dumps(md))
    relist(step_dir, body, [meta, data_dir + info.relative_path])


class Alloc:
    """Unpickling this asks ``kind(n)``: ``n`` zero bytes out of a few bytes of pickle."""

    def __init__(self, n: int, kind: type = bytes) -> None:
        self.n, self.kind = n, kind

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.kind, (self.n,))


def forge_metadata(step_dir: Path, edit: Any) -> None:
    """Rewrite the ``.metadata`` of the committed checkpoint in ``step_dir`` with ``edit(metadata)`` applied
    (not genuine DCP metadata any more: what an attacker writes), the manifest rewritten to match."""
    body = _manifest(step_dir)
    meta = _data_dir(body) + ".metadata"
    md = pickle.loads((step_dir / meta).read_bytes())  # noqa: S301 - our own test file
    edit(md)
    (step_dir / meta).write_bytes(pickle.dumps(md))
    relist(step_dir, body, [meta])
