"""bf16 compute for layouts without FSDP: ``parallel.mixed_precision: bf16`` under plan ``ddp`` (with or
without ``pp``/``tp``).

FSDP2 casts its parameters itself (``MixedPrecisionPolicy``, :func:`~elastictrain.parallel.parallelize.
parallelize_fsdp`). Every other layout keeps fp32 parameters, fp32 gradients (so DDP's and the tp/pp
gradient averages reduce in fp32) and fp32 optimizer state, and computes the forward under
``torch.autocast(device, torch.bfloat16)``, torch's mixed-precision recipe: matmuls and attention in bf16,
what autocast keeps in fp32 in fp32 (``cross_entropy`` on CPU and CUDA; softmax and the norms on CUDA).
Autograd keeps each micro-batch's bf16 casts of the weights for its backward: 2 bytes per parameter per
micro-batch in flight (planner/memory.py prices it).

* Without pp the step loop runs the task's whole ``loss_fn(module, batch, seeds)`` under :func:`autocast`
  (forward and loss, as torch's AMP examples do) and takes its per-sample losses as fp32.
* Under pp each stage's forward runs inside :class:`AutocastStage`, which also makes the stage's floating
  outputs fp32: activations cross stages, and the last stage's output reaches ``Task.pipeline.loss_fn``, in
  fp32, so the loss is computed in fp32 outside autocast. (An fp32 copy of a bf16 value is exact.)

bf16 has no need of a loss scaler (its exponent range is fp32's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils import _pytree as pytree


def autocast_dtype(mixed_precision: str, module: nn.Module) -> torch.dtype | None:
    """The dtype to autocast ``module``'s forward to, or None: bf16 when ``mixed_precision`` is ``bf16`` and no
    part of ``module`` is FSDP2-sharded (FSDP2's own policy casts those parameters; its layouts keep it)."""
    if mixed_precision != "bf16":
        return None
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return None
    return torch.bfloat16


@contextlib.contextmanager
def autocast(dtype: torch.dtype | None, device: torch.device) -> Iterator[None]:
    """``torch.autocast(device.type, dtype)`` when ``dtype`` is set; nothing otherwise."""
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def to_fp32(value: Any) -> Any:
    """``value`` with every floating tensor in it (a pytree) made fp32; other leaves as they are."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, value)


class AutocastStage(nn.Module):
    """A pipeline stage module whose forward runs under :func:`autocast` and returns fp32 floating outputs
    (see the module doc). What ``PipelineStage`` runs; the stage module itself stays what the optimizer,
    the training state and the digest see (the wrapper's own parameter names are never used)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.device = device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self.dtype, self.device):
            out = self.module(*args, **kwargs)
        return to_fp32(out)
