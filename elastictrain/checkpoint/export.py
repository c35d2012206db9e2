"""Consolidate one checkpoint into a single ``torch.save`` or safetensors file, or a Hugging Face model
directory (``hf``, a built-in Llama: :mod:`elastictrain.checkpoint.export_hf`)."""

from __future__ import annotations

from pathlib import Path
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
    ``safetensors`` package is not installed. ``hf``: ``out`` is a new (or empty) directory that receives
    config.json and the weights under Hugging Face's names (``key`` must be ``model``)."""
    if fmt not in ("torch", "safetensors", "hf"):
        raise CheckpointError(f"export format {fmt!r} is not one of torch, safetensors, hf")
    if fmt == "hf":
        from elastictrain.checkpoint.export_hf import check_out_dir, llama_of, write_hf

        if key != "model":
            raise CheckpointError(f"--format hf exports the model (--key model), not {key!r}")
        cfg, source_config = llama_of(manifest)
        path = check_out_dir(out)
        state = load_full(checkpoint_dir(manifest, None), manifest.data_files, key, storage_options)
        return write_hf(_flatten(state), cfg, path, source_config, manifest.location)
    if Path(out).is_dir():
        raise CheckpointError(f"--out {out}: is a directory; --format {fmt} writes one file")
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
