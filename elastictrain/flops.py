"""Model FLOPs utilisation: a model's FLOPs per token and a device's peak, for step events and benchmarks.

``flops_per_token = 6 N + 12 L d T`` (torchtitan's formula, after Kaplan et al. and PaLM's appendix B):
``N`` the weights of the matrix multiplies (every ``nn.Linear``'s weight, the output head included, a tied
head too; embeddings excluded: a lookup is no matmul), 6 for forward (2) and backward (4) per weight per
token; ``12 L d T`` the attention scores and the weighted values (``L`` blocks, ``d`` the attention width
= heads x head dim, ``T`` the sequence length), forward and backward. Recomputation (activation
checkpointing) is not counted: MFU counts the model's FLOPs, not the hardware's.

MFU = flops_per_token x tokens/s / (devices x peak). The peak is the device's dense bf16 figure from
:mod:`elastictrain.devices` (datasheets, without sparsity), or on CPU the FLOP/s that
``elastictrain plan --calibrate`` measured (``parallel.calibration``'s ``flops``); unknown: no MFU.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``): the one device table,
    :mod:`elastictrain.devices`; None if it does not know the GPU."""
    from elastictrain.devices import lookup

    device = lookup(device_name)
    return device.bf16_flops if device is not None else None


def device_peak_flops(device: Any) -> float | None:
    """The peak of a ``torch.device``: the table for a CUDA GPU; None on CPU (the calibration knows it)."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def flops_per_token(matmul_params: float, layers: int, attention_width: int, seq_len: int) -> float:
    """``6 N + 12 L d T`` (module doc)."""
    return 6.0 * matmul_params + 12.0 * layers * attention_width * seq_len


def matmul_params(model: nn.Module) -> int:
    """Weights of every ``nn.Linear`` (a module used twice, or a tied weight, counted per use as a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def attention_width(model: nn.Module) -> int | None:
    """Heads x head dim of a known model shape: the built-in GPT (``cfg.d_model``), the built-in Llama
    (``cfg.dim``), a Hugging Face model (``config.hidden_size`` / ``n_embd``); None if unknown."""
    for holder in ("cfg", "config"):
        cfg = getattr(model, holder, None)
        for name in ("d_model", "dim", "hidden_size", "n_embd"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def model_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """FLOPs per token of training ``model`` (whole, before parallelizing; meta parameters are fine) at
    ``seq_len``; None when its attention width is unknown."""
    from elastictrain.parallel.parallelize import repeated_blocks

    width = attention_width(model)
    if width is None:
        return None
    return flops_per_token(matmul_params(model), len(repeated_blocks(model)), width, seq_len)


def mfu(flops_per_token_: float | None, tokens_per_s: float, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a FLOPs figure or a peak)."""
    if not flops_per_token_ or not peak or devices < 1:
        return None
    return flops_per_token_ * tokens_per_s / (devices * peak)
