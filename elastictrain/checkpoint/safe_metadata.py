"""A restricted unpickler for DCP's ``.metadata`` file.

DCP's ``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on a file that comes from storage —
anyone who can write to the bucket could run code in every worker. Here only the classes DCP actually
puts into that file can be named: its metadata dataclasses, ``torch.Size``, dtypes, layouts, memory
formats and plain builtins. Anything else (``os.system``, ``builtins.eval``, ``subprocess.Popen``...) makes
loading fail with :class:`UnsafeMetadataError` before any object is built from it (the unpickler is a
:class:`~elastictrain.checkpoint.restricted_pickle.AllowListUnpickler`, as the bytes items' is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.restricted_pickle import AllowListUnpickler, restricted_loads

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.planner": frozenset({"WriteItemType", "LoadItemType"}),
    # a name -> layout lookup table, no side effects
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "complex"}),
    # DCP stores checkpoint_id as given; constructing a path object touches nothing
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeMetadataError(CheckpointError):
    """The metadata pickle names something outside the allow-list; it was not loaded."""


class _RestrictedUnpickler(AllowListUnpickler):
    allowed = _ALLOWED
    refusal = UnsafeMetadataError
    holds = "only DCP's metadata classes, torch sizes, dtypes and plain data (a DCP metadata file)"

    def extra_global(self, module: str, name: str) -> Any | None:
        if module == "torch":
            # dtypes/layouts/memory formats pickle as module attributes (torch.float32, torch.strided...)
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUE_TYPES):
                return value
        return None


def loads_metadata(data: bytes, where: str = ".metadata") -> Metadata:
    """Unpickle DCP metadata from ``data`` with the allow-list; raise on anything else or a non-Metadata."""
    obj = restricted_loads(_RestrictedUnpickler, data, f"{where} (checkpoint metadata)")
    if not isinstance(obj, Metadata):
        raise UnsafeMetadataError(f"{where}: metadata file holds a {type(obj).__name__}, not DCP Metadata")
    return obj
