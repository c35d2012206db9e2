"""Controller side: the commit authority over ``<checkpoint.uri>/<run stable id>/step_<n>/``.

Commit protocol: workers write shards and report (:class:`ShardReport`); when every rank of the generation
reported success for a step, :meth:`CheckpointStore.commit` writes ``manifest.json`` LAST and create-only.
A step directory without a manifest is not a checkpoint (an abandoned or crashed save); a manifest is never
overwritten. ``verify`` (``ckpt verify``) recomputes sizes and SHA-256 of the listed files; resume and
recovery check sizes only and leave the checksums to the ranks that read the files. Resume takes the newest
committed checkpoint that verifies and says why newer ones were skipped. No torch.distributed here.

A manifest must carry its digest; with a signing key (``ELASTICTRAIN_CHECKPOINT_KEY``, read when the store
is made: :mod:`elastictrain.checkpoint.signing`) commits are signed and unsigned or badly signed manifests are
refused like damaged ones. A file in the committed attempt directory that the manifest does not list makes
the checkpoint damaged too (readers never open such a file).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.compat import lineage_of
from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ShardReport,
    build_manifest,
    check_relpath,
    manifest_from_json,
    parse_step_dir,
    step_dir_name,
)
from elastictrain.checkpoint.retention import retention_victims
from elastictrain.checkpoint.signing import key_from_env

_FROM_ENV: Any = object()


class CheckpointStore:
    """Checkpoints of one run under ``root_uri`` (= ``<checkpoint.uri>/<run stable id>``)."""

    def __init__(self, root_uri: str, storage_options: dict[str, Any] | None = None,
                 key: bytes | None = _FROM_ENV) -> None:
        """``key``: the manifest signing key; by default ``ELASTICTRAIN_CHECKPOINT_KEY`` (None when unset)."""
        self.root_uri = root_uri.rstrip("/")
        self.key: bytes | None = key_from_env() if key is _FROM_ENV else key
        self.storage_options = dict(storage_options or {})
        self._fs, self._root = storage.open_fs(self.root_uri, self.storage_options)

    # ------------------------------------------------------------------------------------------- paths

    def step_uri(self, step: int) -> str:
        return storage.join(self.root_uri, step_dir_name(step))

    def _step_path(self, step: int) -> str:
        return storage.join(self._root, step_dir_name(step))

    # ------------------------------------------------------------------------------------------ commit

    def commit(self, step: int, reports: list[ShardReport], meta: dict[str, Any]) -> Manifest:
        """Write the manifest of ``step`` from all ranks' reports; returns it.

        ``meta`` must hold ``world_size`` (int) plus whatever resume needs (plan, global_batch, seed,
        dataset_len, config, samples_seen...). Raises CheckpointError if a report failed, is for another
        step, a rank is missing or duplicated, a reported file is absent, or the step is already committed.
        """
        world = meta.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"commit of {self.step_uri(step)}: meta['world_size'] must be an int >= 1, got {world!r}")
        self._check_reports(step, world, reports)
        manifest = build_manifest(step, world, reports, meta, time.time())
        self._check_files_present(manifest)
        where = storage.join(self.step_uri(step), MANIFEST_NAME)
        data = manifest.to_json(self.key).encode()
        try:
            storage.write_atomic(self._fs, storage.join(self._step_path(step), MANIFEST_NAME), data, create_only=True, uri=where)
        except FileExistsError:
            raise CheckpointError(f"{where} already exists: step {step} is committed and is never overwritten") from None
        return Manifest(**{**manifest.__dict__, "location": self.step_uri(step)})

    def _check_reports(self, step: int, world: int, reports: list[ShardReport]) -> None:
        uri = self.step_uri(step)
        failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        if failed:
            raise CheckpointError(f"not committing {uri}: " + "; ".join(failed))
        wrong = sorted({r.step for r in reports if r.step != step})
        if wrong:
            raise CheckpointError(f"not committing {uri}: reports for other steps {wrong} were passed")
        ranks = [r.rank for r in reports]
        missing = sorted(set(range(world)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world)))
        dups = sorted({r for r in ranks if ranks.count(r) > 1})
        if missing or extra or dups:
            raise CheckpointError(
                f"not committing {uri}: world_size={world} but ranks missing={missing} unknown={extra} "
                f"duplicated={dups}; wait for every rank of the generation"
            )

    def _check_files_present(self, manifest: Manifest) -> None:
        uri = self.step_uri(manifest.step)
        sizes = storage.list_sizes(self._fs, self._step_path(manifest.step), uri)
        absent = [p for p, info in manifest.files.items() if sizes.get(p) != info.size]
        if absent:
            raise CheckpointError(f"not committing {uri}: reported files absent or of another size: {sorted(absent)}")

    # ------------------------------------------------------------------------------------------- reading

    def _steps_on_storage(self) -> list[int]:
        names = storage.list_dirs(self._fs, self._root, self.root_uri)
        if not names and not storage.is_local(self._fs):
            # "nothing here" and "bucket missing" look the same to a listing; resume=auto must not
            # silently start from scratch because of a typo in checkpoint.uri
            storage.ensure_writable_root(self._fs, self._root, self.root_uri)
        return sorted(s for s in (parse_step_dir(n) for n in names) if s is not None)

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``; FileNotFoundError if uncommitted, ManifestError if it does not parse."""
        where = storage.join(self.step_uri(step), MANIFEST_NAME)
        data = storage.read_bytes(self._fs, storage.join(self._step_path(step), MANIFEST_NAME), where)
        manifest = manifest_from_json(data, where, location=self.step_uri(step), key=self.key)
        if manifest.step != step:
            raise ManifestError(f"{where}: says step {manifest.step} but lies in {step_dir_name(step)}")
        return manifest

    def _scan(self) -> tuple[list[Manifest], dict[int, str]]:
        """(manifests that parse, sorted by step; {step: why not} for step dirs without a usable one)."""
        good, uncommitted, refused = self._scan_all()
        return good, {**uncommitted, **refused}

    def _scan_all(self) -> tuple[list[Manifest], dict[int, str], dict[int, str]]:
        """(manifests that parse; {step: why} for dirs without a manifest; {step: why} for dirs whose
        manifest was refused: damaged, tampered, unsigned under a key)."""
        good, uncommitted, refused = [], {}, {}
        for step in self._steps_on_storage():
            try:
                good.append(self.read_manifest(step))
            except FileNotFoundError:
                uncommitted[step] = (f"{self.step_uri(step)}: no {MANIFEST_NAME} (save never committed: crashed or "
                                     "abandoned)")
            except ManifestError as e:
                refused[step] = str(e)
        return good, uncommitted, refused

    def refused(self) -> dict[int, str]:
        """{step: why} for step directories whose manifest exists but is refused (damaged, tampered,
        unsigned or badly signed under a key): committed once, perhaps, but not trusted now."""
        return self._scan_all()[2]

    def committed(self) -> list[Manifest]:
        """Committed checkpoints whose manifest parses, oldest first (no checksums: cheap)."""
        return self._scan()[0]

    def verify(self, manifest: Manifest, checksums: bool = True) -> list[str]:
        """Problems with the files of ``manifest`` (missing, size, SHA-256, files it does not list in its
        attempt directory); ``[]`` means intact."""
        base_uri = manifest.location or self.step_uri(manifest.step)
        fs, base = storage.open_fs(base_uri, self.storage_options)
        sizes = storage.list_sizes(fs, base, base_uri)
        problems = []
        for rel, info in sorted(manifest.files.items()):
            check_relpath(rel, base_uri)
            uri = storage.join(base_uri, rel)
            odd = storage.not_regular(fs, storage.join(base, rel))
            if odd:  # a reader refuses it too; said here, resume picks an older checkpoint at once
                problems.append(f"{uri}: is {odd}, not a regular file (the checkpoint may have been tampered with)")
            elif rel not in sizes:
                problems.append(f"{uri}: missing")
            elif sizes[rel] != info.size:
                problems.append(f"{uri}: size {sizes[rel]} != {info.size} recorded (truncated or overwritten)")
            elif checksums and storage.sha256_of(fs, storage.join(base, rel), uri, info.size) != info.sha256:
                problems.append(f"{uri}: SHA-256 mismatch (contents changed after the save)")
        for rel in unlisted_files(manifest, sizes):
            problems.append(f"{storage.join(base_uri, rel)}: not listed by the manifest (added after the commit)")
        return problems

    def latest_valid(self, checksums: bool = True, lineage: str | None = None) -> tuple[Manifest | None, list[str]]:
        """Newest committed checkpoint that verifies, and why each newer step dir was skipped.

        ``checksums=False`` (the resume and recovery hot path) checks presence and sizes only: the
        manifest's own digest was checked when it parsed, and each rank checks the SHA-256 of what it
        reads (:class:`~elastictrain.checkpoint.dcp_io.SafeReader`). ``lineage`` keeps only checkpoints of
        that trajectory (:func:`~elastictrain.checkpoint.compat.lineage_of`)."""
        good, bad = self._scan()
        candidates = {m.step: m for m in good if lineage is None or lineage_of(m.meta) == lineage}
        skipped: list[str] = []
        for step in sorted(set(candidates) | set(bad), reverse=True):
            if step in bad:
                skipped.append(bad[step])
                continue
            problems = self.verify(candidates[step], checksums=checksums)
            if not problems:
                return candidates[step], skipped
            skipped.append(f"{self.step_uri(step)}: " + "; ".join(problems))
        return None, skipped

    def older_valid(self, step: int, lineage: str | None) -> Manifest | None:
        """The newest checkpoint of ``lineage`` older than ``step`` whose files are present with their sizes."""
        for m in reversed(self.committed()):
            if m.step < step and (lineage is None or lineage_of(m.meta) == lineage) \
                    and not self.verify(m, checksums=False):
                return m
        return None

    def has_step_dirs(self) -> bool:
        """Whether anything (committed or not) lives under this run root."""
        return bool(self._steps_on_storage())

    def resolve(self, resume: str) -> Manifest | None:
        """``"auto"`` -> newest valid (or None), ``"never"`` -> None, else an explicit checkpoint URI
        (a step dir or its ``manifest.json``) -> its manifest. Sizes are verified, not checksums (see
        :meth:`latest_valid`). Raises CheckpointError."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest_valid(checksums=False)[0]
        return self._resolve_explicit(resume)

    def _resolve_explicit(self, uri: str) -> Manifest:
        step_uri = uri.rstrip("/").removesuffix("/" + MANIFEST_NAME)
        fs, path = storage.open_fs(step_uri, self.storage_options)
        where = storage.join(step_uri, MANIFEST_NAME)
        try:
            data = storage.read_bytes(fs, storage.join(path, MANIFEST_NAME), where)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint.resume={uri!r}: {where} does not exist (not a committed checkpoint); "
                "point it at a step directory with a manifest, or use resume=auto"
            ) from None
        manifest = manifest_from_json(data, where, location=step_uri, key=self.key)
        problems = self.verify(manifest, checksums=False)
        if problems:
            raise CheckpointError(f"checkpoint.resume={uri!r} is damaged: " + "; ".join(problems))
        return manifest

    # ----------------------------------------------------------------------------------------- retention

    def retain(self, keep_last: int, keep_every: int, in_use: Iterable[int] = frozenset(),
               lineage: str | None = None) -> list[int]:
        """Delete what :func:`retention_victims` says; returns the deleted steps. Step directories whose
        manifest is refused on read are never deleted (an operator looks at them; ``ckpt ls`` lists why).

        With ``lineage``, only that trajectory's committed checkpoints count and may go: another run's
        commits under the same root are never deleted. A committed checkpoint loses its manifest first, so
        a crash half-way leaves an uncommitted dir (swept next time), never a committed checkpoint with
        missing files."""
        # a refused manifest (damaged, or unsigned once a key is set) is not an abandoned save: not swept
        good, bad, _refused = self._scan_all()
        others = {m.step for m in good if lineage is not None and lineage_of(m.meta) != lineage}
        good = [m for m in good if m.step not in others]
        in_use = frozenset(in_use) | others
        delete = retention_victims([m.step for m in good], sorted(bad), keep_last, keep_every, frozenset(in_use))
        committed = {m.step for m in good}
        for step in delete:
            if step in committed:
                storage.remove_file(self._fs, storage.join(self._step_path(step), MANIFEST_NAME), self.step_uri(step))
            storage.remove_tree(self._fs, self._step_path(step), self.step_uri(step))
        return delete


def unlisted_files(manifest: Manifest, present: Iterable[str]) -> list[str]:
    """Files of ``present`` (relative to the step directory) in the committed attempt directory of
    ``manifest`` that it does not list. Other attempt directories (saves that never committed) are not its."""
    prefix = manifest.data_dir + "/" if manifest.data_dir else ""
    mine = (p for p in present if (p.startswith(prefix) if prefix else "/" not in p))
    return sorted(p for p in mine if p != MANIFEST_NAME and p not in manifest.files)
