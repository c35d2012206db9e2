"""The final model, written by the workers themselves: each rank saves its own part through DCP.

At the end of a run no rank gathers the whole model and nothing of it passes through the driver: every
member writes the parameters it holds (DTensor shards, its pipeline stages, or -- replicated -- one copy,
DCP keeps one of the duplicates) into ``<root>/step_<N>/`` through the checkpoint's own
:class:`~elastictrain.checkpoint.dcp_io.HashingWriter` (one file per rank, each file's size and SHA-256
recorded as written), and returns a :class:`ShardReport` (file names and hashes only). The driver then
commits ``manifest.json`` there with :meth:`CheckpointStore.commit`, so ``<root>`` is a checkpoint run root
like any other: ``elastictrain ckpt verify|show|export <root>`` read it, and :func:`load_final_model` loads
it into one process as a plain state dict (tests, ``ckpt export``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.dcp_io import HashingFileSystem, HashingWriter
from elastictrain.checkpoint.manifest import ShardReport, step_dir_name


def write_final_model(model_state: dict[str, torch.Tensor], step: int, rank: int, root_uri: str,
                      storage_options: dict[str, Any] | None = None) -> ShardReport:
    """Save ``{"model": model_state}`` (this rank's part, as ``get_model_state_dict`` gives it) into
    ``<root_uri>/step_<step>/``. Collective over the default process group (DCP's plan exchange: names and
    shapes, no tensor data). Raises what DCP raises."""
    t0 = time.perf_counter()
    fs, root = storage.open_fs(root_uri, storage_options)
    name = step_dir_name(step)
    hfs = HashingFileSystem(fs, storage.join(root, name), storage.join(root_uri, name))
    try:
        writer = HashingWriter(hfs)
        dcp.save({"model": model_state}, storage_writer=writer)
        files = writer.written
    finally:
        hfs.close()
    return ShardReport(step, rank, files, None, 0.0, time.perf_counter() - t0)


def load_final_model(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The model of the newest committed checkpoint under ``uri`` (a run root such as ``RUN_DIR/final_model``,
    or one ``step_...`` directory) as ``{name: full CPU tensor}`` in this process; files checked against
    the manifest as they are read. Raises CheckpointError."""
    from elastictrain.checkpoint.errors import CheckpointError
    from elastictrain.checkpoint.loader import checkpoint_dir, load_full
    from elastictrain.checkpoint.manifest import parse_step_dir
    from elastictrain.checkpoint.store import CheckpointStore

    uri = uri.rstrip("/")
    parent, _, last = uri.rpartition("/")
    step = parse_step_dir(last)
    store = CheckpointStore(parent if step is not None else uri, storage_options)
    if step is None:
        found = store.committed()
        if not found:
            raise CheckpointError(f"{uri}: no committed model here")
        manifest = found[-1]
    else:
        manifest = store.read_manifest(step)
    return load_full(checkpoint_dir(manifest, None), manifest.data_files, "model", storage_options)
