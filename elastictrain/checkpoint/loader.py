"""Worker side load: a committed checkpoint into a (possibly different) number of ranks.

DCP reshards on load: the metadata records each tensor's global shape and chunks, every rank asks for what
its own state dict holds. For DDP (replicated tensors) that means every rank reads every tensor, whatever
world size wrote them. Nothing read runs code: only the files the manifest lists are read (each checked
against its size and SHA-256), ``.metadata`` goes through the restricted unpickler, non-tensor entries
through the plain-data loader (:mod:`.safe_bytes`), tensors through DCP's ``torch.load(weights_only=True)``.

Optimizer state: a fresh ``Adam`` has an empty ``state`` so a plain ``optimizer.state_dict()`` gives DCP
nothing to load into. :func:`app_state` uses ``get_state_dict``, which materialises the optimizer state and
keys it by parameter name (identical for a plain module and its DDP wrapper); :func:`apply_app_state` puts
the loaded values back with ``set_state_dict``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.dcp_io import SafeReader
from elastictrain.checkpoint.dcp_quiet import quiet_single_process_notice
from elastictrain.checkpoint.errors import CheckpointError, root_causes
from elastictrain.checkpoint.manifest import FileInfo, Manifest, step_dir_name
from elastictrain.checkpoint.safe_bytes import SafeFullLoadPlanner, SafeLoadPlanner


def _describe(exc: BaseException, uri: str, action: str) -> str:
    causes = root_causes(exc)
    for _, cause in causes:
        if isinstance(cause, CheckpointError):
            return str(cause)  # already says what and where (e.g. unsafe metadata)
    texts = [storage.describe_error(cause, uri, action) for _, cause in causes]
    return f"{action} checkpoint {uri} failed: " + "; ".join(texts)


def checkpoint_dir(manifest: Manifest, root_uri: str | None) -> str:
    """Where the DCP files of ``manifest`` are: its step directory (where it was read from, else
    ``<root_uri>/step_...``) plus the attempt directory it names (:attr:`Manifest.data_dir`)."""
    if manifest.location:
        step = manifest.location
    elif not root_uri:
        raise CheckpointError(f"manifest of step {manifest.step} has no location and no root_uri was given")
    else:
        step = storage.join(root_uri, step_dir_name(manifest.step))
    return storage.join(step, manifest.data_dir) if manifest.data_dir else step


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter names, for saving or as a load target.

    Works for a plain module, a DDP-wrapped one (the ``module.`` prefix is dropped) and an FSDP2 one
    (DTensor shards), and initialises the state of a fresh optimizer so that a load has tensors to fill.
    The one implementation is :func:`elastictrain.parallel.train_state.model_optim_state`.
    """
    from elastictrain.parallel.train_state import model_optim_state

    return model_optim_state(model, optimizer)


def apply_app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Load ``state`` (as built by :func:`app_state`, then filled by :func:`load_checkpoint`) into the
    live model and optimizer. Raises ``KeyError`` if ``state`` lacks ``"model"``."""
    from elastictrain.parallel.train_state import load_model_optim_state

    load_model_optim_state(model, optimizer, state)


def load_checkpoint(
    manifest: Manifest,
    root_uri: str | None,
    state: dict[str, Any],
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Fill ``state`` in place from the checkpoint of ``manifest`` (collective: every rank of
    ``process_group`` calls it). ``state`` keys absent from the checkpoint raise CheckpointError.

    Each file this rank reads is checked against the manifest's size and SHA-256 as it is read (a
    mismatch raises CheckpointError naming the file), so the driver needs to check sizes only.
    """
    uri = checkpoint_dir(manifest, root_uri)
    reader = SafeReader(uri, storage_options, expected=manifest.data_files)
    no_dist = process_group is None and not (dist.is_available() and dist.is_initialized())
    if no_dist:
        quiet_single_process_notice()  # one process on purpose: DCP's notice saying so is noise
    try:
        if no_dist:  # a refusal here is one line (inside dcp.load DCP logs a traceback); with a group DCP
            reader.read_metadata()  # gathers every rank's failure, so no rank is left waiting in a collective
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group,
                 no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps rank failures; name the URI
        raise CheckpointError(_describe(e, uri, "loading")) from None


def load_full(step_uri: str, expected: dict[str, FileInfo], key: str | None = "model",
              storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a whole checkpoint (or its ``key`` subtree) into one process as a nested dict of full CPU
    tensors, without a model to load into (consolidation/export). Single process, no collectives.
    ``expected`` is the manifest's files under ``step_uri`` (:attr:`Manifest.data_files`): only those are
    read, each checked against its size and SHA-256."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    planner = SafeFullLoadPlanner(keys={key} if key else None)
    reader = SafeReader(step_uri, storage_options, expected=expected)
    try:
        if key:
            entries = top_level_entries(reader.read_metadata())
            if key not in entries:  # asked before loading: the key filter would otherwise load nothing
                raise CheckpointError(f"checkpoint {step_uri} has no {key!r} entry; its entries are "
                                      f"{', '.join(entries) or 'none'}: pass one of them")
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(_describe(e, step_uri, "reading")) from None
    return state[key] if key else state


def top_level_entries(metadata: Any) -> list[str]:
    """The sorted top-level keys (``model``, ``optim``, ``progress``...) of a checkpoint's DCP metadata."""
    paths = (getattr(metadata, "planner_data", None) or {}).values()
    tops = {p[0] for p in paths if isinstance(p, tuple) and p}
    return sorted(tops or {str(fqn).split(".", 1)[0] for fqn in metadata.state_dict_metadata})
