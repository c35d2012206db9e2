"""``ckpt export --format hf``: a built-in Llama checkpoint as a Hugging Face model directory.

Writes ``config.json`` and the weights as safetensors under Hugging Face's names (the one table,
:mod:`elastictrain.models.hf_llama`): one ``model.safetensors`` when the weights fit in one file of at most
``shard_bytes``, else ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``, which
``transformers``' ``from_pretrained`` reads. The model's shape comes from the checkpoint's job fingerprint
(its ``task`` section: ``task.llama``, or for a run started with ``task.init_from`` that source's
``config.json``, which is then copied as it is, keeping its token ids).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import Manifest

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def check_out_dir(out: str) -> Path:
    """``out`` as a directory to write into: absent (created) or empty, and writable. Raises CheckpointError."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"--out {out}: exists and is not an empty directory; name a new directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--out {out}: cannot create it ({e.strerror}); name a writable place") from None
    if not os.access(path, os.W_OK):
        raise CheckpointError(f"--out {out}: not writable; name a writable place")
    return path


def llama_of(manifest: Manifest) -> tuple[Any, dict[str, Any] | None]:
    """(LlamaConfig, the source's config.json or None) of the built-in Llama a checkpoint was trained as.
    Raises CheckpointError when the checkpoint is not of a built-in Llama (or its source cannot be read)."""
    from elastictrain.config import ConfigError, TaskConfig
    from elastictrain.models.llama import LlamaConfig

    task = dict((manifest.meta.get("fingerprint") or {}).get("task") or {})
    if task.get("kind") != "llama":
        kind = task.get("kind", "a user task (task.kind: python)")
        raise CheckpointError(f"{manifest.location}: not a checkpoint of the built-in Llama (its job ran "
                              f"{kind}); --format hf exports task.kind: llama runs, use --format safetensors")
    task.pop("grad_clip", None)
    try:
        cfg = TaskConfig.model_validate(task)
        if cfg.init_from:
            from elastictrain.models.hf_init import llama_shape_from_source
            from elastictrain.models.hf_weights import read_source

            source = read_source(cfg.init_from, None)
            return LlamaConfig(**llama_shape_from_source(cfg, source)), dict(source.config)
        from elastictrain.task import _LlamaModel

        return _LlamaModel.of(cfg).config, None
    except (ConfigError, ValueError) as e:
        raise CheckpointError(f"{manifest.location}: the Llama's shape cannot be rebuilt from its job: {e}") from None


def to_hf_state(state: dict[str, torch.Tensor], cfg: Any, where: str) -> dict[str, torch.Tensor]:
    """Our full state dict under Hugging Face's names, checked against the shapes ``cfg`` gives (a tied
    model's head is the embedding: not written). Raises CheckpointError naming the tensor."""
    from elastictrain.models.hf_llama import expected_hf_shapes, hf_from_ours

    expected = expected_hf_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        hf = hf_from_ours(name)
        if hf is None or hf not in expected:
            raise CheckpointError(f"{where}: tensor {name} is not a weight of this Llama")
        if tuple(t.shape) != expected[hf]:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)}, the Llama of its job has "
                                  f"{list(expected[hf])}")
        out[hf] = t.detach().to("cpu").contiguous()
    missing = sorted(set(expected) - set(out))
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]} is missing from the checkpoint")
    return out


def _shards(hf: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in files of at most ``shard_bytes`` each (one tensor larger than that alone), in order."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf.items():
        n = t.numel() * t.element_size()
        if files[-1] and size + n > shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = t
        size += n
    return files


def write_hf(state: dict[str, torch.Tensor], cfg: Any, out: Path, source_config: dict[str, Any] | None,
             where: str, shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``state`` (our names, full tensors) to the Hugging Face directory ``out``; returns the number of
    tensors written."""
    from safetensors.torch import save_file

    from elastictrain.models.hf_llama import hf_config_from

    hf = to_hf_state(state, cfg, where)
    files = _shards(hf, shard_bytes)
    meta = {"format": "pt"}
    if len(files) == 1:
        save_file(files[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for i, part in enumerate(files, 1):
            name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
            save_file(part, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(part, name))
        total = sum(t.numel() * t.element_size() for t in hf.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    config = dict(source_config) if source_config else hf_config_from(cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return len(hf)
