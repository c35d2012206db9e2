"""Consolidate one checkpoint into a single ``torch.save`` or safetensors file."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.loader import checkpoint_dir, load_full
from elastictrain.checkpoint.manifest import Manifest


def _flatten(state: Any) -> dict[str, torch.Tensor]:
    """Tensor leaves of a nested state under dotted names (``torch.utils._pytree`` paths)."""
    pairs, _ = tree_flatten_with_path(state)
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf.contiguous()
            for path, leaf in pairs if isinstance(leaf, torch.Tensor)}


def export_state(manifest: Manifest, out: str, fmt: str, key: str | None, storage_options: dict[str, Any] | None) -> int:
    """Write ``key`` of the committed checkpoint ``manifest`` (as read from its step directory) to ``out``;
    returns the number of tensors. Only the files the manifest lists are read, each checked as it is read.

    safetensors keeps tensors only (flattened dotted names); raises CheckpointError when the
    ``safetensors`` package is not installed."""
    if fmt not in ("torch", "safetensors"):
        raise CheckpointError(f"export format {fmt!r} is not one of torch, safetensors")
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(
                "export --format safetensors needs the 'safetensors' package (pip install safetensors); "
                "or use --format torch"
            ) from None
    state = load_full(checkpoint_dir(manifest, None), manifest.data_files, key, storage_options)
    flat = _flatten(state)
    if fmt == "safetensors":
        save_file(flat, out)
    else:
        torch.save(state, out)
    return len(flat)
