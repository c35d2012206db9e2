"""Consolidate one checkpoint into a single ``torch.save`` or safetensors file."""

from __future__ import annotations

from typing import Any

import torch

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.loader import load_full


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.contiguous()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)


def export_state(step_uri: str, out: str, fmt: str, key: str | None, storage_options: dict[str, Any] | None) -> int:
    """Write ``key`` of the checkpoint at ``step_uri`` to ``out``; returns the number of tensors.

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
    state = load_full(step_uri, key, storage_options)
    flat: dict[str, torch.Tensor] = {}
    _flatten(state, "", flat)
    if fmt == "safetensors":
        save_file(flat, out)
    else:
        torch.save(state, out)
    return len(flat)
