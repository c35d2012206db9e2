"""Initial parameter values as a pure function of (seed, module name): any rank initialises only its own.

A model that defines ``init_module(module)`` (the root model's method: give ``module``'s OWN parameters,
not its children's, their initial values from torch's default generator) is initialised module by module:
each module that holds parameters is initialised with the generator seeded by
:func:`module_seed` ``(train.seed, its fully qualified name)``. The values therefore do not depend on which
rank builds them, on the layout, or on which other modules the rank holds: a pipeline stage, a
tensor-parallel rank or an FSDP shard builds just its own modules, each at most one module's full size at a
time (one ``nn.Linear``), and every layout starts from identical parameters. The built-in GPT and Llama define it.

A mixture-of-experts layer (:class:`~elastictrain.models.moe.MoEFeedForward`) holds its experts stacked
``[E, ...]``, and expert parallelism gives each rank ``E / ep`` of them: its stacked parameters are
initialised expert by expert, expert ``j`` (all of its stacked tensors, one expert's size) under
:func:`expert_seed` ``(train.seed, layer name, j)``, so a rank computes only the experts it holds and the
values do not depend on ep (ep1's whole layer is the same experts side by side).

A model without ``init_module`` keeps the older rule (``torch.manual_seed(seed); model_fn()``, whose
values depend on the whole construction order); a sharded start then builds the whole model once per host
that needs values (see ``StepRunner.init_from_seed``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastictrain.models.gpt import _mix
from elastictrain.models.moe import MoEFeedForward
from elastictrain.parallel.digest import global_indices

# Wrapper segments that are not part of a parameter's name (activation checkpointing, torch.compile)
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


class InitError(ValueError):
    """``init_module`` left a parameter without a value; the message names it and the fix."""


def inits_by_name(root: nn.Module) -> bool:
    """Whether ``root`` (the whole model, meta or real) initialises itself module by module."""
    return callable(getattr(root, "init_module", None))


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module named ``name`` (its fully qualified name in the whole model)."""
    digest = hashlib.sha256(name.encode()).digest()
    return _mix(seed, int.from_bytes(digest[:8], "little"), 0x1217_5EED)


def expert_seed(seed: int, name: str, expert: int) -> int:
    """The generator seed of expert ``expert`` (global index) of the MoE layer named ``name``."""
    return module_seed(seed, f"{name}[expert {expert}]")


def canonical_name(name: str) -> str:
    """``name`` without wrapper segments (activation-checkpoint and compile wrappers)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def init_by_name(model: nn.Module, root: nn.Module, seed: int) -> None:
    """Give every parameter of ``model`` (whole, or this rank's part: stages, tp or fsdp shards; memory
    already allocated) its initial value: per module holding parameters, a full-size CPU copy of its own
    parameters is filled by ``root.init_module`` under :func:`module_seed`, and this rank keeps its slice
    (an MoE layer's stacked experts: one held expert at a time, under :func:`expert_seed`). No collective.
    The global RNG state is left as it was. A parameter reachable under two names (tied) is
    initialised once, under the first. Raises :class:`InitError` if ``init_module`` left a floating-point
    value unset (it is filled with NaN first)."""
    done: set[int] = set()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for raw, module in model.named_modules():
            name = canonical_name(raw)
            own = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in done}
            if not own:
                continue
            if isinstance(module, MoEFeedForward):
                _init_experts(module, own, root, seed, name)
            else:
                torch.manual_seed(module_seed(seed, name))
                full = _init_shadow(module, root, name, lambda p: tuple(p.shape))
                for n, p in own.items():
                    _keep_slice(p, full[n])
            done.update(id(p) for p in own.values())


def _init_shadow(module: nn.Module, root: nn.Module, name: str,
                 shape_of: Callable[[torch.Tensor], tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``root.init_module`` on a CPU copy of ``module`` holding only its own parameters, each of
    ``shape_of(parameter)`` (its full size, or one expert's), under the generator state set by the caller.
    Returns the values by parameter name. Raises :class:`InitError` for a value left unset (NaN)."""
    shadow = _same_class_copy(module)  # (isinstance checks in init_module hold), own params only
    shadow._modules = {}
    shadow._parameters = {n: None if p is None else nn.Parameter(_blank(p, shape_of(p)), requires_grad=p.requires_grad)
                          for n, p in module._parameters.items()}
    root.init_module(shadow)
    values = {}
    for n, full in shadow._parameters.items():
        if full is None:
            continue
        if full.is_floating_point() and bool(torch.isnan(full).any()):
            raise InitError(f"{type(root).__name__}.init_module left {name}.{n} without a value: set every "
                            f"parameter a module holds itself (e.g. call {type(module).__name__}"
                            ".reset_parameters()), or remove init_module to build the whole seeded model")
        values[n] = full.detach()
    return values


def _same_class_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` of its own class; an FSDP2-sharded module (a module holding parameters of
    its own that ``fully_shard`` wrapped: ep x fsdp's MoE layers and their routers) as its original class,
    since FSDP2's class re-runs ``__init__`` without arguments on a copy."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    shadow = cls.__new__(cls)
    shadow.__dict__.update(module.__dict__)
    return shadow


def _init_experts(module: MoEFeedForward, own: dict[str, torch.Tensor], root: nn.Module, seed: int,
                  name: str) -> None:
    """The stacked ``[E, ...]`` parameters of an MoE layer, one held expert at a time: expert ``j``'s values
    (every stacked tensor at one expert's size, ``init_module`` on a one-expert copy) under
    :func:`expert_seed`, copied into the rows of ``j`` this rank holds (its ep slice; FSDP's shard of it)."""
    held = sorted({j for p in own.values() for j in _experts_held(p)})
    for j in held:
        torch.manual_seed(expert_seed(seed, name, j))
        one = _init_shadow(module, root, name, lambda p: (1, *p.shape[1:]))
        for n, p in own.items():
            _keep_expert(p, j, one[n][0])


def _experts_held(p: torch.Tensor) -> list[int]:
    """The global expert indices (dim 0) of which this rank holds a part of ``p``."""
    if isinstance(p, DTensor):
        return global_indices(p)[0].tolist() if p.to_local().numel() else []
    return list(range(p.shape[0]))


def _blank(p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    fill = float("nan") if p.is_floating_point() else 0
    return torch.full(shape, fill, dtype=p.dtype)


def _keep_slice(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full value ``full`` into ``p`` (a DTensor: its local shard, strided
    2-D shards included)."""
    if isinstance(p, DTensor):
        local = p.to_local()
        if local.numel():
            part = full
            for d, index in enumerate(global_indices(p)):
                part = part.index_select(d, index)
            local.copy_(part.to(local.device))
        return
    p.copy_(full.to(p.device))


def _keep_expert(p: torch.Tensor, expert: int, value: torch.Tensor) -> None:
    """Copy this rank's part of expert ``expert``'s whole value ``value`` (``p.shape[1:]``) into the row of
    ``p`` (stacked ``[E, ...]``; a DTensor: its local shard) that holds it, if any."""
    if not isinstance(p, DTensor):
        p[expert].copy_(value.to(p.device))
        return
    local = p.to_local()
    index = global_indices(p)
    rows = (index[0] == expert).nonzero().flatten().tolist()
    if not rows or not local.numel():
        return
    part = value
    for d, along in enumerate(index[1:]):
        part = part.index_select(d, along)
    local[rows[0]].copy_(part.to(local.device))
