"""Asynchronous sharded checkpoints (torch.distributed.checkpoint) with a manifest commit protocol.

Worker side: :class:`CheckpointWriter` (save), :func:`load_checkpoint` (load/reshard),
:func:`app_state` / :func:`apply_app_state` (model + optimizer state that a fresh optimizer can load),
:class:`MemoryReplicator` (the peer memory tier: each rank's snapshot on another node's
:class:`ShardKeeper`, read back through :class:`~elastictrain.checkpoint.memory_dcp.SnapshotReader`).
Controller side: :class:`CheckpointStore` (commit, list, verify, resolve, retain).
CLI: the click group :data:`ckpt`.
"""

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.loader import app_state, apply_app_state, load_checkpoint
from elastictrain.checkpoint.manifest import FileInfo, Manifest, ManifestError, ShardReport
from elastictrain.checkpoint.retention import retention_plan
from elastictrain.checkpoint.safe_metadata import UnsafeMetadataError, loads_metadata
from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.checkpoint.writer import CheckpointWriter


def __getattr__(name: str):  # ray and click are imported only by those who use them
    if name in ("ShardKeeper", "MemoryReplicator", "KeeperState", "KeeperSource", "PutResult", "keeper_ring"):
        from elastictrain.checkpoint import memory

        return getattr(memory, name)
    if name == "ckpt":
        from elastictrain.checkpoint.cli import ckpt

        return ckpt
    raise AttributeError(name)


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
    "UnsafeMetadataError",
    "app_state",
    "apply_app_state",
    "ckpt",
    "keeper_ring",
    "load_checkpoint",
    "loads_metadata",
    "retention_plan",
]
