"""Optimizer steps and gradient clipping on the local shards of DTensor parameters.

Under fsdp/hsdp the parameters, their gradients and the optimizer state are DTensors. torch.optim's
elementwise optimizers (:data:`ELEMENTWISE`: each element's update reads only the same element of the
parameter, its gradient and its state, plus per-parameter scalars such as the step count) do the same
arithmetic on each rank's local shard as on the DTensor, whose elementwise ops run on the local shards
anyway. :func:`step` therefore runs them on the local tensors (same storage, so the DTensors see every
update): the result is bitwise the same, without a DTensor dispatch per optimizer op per parameter. The
first step of every membership generation is where that dispatch costs most (its mesh is new, so every op
decides its sharding afresh; docs/perf/2026-11-23-code-figures.md); later
steps pay the dispatch only. Any other optimizer (one that reduces over a parameter, keeps factored state,
or is not torch.optim's) steps on the DTensors as they are.

:func:`clip_grad_norm` clips by the global 2-norm the same way: each rank sums the squares of its local
gradient shards, one all-reduce per set of sharded mesh dimensions adds them up (replicated dimensions hold
the same values and are not added), and every local shard is scaled. torch's DTensor clipping computes the
same norm (in another order of fp32 sums) through one DTensor op per gradient, which after a re-mesh costs
each op its sharding decision (docs/perf/2026-11-23-code-figures.md).

:func:`init_state` gives a fresh optimizer its state tensors without changing a parameter, the way
``torch.distributed.checkpoint.state_dict`` prepares one before a load (a ``step()`` with zero gradients
and lr 0), through the same local step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

# FSDP2's shard of a dimension tensor parallelism already shards (FSDP2 + TP) is a _StridedShard, which in
# torch 2.13 is no Shard subclass; each element still lives on one rank of that mesh dimension
_SHARD_TYPES: tuple[type, ...] = (Shard,)
try:
    from torch.distributed.tensor.placement_types import _StridedShard

    _SHARD_TYPES = (Shard, _StridedShard)
except ImportError:  # a torch without it
    pass


def _is_shard(placement: Any) -> bool:
    return isinstance(placement, _SHARD_TYPES)


ELEMENTWISE = frozenset({"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SGD", "Adagrad", "RMSprop", "Adadelta",
                         "ASGD", "Rprop"})
"""torch.optim classes whose state is elementwise per parameter (tensors shaped like it, or 0-d scalars)."""


def on_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`step` runs ``optimizer`` on local shards: one of torch.optim's :data:`ELEMENTWISE`
    classes (not a subclass: it may change the arithmetic) over at least one DTensor parameter."""
    cls = type(optimizer)
    if cls.__name__ not in ELEMENTWISE or getattr(torch.optim, cls.__name__, None) is not cls:
        return False
    return any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``; on the DTensor parameters' local shards where :func:`on_shards`."""
    if on_shards(optimizer):
        _local_step(optimizer, zero_grads=False)
    else:
        optimizer.step()


def init_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create a fresh optimizer's state (as one ``step()`` with zero gradients and lr 0 does) on local
    shards, leaving every parameter unchanged. Returns False, doing nothing, where it does not apply: the
    state exists, a gradient is set (torch's own preparation stops there too), or not :func:`on_shards`."""
    if optimizer.state or not on_shards(optimizer):
        return False
    if any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return False
    _local_step(optimizer, zero_grads=True)
    return True


@torch.no_grad()
def _local_step(optimizer: torch.optim.Optimizer, zero_grads: bool) -> None:
    """One ``optimizer.step()`` over stand-ins: each DTensor parameter's local tensor (gradient: the local
    tensor of its gradient; state: the local tensors of its state), then the state it created or replaced
    put back under the parameter, as DTensors with the parameter's layout."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    local = {p: p.to_local() if isinstance(p, DTensor) else p for p in params}
    views: dict[int, Any] = {}  # id(local view) -> the state DTensor it views (kept as is after the step)

    def stand_in(v: Any) -> Any:
        if isinstance(v, DTensor):
            lv = v.to_local()
            views[id(lv)] = v
            return lv
        return v

    state = optimizer.state
    stand_state = defaultdict(dict, {local[p]: {k: stand_in(v) for k, v in state[p].items()}
                                     for p in params if p in state})
    saved = [(g["params"], g.get("lr")) for g in groups]
    grads = {}
    for p in params:
        g = torch.zeros_like(local[p]) if zero_grads and p.requires_grad else p.grad
        grads[p] = g.to_local() if isinstance(g, DTensor) else g
    graded = [p for p in params if zero_grads or local[p] is not p]  # a plain parameter has its own .grad
    try:
        for g in groups:
            g["params"] = [local[p] for p in g["params"]]
            if zero_grads and "lr" in g:  # some optimizers move parameters whatever the gradient
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in graded:
            local[p].grad = grads[p]
        optimizer.state = stand_state
        optimizer.step()
    finally:
        optimizer.state = state
        for g, (ps, lr) in zip(groups, saved):
            g["params"] = ps
            if lr is not None:
                g["lr"] = lr
        for p in graded:
            local[p].grad = None
    for p in params:
        new = stand_state.get(local[p])
        if new:
            state[p] = {k: _put_back(p, local[p], v, views) for k, v in new.items()}


def _put_back(param: torch.Tensor, shard: torch.Tensor, value: Any, views: dict[int, Any]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) in views:
        return views[id(value)]
    if not isinstance(param, DTensor) or value.dim() == 0:
        return value
    if value.shape != shard.shape:
        raise RuntimeError(f"{type(value).__name__} state of shape {tuple(value.shape)} for a shard of shape "
                           f"{tuple(shard.shape)}: not an elementwise optimizer")
    return DTensor(value, param._spec, requires_grad=False)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, foreach: bool | None = None,
                   across: Any = None, uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global 2-norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_``); returns the norm before clipping. DTensor gradients placed only
    by ``Shard``/``Replicate`` are clipped on their local shards (see the module doc); any other mix goes
    to torch's own function; plain gradients beside DTensor ones count as replicated (tensor parallelism).
    Collective over the sharded mesh dimensions. ``across``: a process group whose
    ranks hold the OTHER parameters of the model (pipeline stages: the pp group); the squared norms are
    summed over it too, so every stage clips by the norm of all parameters. ``uncounted``: parameters of
    ``params`` whose gradients another rank of ``across`` counts (a tied weight's copy): clipped, not counted."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p.grad) for p in uncounted if p.grad is not None}
    local_ok = all(not isinstance(g, DTensor) or all(_is_shard(pl) or isinstance(pl, Replicate) for pl in g.placements)
                   for g in grads)
    # plain gradients beside DTensor ones (tensor parallelism: a parameter no tp style touched) are
    # replicated over the mesh: counted once, as the replicated dims of a DTensor
    if across is None and (not grads or not local_ok or not any(isinstance(g, DTensor) for g in grads)):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
    if not local_ok:
        raise ValueError("gradient clipping across pipeline stages needs plain or Shard/Replicate DTensor "
                         "gradients")
    by_dims: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = defaultdict(list)
    counted: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if _is_shard(pl))
            key: tuple[Any, tuple[int, ...]] = (g.device_mesh, dims)
            local = g.to_local()
        else:
            key, local = (None, ()), g
        by_dims[key].append(local)
        if id(g) not in skip:
            counted[key].append(local)
    total_sq = None
    for (mesh, dims) in by_dims:  # mesh None: plain (replicated) gradients
        shards = counted[(mesh, dims)]
        if not shards:  # the reduction over the mesh's dims still runs: every rank of them sums alike
            shards = [torch.zeros((), device=by_dims[(mesh, dims)][0].device)]
        norms = torch._foreach_norm(shards, 2) if foreach else [torch.linalg.vector_norm(t, 2) for t in shards]
        sq = torch.linalg.vector_norm(torch.stack(norms), 2) ** 2
        for d in dims:  # a sum over each sharded dimension in turn: a sum over all their ranks
            dist.all_reduce(sq, group=mesh.get_group(d))
        total_sq = sq if total_sq is None else total_sq + sq
    if across is not None:
        if total_sq is None:  # a rank without gradients (cannot happen for a stage, but sum a zero anyway)
            total_sq = torch.zeros((), device=params[0].device if params else "cpu")
        dist.all_reduce(total_sq, group=across)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    shards = [t for ts in by_dims.values() for t in ts]
    if not shards:
        return total
    if foreach:
        torch._foreach_mul_(shards, coef.to(shards[0].device))
    else:
        for t in shards:
            t.mul_(coef.to(t.device))
    return total
