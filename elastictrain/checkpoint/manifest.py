"""PURE: the checkpoint manifest and the per-rank shard report, with strict JSON (de)serialisation.

``manifest.json`` in a step directory is the commit marker of that checkpoint: it lists every file the
ranks wrote (size + SHA-256) and the job metadata needed to resume: the world size that wrote it, the
job fingerprint (:mod:`elastictrain.checkpoint.compat`), the run id and lineage, and the config. There is
no separate "data position" field: the step with ``train.global_batch`` and ``train.seed`` (both in the
fingerprint) defines it (step ``s`` starts at global position ``s * global_batch``). A ``digest`` field
(SHA-256 of the rest of the manifest) lets a reader check the manifest's own integrity cheaply; it is
required on read. It detects damage, not tampering (anyone can recompute it): with a key, ``signature``
(HMAC-SHA256, :mod:`elastictrain.checkpoint.signing`) does that, and a reader given the key requires it.
Nothing here touches storage. Every path named in a manifest is validated to stay inside the step
directory, so a tampered manifest cannot make ``verify``/``load`` read or delete files elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.signing import sign, signature_problem

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(CheckpointError):
    """A manifest that does not parse or names files it must not."""


@dataclass(frozen=True)
class FileInfo:
    """One file of a checkpoint: its size in bytes and the SHA-256 computed while it was written."""

    size: int
    sha256: str


@dataclass(frozen=True)
class ShardReport:
    """What one rank did for one save: the files IT wrote (relpaths in the step dir), or why it failed."""

    step: int
    rank: int
    files: dict[str, FileInfo]
    error: str | None
    stage_s: float
    write_s: float
    generation: int | None = None  # the membership generation that wrote it (its attempt directory)
    # the reporting rank's newest step records up to ``step`` (JSON, checkpoint/carried.py), for the manifest
    records: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. ``location`` (the step directory URI) is where it was read from; it is
    not part of the stored JSON."""

    step: int
    world_size: int
    files: dict[str, FileInfo]
    meta: dict[str, Any]
    created_at: float
    shards: dict[int, dict[str, Any]] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    location: str = field(default="", compare=False)

    def to_json(self, key: bytes | None = None) -> str:
        """The stored JSON, with its ``digest``; with ``key`` also its HMAC ``signature``."""
        body: dict[str, Any] = {
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "files": {p: {"size": f.size, "sha256": f.sha256} for p, f in sorted(self.files.items())},
            "shards": {str(r): s for r, s in sorted(self.shards.items())},
            "meta": self.meta,
        }
        if key is not None:
            body["signature"] = sign(body, key)
        body["digest"] = manifest_digest(body)
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False)

    @property
    def data_dir(self) -> str:
        """The directory (relative to the step directory) that holds the DCP files: the attempt that was
        committed (e.g. ``g3``), or ``""`` for checkpoints written before attempts existed."""
        meta = next(p for p in self.files if p == METADATA_NAME or p.endswith("/" + METADATA_NAME))
        return meta[: -len(METADATA_NAME)].rstrip("/")

    @property
    def data_files(self) -> dict[str, FileInfo]:
        """The DCP files keyed relative to :attr:`data_dir` (what a reader opened there sees): the keys a
        verifying reader looks its files up by."""
        prefix = self.data_dir + "/" if self.data_dir else ""
        return {p[len(prefix):]: info for p, info in self.files.items() if p.startswith(prefix)}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def manifest_digest(body: dict[str, Any]) -> str:
    """SHA-256 of a manifest body (without its ``digest`` field), canonical JSON."""
    rest = {k: v for k, v in body.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, allow_nan=False).encode()).hexdigest()


def step_dir_name(step: int) -> str:
    """``step_000000042``: zero-padded so that lexical order is step order on every backend."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:09d}"


def attempt_dir_name(generation: int | None) -> str:
    """``g3``: where generation 3 writes its saves inside a step directory; ``""`` (the step directory
    itself) when no generation is given (single-process use)."""
    return "" if generation is None else f"g{generation}"


def _has_metadata(files: dict[str, Any]) -> bool:
    """Exactly one DCP ``.metadata`` file, at the top or in one attempt directory."""
    metas = [p for p in files if p == METADATA_NAME or p.endswith("/" + METADATA_NAME)]
    return len(metas) == 1 and metas[0].count("/") <= 1


def parse_step_dir(name: str) -> int | None:
    """Inverse of :func:`step_dir_name`; ``None`` for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def check_relpath(path: str, where: str = "manifest") -> str:
    """Return ``path`` if it is a plain relative path inside the step dir; else raise ManifestError."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: empty or non-string file path {path!r}")
    if "\\" in path or "\x00" in path:
        raise ManifestError(f"{where}: file path {path!r} contains a backslash or NUL; refusing it")
    p = PurePosixPath(path)
    if p.is_absolute() or re.match(r"^[A-Za-z]:", path):
        raise ManifestError(f"{where}: file path {path!r} is absolute; files must lie inside the step directory")
    if any(part in ("..", "") for part in path.split("/")) or ".." in p.parts:
        raise ManifestError(f"{where}: file path {path!r} escapes the step directory via '..'; refusing it")
    if path == MANIFEST_NAME:
        raise ManifestError(f"{where}: the manifest cannot list itself")
    return path


def _require(body: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in body:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ManifestError(f"{where}: field {key!r} has the wrong type {type(value).__name__}")
    return value


def _parse_files(raw: dict[str, Any], where: str) -> dict[str, FileInfo]:
    files = {}
    for path, info in raw.items():
        check_relpath(path, where)
        if not isinstance(info, dict):
            raise ManifestError(f"{where}: entry for {path!r} is not an object")
        size, sha = info.get("size"), info.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}: {path!r} has an invalid size {size!r}")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ManifestError(f"{where}: {path!r} has an invalid sha256 {sha!r}")
        files[path] = FileInfo(size, sha)
    return files


def manifest_from_json(text: str | bytes, where: str = "manifest", location: str = "",
                       key: bytes | None = None) -> Manifest:
    """Parse and validate; raise :class:`ManifestError` naming ``where`` and the problem. The ``digest``
    is required; with ``key`` (the signing key) a valid ``signature`` is required too."""
    try:
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(body, dict):
        raise ManifestError(f"{where}: top level is not an object")
    if "digest" not in body:
        raise ManifestError(f"{where}: has no digest field; a committed manifest always has one, so this one was "
                            "hand-made or edited: refusing it")
    if body["digest"] != manifest_digest(body):
        raise ManifestError(f"{where}: its digest does not match its contents; the manifest was changed or damaged")
    unsigned = signature_problem(body, key)
    if unsigned:
        raise ManifestError(f"{where}: {unsigned}; refusing it")
    version = _require(body, "version", int, where)
    if version > FORMAT_VERSION:
        raise ManifestError(f"{where}: format version {version} is newer than this elastictrain ({FORMAT_VERSION})")
    step = _require(body, "step", int, where)
    world = _require(body, "world_size", int, where)
    created = _require(body, "created_at", (int, float), where)
    if step < 0 or world < 1 or not math.isfinite(created):
        raise ManifestError(f"{where}: step={step}, world_size={world}, created_at={created} out of range")
    files = _parse_files(_require(body, "files", dict, where), where)
    if not _has_metadata(files):
        raise ManifestError(f"{where}: lists no single {METADATA_NAME} file; not a complete checkpoint")
    shards_raw = body.get("shards", {})
    if not isinstance(shards_raw, dict):
        raise ManifestError(f"{where}: field 'shards' is not an object")
    try:
        shards = {int(r): s for r, s in shards_raw.items()}
    except ValueError:
        raise ManifestError(f"{where}: 'shards' keys must be rank numbers") from None
    meta = _require(body, "meta", dict, where)
    return Manifest(step, world, files, meta, float(created), shards, version, location)


def build_manifest(step: int, world_size: int, reports: list[ShardReport], meta: dict[str, Any], now: float) -> Manifest:
    """Merge the shard reports of one save into a manifest; raise CheckpointError when they disagree."""
    files: dict[str, FileInfo] = {}
    shards: dict[int, dict[str, Any]] = {}
    for r in reports:
        for path, info in r.files.items():
            check_relpath(path, f"report of rank {r.rank}")
            if path in files and files[path] != info:
                raise CheckpointError(f"step {step}: ranks reported different contents for {path!r}")
            files[path] = info
        shards[r.rank] = {"files": sorted(r.files), "stage_s": round(r.stage_s, 6), "write_s": round(r.write_s, 6)}
        if r.records:
            shards[r.rank]["records"] = [dict(x) for x in r.records]
    if not _has_metadata(files):
        raise CheckpointError(f"step {step}: no rank reported one {METADATA_NAME} (rank 0 writes it); cannot commit")
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"step {step}: commit meta is not JSON-serialisable ({e})") from None
    return Manifest(step, world_size, files, dict(meta), now, shards)
