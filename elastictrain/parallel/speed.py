"""What a layout does to each repeated block before data parallelism, in torchtitan's order: float8 linears
(``parallel.float8``), activation checkpointing (``parallel.activation_checkpointing``: ``full`` or
``selective``), then ``torch.compile`` (``parallel.compile``); FSDP2 or DDP wraps the result
(:func:`elastictrain.parallel.parallelize.parallelize_dp`). Applied by :func:`apply_block_transforms` on a
whole model or on one pipeline stage, after tensor parallelism.

* **full** recomputation keeps each block's input and runs its forward again in backward
  (``checkpoint_wrapper``).
* **selective** is op-level (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs
  of the matrix multiplies (``aten.mm`` / ``addmm`` / ``bmm``), of scaled-dot-product attention and of
  reduce-scatters are saved, everything else (norms, activations, residual adds, reshapes) is recomputed.
  The recomputed ops are cheap elementwise ones, so a step costs about what it costs without
  checkpointing, for less memory (:func:`elastictrain.planner.memory.activation_bytes` prices it). The
  same kernels run on the same inputs, so the numbers equal a run without checkpointing.
* **compile**: each block's ``Module.compile(fullgraph=True)`` (state-dict names unchanged; no
  ``_orig_mod`` prefix). Compiling happens lazily, in the first step after each :meth:`attach`, which the
  step loop reports as that step's ``compile_s`` (elastictrain/worker/loop.py). A standby process
  compiles ahead (:func:`compile_ahead`): it applies the same transforms to its own model and runs one
  forward and backward of a micro-batch of the job's shape through it, so the replacement that takes it
  trains the blocks compiled there (a ddp layout keeps that very model) or hits torch's compile caches
  (in-process, and inductor's on-disk FX graph and AOTAutograd caches) for a rebuilt one.
* **float8**: ``torchao``'s rowwise recipe on the large ``nn.Linear`` s (:func:`float8_filter`); the output
  head and small or odd-shaped layers stay in high precision, and FSDP2 all-gathers the weights in their
  own (bf16/fp32) precision: the recipe casts to float8 inside the matmul only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from elastictrain.config import ParallelConfig

#: a linear whose dimensions are both at least this many elements is converted to float8 (smaller ones
#: spend more on the casts and scales than the float8 matmul saves)
FLOAT8_MIN_DIM = 1024
#: module names (the last part of the qualified name) of output heads: kept in high precision (the logits'
#: precision matters, and torchtitan leaves the head out too)
HEAD_NAMES = frozenset({"output", "head", "lm_head"})


class SpeedSetupError(RuntimeError):
    """A speed option that cannot run on this worker (float8 without a capable GPU or without torchao)."""


def float8_unavailable(device: torch.device) -> str | None:
    """Why ``parallel.float8`` cannot run on ``device`` (one line naming the fix), or None."""
    if device.type != "cuda":
        return (f"parallel.float8=true needs a CUDA GPU of compute capability >= 8.9; this worker runs on "
                f"{device.type}; set workers.use_gpu=true or parallel.float8=false")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"parallel.float8=true needs compute capability >= 8.9 (H100, L40S, ...); {name} has "
                f"{major}.{minor}; set parallel.float8=false")
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a torchao built for another torch
        return (f"parallel.float8=true needs torchao (pip install 'elastictrain[float8]'): import failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; set parallel.float8=false")
    return None


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``parallel.compile`` cannot run on ``device`` (one line naming the fix), or None: on CPU, inductor
    builds its kernels with a C++ compiler (``CXX``, else ``c++`` / ``g++`` / ``clang++`` on the PATH)."""
    import os
    import shutil

    if device.type != "cpu":
        return None
    names = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if any(n and shutil.which(n) for n in names):
        return None
    return ("parallel.compile=true on CPU needs a C++ compiler for inductor's kernels (none of c++, g++, "
            "clang++ is on this worker's PATH); install one (apt-get install g++) or set parallel.compile=false")


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Whether ``convert_to_float8_training`` converts this module: an ``nn.Linear`` whose dimensions are
    multiples of 16 (the float8 matmul's rule) and at least :data:`FLOAT8_MIN_DIM`, not an output head."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    dims = (module.in_features, module.out_features)
    return all(d % 16 == 0 and d >= FLOAT8_MIN_DIM for d in dims)


def apply_float8(model: nn.Module) -> int:
    """Swap the large linears for torchao's float8 ones (rowwise scaling). Returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)
    return before - sum(type(m) is nn.Linear for m in model.modules())


@functools.cache
def _saved_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_mm")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Recompute each repeated block in backward: ``full`` (the whole block) or ``selective`` (everything but
    the matmul, attention and reduce-scatter outputs). The block's forward must be deterministic: the
    built-in GPT's dropout draws from per-sample seeded generators, so it is. State-dict names are unchanged
    through torch.distributed.checkpoint.state_dict, which strips the wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    from elastictrain.parallel.parallelize import _is_block_list

    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    for parent in list(model.modules()):
        if _is_block_list(parent):
            for key, block in list(parent.named_children()):
                if not isinstance(block, CheckpointWrapper):  # a kept (DDP) model is re-parallelized
                    wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
                    if isinstance(parent, nn.ModuleList):
                        parent[int(key)] = wrapped
                    else:
                        parent[key] = wrapped


def apply_compile(model: nn.Module) -> int:
    """``compile(fullgraph=True)`` each repeated block in place (already compiled ones are left). Returns
    how many blocks were compiled."""
    from elastictrain.parallel.parallelize import repeated_blocks

    n = 0
    for block in repeated_blocks(model):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(fullgraph=True)
            n += 1
    return n


def compile_ahead(model: nn.Module, parallel: ParallelConfig, loss_fn: Any, batch: dict[str, torch.Tensor],
                  seeds: torch.Tensor) -> bool:
    """Compile ``model``'s blocks now rather than in the first step that trains them: apply the block
    transforms (:func:`apply_block_transforms`, idempotent: a later :func:`parallelize_dp` on this model
    leaves them) and run one forward and backward of ``batch`` through ``loss_fn`` (the task's:
    ``loss_fn(model, batch, seeds)``), under the autocast a ddp layout would use. Nothing of the model's
    numbers changes: gradients are dropped (``grad = None``) and the global RNG is restored. Returns False
    (and does nothing) when it cannot run here: ``parallel.compile`` off, float8 (converted once, at the
    layout), or a model whose parameters are on the meta device (``parallel.meta_init``)."""
    from elastictrain.parallel.precision import autocast, autocast_dtype

    params = list(model.parameters())
    if not parallel.compile or parallel.float8 or any(p.is_meta for p in params):
        return False
    apply_block_transforms(model, parallel)
    device = params[0].device if params else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast(autocast_dtype(parallel.mixed_precision, model), device):
            loss = loss_fn(model, batch, seeds)
        loss.float().sum().backward()
    for p in params:
        p.grad = None
    return True


@functools.cache
def compiled_per_sample_loss() -> Any:
    """:func:`elastictrain.models.gpt.per_sample_loss` through ``torch.compile(fullgraph=True)`` (one per
    process): inductor fuses the log-softmax into the loss and its backward, so backward keeps no
    ``(tokens, vocab)`` log-probabilities of its own (the built-in task's loss under ``parallel.compile``)."""
    from elastictrain.models.gpt import per_sample_loss

    return torch.compile(per_sample_loss, fullgraph=True)


def apply_block_transforms(model: nn.Module, parallel: ParallelConfig) -> None:
    """float8, activation checkpointing, compile, as ``parallel`` asks, in that order (module doc)."""
    if parallel.float8:
        apply_float8(model)
    if parallel.ac_mode != "none":
        apply_activation_checkpointing(model, parallel.ac_mode)
    if parallel.compile:
        apply_compile(model)
