"""DCP storage plumbing: a writer that checksums every byte as it is written, and a reader that runs no
code from storage: ``.metadata`` goes through the restricted unpickler (:mod:`.safe_metadata`), bytes items
through the plain-data loader (:mod:`.safe_bytes`), every file it opens must be listed in the manifest with
the size and SHA-256 it has, and every path the metadata names must stay inside the checkpoint directory.

The writer plugs a :class:`HashingFileSystem` (a DCP ``FileSystemBase`` over fsspec) into DCP's stock
``FileSystemWriter``, so DCP keeps doing planning, dedup of replicated tensors and the file layout, while
every stream it opens is wrapped: SHA-256 and size are computed on the fly (no read-back) and recorded per
file. Local/Lustre files are written back to disk while being written, fsync'ed on close and then dropped
from the page cache (:mod:`elastictrain.checkpoint.write_behind`; we run DCP with ``sync_files=False``
because its fallback for streams without a file descriptor is a machine-wide ``os.sync()``).

On S3 there are two ways to get a stream's bytes out (``s3_mode``):
* ``"buffer"`` (default): keep the file in memory and upload it on close with ``fs.pipe``, which for large
  files runs a multipart upload with ``max_concurrency`` parts in flight;
* ``"stream"``: s3fs's buffered file, which uploads one part at a time as the buffer fills (less memory,
  one part in flight). ``benchmarks/checkpoint.py`` measures both.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import FileInfo, check_relpath
from elastictrain.checkpoint.safe_bytes import UnsafeBytesError, is_safe_planner
from elastictrain.checkpoint.safe_metadata import UnsafeMetadataError, loads_metadata
from elastictrain.checkpoint.write_behind import WriteBehindFile

S3Mode = Literal["buffer", "stream"]


# chunks at least this big are hashed on a helper thread while the sink writes them (both release the
# GIL); smaller ones are not worth the hand-off
_PARALLEL_HASH_MIN = 256 * 1024


class _HashingStream(io.RawIOBase):
    """Write-only stream: every byte goes through SHA-256 and on to ``sink``; ``tell`` counts bytes.

    With ``hasher`` (a one-thread executor) a large chunk is hashed concurrently with its write; ``write``
    returns only when both are done, so the caller's buffer is never used after ``write`` returns."""

    def __init__(self, sink: Any, hasher: ThreadPoolExecutor | None = None) -> None:
        super().__init__()
        self._sink = sink
        self._hasher = hasher
        self._hash = hashlib.sha256()
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._hasher is not None and len(view) >= _PARALLEL_HASH_MIN:
            pending = self._hasher.submit(self._hash.update, view)
            try:
                self._sink.write(view)
            finally:
                pending.result()
        else:
            self._hash.update(view)
            self._sink.write(view)
        self._pos += len(view)
        return len(view)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._sink.flush()

    def info(self) -> FileInfo:
        return FileInfo(self._pos, self._hash.hexdigest())


class HashingFileSystem(FileSystemBase):
    """DCP file system over fsspec that records ``{relpath: FileInfo}`` for every file it writes.

    ``base`` is the step directory (fsspec path); ``uri`` is its URI, used in error messages only.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, base: str, uri: str, s3_mode: S3Mode = "buffer") -> None:
        self.fs = fs
        self.base = base.rstrip("/")
        self.uri = uri
        self.s3_mode = s3_mode
        self._local = storage.is_local(fs)
        self._lock = threading.Lock()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256")
        self.written: dict[str, FileInfo] = {}

    def close(self) -> None:
        """Stop the hashing helper thread (the owner calls this when the save is over)."""
        self._hasher.shutdown(wait=True)

    def _rel(self, path: str | os.PathLike) -> str:
        p = os.fspath(path)
        prefix = self.base + "/"
        return p[len(prefix) :] if p.startswith(prefix) else p

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "r" in mode:
            with self.fs.open(path, mode) as f:
                yield f
            return
        try:
            stream = self._write_stream(path)
            with stream as (hashing, finish):
                yield hashing
                finish()
        except BaseException:
            # a partial file must not look like a finished one to a later verify
            try:
                self.fs.rm_file(path)
            except Exception:  # noqa: BLE001 - best effort; the original error is what matters
                pass
            raise
        with self._lock:
            self.written[self._rel(path)] = hashing.info()

    @contextmanager
    def _write_stream(self, path: str) -> Generator[tuple[_HashingStream, Any], None, None]:
        if self._local:
            with WriteBehindFile(path) as f:  # written back while writing, fsync'ed and dropped at the end
                yield _HashingStream(f, self._hasher), f.finish
        elif self.s3_mode == "stream":
            with self.fs.open(path, "wb") as f:
                yield _HashingStream(f, self._hasher), lambda: None
        else:
            buf = io.BytesIO()
            hashing = _HashingStream(buf, self._hasher)

            def upload() -> None:
                self.fs.pipe(path, buf.getvalue())

            yield hashing, upload

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return storage.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        src, dst = os.fspath(path), os.fspath(new_path)
        if self._local:
            os.rename(src, dst)
            storage.fsync_dir(os.path.dirname(dst))
        else:
            self.fs.mv(src, dst)
        with self._lock:
            info = self.written.pop(self._rel(src), None)
            if info is not None:
                self.written[self._rel(dst)] = info

    def mkdir(self, path: str | os.PathLike) -> None:
        # object stores have no directories, and s3fs.makedirs would CREATE a missing bucket (a typo in
        # checkpoint.uri must fail loudly, not make a bucket)
        if self._local:
            self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm_file(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.fs.ls(os.fspath(path), detail=False)


class HashingWriter(FileSystemWriter):
    """DCP ``FileSystemWriter`` writing through a :class:`HashingFileSystem`; one file per rank."""

    def __init__(self, hfs: HashingFileSystem) -> None:
        super().__init__(path=hfs.base, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.fs = hfs
        self.path = hfs.base

    @property
    def written(self) -> dict[str, FileInfo]:
        return dict(self.fs.written)


class _VerifyingFileSystem:
    """Wraps a DCP reader's file system: only files listed in ``expected`` can be opened; each is read
    whole (never more than its recorded size, never through a local symlink or special file), its size and
    SHA-256 checked, and served from memory. So each rank verifies exactly what it
    reads, once, while reading, and a file the manifest does not list is never read at all."""

    def __init__(self, inner: Any, base: str, uri: str, expected: dict[str, FileInfo]) -> None:
        self._inner = inner
        self._base = base.rstrip("/")
        self._uri = uri
        self._expected = expected

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "r" not in mode:
            raise CheckpointError(f"{self._uri}: a checkpoint reader never writes ({path})")
        rel = path[len(self._base) + 1:] if path.startswith(self._base + "/") else path
        yield io.BytesIO(self.read_listed(rel))

    def read_listed(self, rel: str) -> bytes:
        """The bytes of ``rel`` (relative to the checkpoint directory), checked against the manifest;
        CheckpointError when the manifest does not list it or its bytes differ."""
        where = storage.join(self._uri, rel)
        info = self._expected.get(rel)
        if info is None:
            raise CheckpointError(f"{where}: the checkpoint's manifest does not list this file; refusing to read it "
                                  "(the checkpoint may have been tampered with)")
        # at most the recorded size is read, and only from a regular file
        data = storage.read_at_most(self._inner.fs, storage.join(self._base, rel), where, info.size,
                                    f"{info.size} recorded")
        check_bytes(data, info, where)
        return data


def check_bytes(data: bytes, info: FileInfo, where: str) -> None:
    """Raise CheckpointError unless ``data`` has the size and SHA-256 the manifest recorded."""
    if len(data) != info.size:
        raise CheckpointError(f"{where}: size {len(data)} != {info.size} recorded (truncated or overwritten)")
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise CheckpointError(f"{where}: SHA-256 mismatch (contents changed after the save)")


def check_tensor_sizes(metadata: Metadata, listed_bytes: int, where: str) -> None:
    """Raise :class:`UnsafeMetadataError` unless the tensors ``metadata`` declares fit in the ``listed_bytes``
    the manifest lists: a reader without a target (export) allocates every declared tensor, so a forged shape
    must not ask for more memory than the checkpoint's own files hold."""
    total = 0
    for fqn, md in (metadata.state_dict_metadata or {}).items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dims = list(md.size)
        chunks = [list(c.sizes) for c in md.chunks] + [list(c.offsets) for c in md.chunks]
        if not isinstance(md.properties.dtype, torch.dtype) or \
                not all(isinstance(d, int) and d >= 0 for d in dims + [d for c in chunks for d in c]):
            raise UnsafeMetadataError(f"{where}: tensor {fqn!r} has size {dims} and dtype {md.properties.dtype!r}; "
                                      "refusing it (the checkpoint may have been tampered with)")
        total += math.prod(dims) * torch.empty((), dtype=md.properties.dtype).element_size()
        if total > listed_bytes:
            raise UnsafeMetadataError(f"{where}: declares tensors of more than {listed_bytes} bytes (at {fqn!r}, "
                                      f"size {dims}) but the manifest lists {listed_bytes} bytes of files; refusing "
                                      "it (the checkpoint may have been tampered with)")


class SafeReader(FsspecReader):
    """DCP ``FsspecReader`` that runs no code from storage. ``expected`` (the manifest's files, keyed
    relative to ``uri``) is required: only those files are read, each checked against its recorded size
    and SHA-256; ``.metadata`` is unpickled with an allow-list; every storage path it names must be a
    listed file inside ``uri``; bytes items are loaded only through a planner of :mod:`.safe_bytes`."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, *,
                 expected: dict[str, FileInfo]) -> None:
        super().__init__(uri, **(storage_options or {}))
        self._uri = uri
        self._expected = dict(expected)
        self._checked: dict[str, Metadata] = {}
        self.fs = _VerifyingFileSystem(self.fs, os.fspath(self.path), uri, self._expected)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked ``.metadata``, read and judged once per reader: a caller that asks first (to refuse
        a bad checkpoint with its own one-line error, before DCP would log a traceback and try a rank-local
        fallback) costs DCP's own ask nothing."""
        name = os.path.basename(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
        metadata = self._checked.get(name)
        if metadata is None:
            data = self.fs.read_listed(name)
            metadata = loads_metadata(data, storage.join(self._uri, name))
            self._check_storage_paths(metadata, storage.join(self._uri, name))
            check_tensor_sizes(metadata, sum(info.size for info in self._expected.values()),
                               storage.join(self._uri, name))
            self._checked[name] = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage_paths(self, metadata: Metadata, where: str) -> None:
        """Every item's file is a plain relative path the manifest lists, at a sane offset, untransformed."""
        for index, info in (metadata.storage_data or {}).items():
            if not isinstance(info, _StorageInfo):
                raise UnsafeMetadataError(f"{where}: storage entry of {index} is a {type(info).__name__}")
            check_relpath(info.relative_path, where)
            if info.relative_path not in self._expected:
                raise UnsafeMetadataError(f"{where}: names the file {info.relative_path!r}, which the manifest does "
                                          "not list; refusing it (the checkpoint may have been tampered with)")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)) \
                    or info.offset + info.length > self._expected[info.relative_path].size:
                raise UnsafeMetadataError(f"{where}: storage entry of {index} has offset {info.offset!r} and "
                                          f"length {info.length!r} in a file of "
                                          f"{self._expected[info.relative_path].size} bytes")
            if info.transform_descriptors:  # elastictrain writes none; a reader would look up extensions by name
                raise UnsafeMetadataError(f"{where}: storage entry of {index} asks for transforms "
                                          f"{list(info.transform_descriptors)}, which elastictrain never writes")

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not is_safe_planner(planner):
            raise CheckpointError(f"{self._uri}: refusing to load with {type(planner).__name__}, which would unpickle "
                                  "the checkpoint's non-tensor entries without restriction; use "
                                  "elastictrain.checkpoint.safe_bytes.SafeLoadPlanner")
        try:
            return super().read_data(plan, planner)
        except UnsafeBytesError as e:  # name the checkpoint, not only the entry
            raise UnsafeBytesError(f"{self._uri}: {e}") from None
