"""Asynchronous sharded checkpoints (torch.distributed.checkpoint) with a manifest commit protocol.

Worker side: :class:`CheckpointWriter` (save), :func:`load_checkpoint` (load/reshard),
:func:`app_state` / :func:`apply_app_state` (model + optimizer state that a fresh optimizer can load),
:class:`MemoryReplicator` (the peer memory tier: each rank's snapshot on another node's
:class:`ShardKeeper`, read back through :class:`~elastictrain.checkpoint.memory_dcp.SnapshotReader`).
Controller side: :class:`CheckpointStore` (commit, list, verify, resolve, retain).
CLI: the click group :data:`ckpt`.
"""

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import FileInfo, Manifest, ManifestError, ShardReport
from elastictrain.checkpoint.retention import retention_victims
from elastictrain.checkpoint.store import CheckpointStore

# Imported on first use: torch and DCP (the loader, the writer, the metadata reader), ray (the peer tier),
# click (the CLI). The store, manifests and retention need none of them (``elastictrain ckpt ls``/``verify``).
_LAZY = {
    "app_state": "loader", "apply_app_state": "loader", "load_checkpoint": "loader",
    "UnsafeMetadataError": "safe_metadata", "loads_metadata": "safe_metadata",
    "UnsafeBytesError": "safe_bytes", "loads_plain": "safe_bytes",
    "CheckpointWriter": "writer",
    "ShardKeeper": "memory", "MemoryReplicator": "memory", "KeeperState": "memory", "KeeperSource": "memory",
    "PutResult": "memory", "keeper_ring": "memory",
    "ckpt": "cli",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"elastictrain.checkpoint.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastictrain.checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriter",
    "FileInfo",
    "KeeperSource",
    "KeeperState",
    "Manifest",
    "ManifestError",
    "MemoryReplicator",
    "PutResult",
    "ShardKeeper",
    "ShardReport",
    "UnsafeBytesError",
    "UnsafeMetadataError",
    "app_state",
    "apply_app_state",
    "ckpt",
    "keeper_ring",
    "load_checkpoint",
    "loads_metadata",
    "loads_plain",
    "retention_victims",
]
