"""Storage access for checkpoints: one thin layer over fsspec for local/Lustre paths and ``s3://``.

Everything that touches bytes goes through here so that errors come out as one :class:`CheckpointError`
naming the URI and the fix (bucket missing, no credentials, disk full, permission, endpoint down), and so
that the two writes whose atomicity matters — the manifest (create-only) and small metadata files — are
done right on both kinds of storage:

* POSIX: write a temporary file in the same directory, ``fsync`` it, then ``os.link`` (create-only: fails
  if the target exists) or ``os.replace``, then ``fsync`` the directory so the new name survives a crash.
* S3: a single PUT is atomic; create-only uses ``If-None-Match: *`` (s3fs ``pipe(..., mode="create")``)
  after an existence check, because some S3 look-alikes ignore the conditional header.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from elastictrain.checkpoint.errors import CheckpointError

T = TypeVar("T")

_READ_CHUNK = 8 * 2**20


def open_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """``uri`` -> (filesystem, path as that filesystem wants it). Raises :class:`CheckpointError`."""
    if not uri:
        raise CheckpointError("checkpoint URI is empty; set checkpoint.uri to a path or s3://bucket/prefix")
    try:
        fs, path = url_to_fs(uri, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise CheckpointError(f"cannot open checkpoint storage {uri!r}: {e}") from e
    return fs, path.rstrip("/") or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for a POSIX file system (local disk, Lustre, NFS), where fsync and hard links exist."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def join(base: str, *parts: str) -> str:
    """Join URI/path parts with ``/`` (never ``os.path.join``: S3 keys are not OS paths)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def describe_error(exc: BaseException, uri: str, action: str) -> str:
    """One readable sentence for a storage failure: what happened at ``uri`` and how to fix it."""
    name = type(exc).__name__
    text = str(exc)
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            f"{action} {uri}: no usable S3 credentials were found; set them in checkpoint.storage_options "
            "(key/secret), in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or in ~/.aws/credentials"
        )
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError") or (
        isinstance(exc, (ConnectionError, TimeoutError)) and "s3" in uri
    ):
        return f"{action} {uri}: the S3 endpoint is unreachable ({text}); check endpoint_url and the network"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or (
        isinstance(exc, FileNotFoundError) and uri.startswith("s3://") and "bucket" in text.lower()
    ):
        bucket = uri.removeprefix("s3://").split("/", 1)[0]
        return f"{action} {uri}: bucket {bucket!r} does not exist; create it or fix checkpoint.uri"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"{action} {uri}: no space left on device; free space, lower checkpoint.keep_last, or move checkpoint.uri"
    if isinstance(exc, OSError) and exc.errno == errno.EDQUOT:
        return f"{action} {uri}: disk quota exceeded; free space or raise the quota"
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"{action} {uri}: permission denied ({text}); grant write access or choose another checkpoint.uri"
    return f"{action} {uri}: {name}: {text}"


def guarded(action: str, uri: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; translate any storage exception into :class:`CheckpointError` (``FileExistsError`` and
    ``CheckpointError`` pass through, callers handle those)."""
    try:
        return fn()
    except (CheckpointError, FileExistsError):
        raise
    except Exception as e:  # noqa: BLE001 - every backend has its own exception zoo; we name it in the text
        if isinstance(e, FileNotFoundError) and not uri.startswith("s3://"):
            raise
        raise CheckpointError(describe_error(e, uri, action)) from e


def fsync_dir(path: str) -> None:
    """Make a rename/link/unlink inside ``path`` durable (POSIX only)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_posix(path: str, data: bytes, create_only: bool) -> None:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if create_only:
            os.link(tmp, path)  # atomic and fails with EEXIST: a second committer can never overwrite
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(parent)


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, create_only: bool, uri: str) -> None:
    """Write ``data`` at ``path`` so that readers see either nothing or all of it.

    ``create_only``: raise ``FileExistsError`` if ``path`` exists (never overwrite). Other failures raise
    :class:`CheckpointError`.
    """
    if is_local(fs):
        guarded("writing", uri, lambda: _write_posix(path, data, create_only))
        return
    if create_only and guarded("checking", uri, lambda: fs.exists(path)):
        raise FileExistsError(uri)
    try:
        guarded("writing", uri, lambda: fs.pipe(path, data, mode="create" if create_only else "overwrite"))
    except CheckpointError as e:
        if "PreconditionFailed" in str(e.__cause__) or "412" in str(e.__cause__):
            raise FileExistsError(uri) from e
        raise


#: the most bytes a manifest may have: it is read before anything says how big it is
MANIFEST_LIMIT = 64 * 2**20


def read_bytes(fs: fsspec.AbstractFileSystem, path: str, uri: str, limit: int = MANIFEST_LIMIT) -> bytes:
    """The whole object at ``path`` if it has at most ``limit`` bytes (storage is untrusted: a bigger one is a
    CheckpointError, never read whole). ``FileNotFoundError`` passes through; other failures ->
    CheckpointError."""
    try:
        return read_at_most(fs, path, uri, limit, f"allowed for such a file ({limit})")
    except CheckpointError as e:
        if isinstance(e.__cause__, FileNotFoundError) and "bucket" not in str(e).lower():
            raise FileNotFoundError(uri) from e
        raise


def read_at_most(fs: fsspec.AbstractFileSystem, path: str, uri: str, limit: int, rule: str) -> bytes:
    """The bytes of ``path``, refused with a CheckpointError when there are more than ``limit`` (``rule``
    says whose number that is, e.g. "12 recorded") before more than ``limit + 1`` are read: a listed file
    swapped for a huge one, or for a link to ``/dev/zero``, cannot make a reader allocate beyond what the
    manifest says. A local path must be a regular file: not a symlink, a device, a FIFO or a socket (lstat,
    then opened without following links). ``FileNotFoundError`` of a local path passes through."""
    if is_local(fs):
        data = guarded("reading", uri, lambda: _read_local(path, uri, limit))
    elif limit == 0:  # a range read of nothing is an error on S3: ask the size instead
        data = b"" if guarded("reading", uri, lambda: fs.size(path)) == 0 else b"?"
    else:
        data = guarded("reading", uri, lambda: fs.cat_file(path, start=0, end=limit + 1))
    if len(data) > limit:
        raise CheckpointError(f"{uri}: more bytes than the {rule}; refusing to read it (overwritten, or the "
                              "checkpoint may have been tampered with)")
    return data


def _read_local(path: str, uri: str, limit: int) -> bytes:
    def refuse(kind: str) -> None:
        raise CheckpointError(f"{uri}: is {kind}, not a regular file; refusing to read it (the checkpoint may "
                              "have been tampered with)")

    kind = _odd_kind(os.lstat(path).st_mode)  # a missing file raises FileNotFoundError, as a read would
    if kind:
        refuse(kind)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # what was opened, in case the name was swapped
            refuse("a device, FIFO or socket")
        return f.read(limit + 1)


def sha256_of(fs: fsspec.AbstractFileSystem, path: str, uri: str, limit: int | None = None) -> str:
    """Stream ``path`` through SHA-256 (used by verify; writers hash while writing instead). With ``limit``
    (the recorded size) at most ``limit + 1`` bytes are hashed: a file that grew, or a device, ends as a
    mismatch, not as an endless read (:func:`not_regular` tells the caller about links and devices)."""

    def run() -> str:
        h, left = hashlib.sha256(), (limit + 1 if limit is not None else None)
        with fs.open(path, "rb", block_size=_READ_CHUNK) as f:
            while (left is None or left > 0) and (chunk := f.read(_READ_CHUNK if left is None else min(left, _READ_CHUNK))):
                h.update(chunk)
                left = None if left is None else left - len(chunk)
        return h.hexdigest()

    return guarded("reading", uri, run)


def not_regular(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """For a local ``path`` that is a symlink, directory, device, FIFO or socket: what it is; else None
    (object stores hold only objects). A missing path is None: the caller's listing says it is missing."""
    if not is_local(fs):
        return None
    try:
        return _odd_kind(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def _odd_kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else \
        "a device, FIFO or socket"


def list_sizes(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> dict[str, int]:
    """relpath -> size of every file under ``path`` (recursive, one listing). Missing dir -> {}."""

    def run() -> dict[str, int]:
        fs.invalidate_cache(path)  # a commit must see storage as it is now, not a cached listing
        if not fs.exists(path):
            return {}
        found = fs.find(path, detail=True)
        prefix = fs._strip_protocol(path).rstrip("/") + "/"
        out = {}
        for name, info in found.items():
            rel = fs._strip_protocol(name)
            if rel.startswith(prefix):
                out[rel[len(prefix) :]] = int(info.get("size") or 0)
        return out

    return guarded("listing", uri, run)


def list_dirs(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> list[str]:
    """Names (not paths) of the immediate sub-directories of ``path``; missing -> []."""

    def run() -> list[str]:
        try:
            entries = fs.ls(path, detail=True, refresh=True) if not is_local(fs) else fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    return guarded("listing", uri, run)


def remove_tree(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> None:
    """Delete ``path`` and everything below it; already gone is fine."""

    def run() -> None:
        if fs.exists(path):
            fs.rm(path, recursive=True)

    guarded("deleting", uri, run)


def remove_file(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> None:
    """Delete one file; already gone is fine."""

    def run() -> None:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass

    guarded("deleting", uri, run)


def ensure_writable_root(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> None:
    """Fail early and clearly when the checkpoint root cannot be used (missing bucket, no credentials)."""
    if is_local(fs):
        guarded("creating", uri, lambda: os.makedirs(path, exist_ok=True))
        return
    bucket = path.split("/", 1)[0]
    exists = guarded("checking", uri, lambda: fs.exists(bucket))
    if not exists:
        raise CheckpointError(f"opening {uri}: bucket {bucket!r} does not exist; create it or fix checkpoint.uri")
