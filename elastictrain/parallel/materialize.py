"""Build a model without its parameters' memory, shard it, then give the shards memory and values.

A sharded layout never needs the whole model on one rank: the parameters are created on the ``meta``
device (no storage), ``fully_shard`` cuts them, and :func:`materialize` allocates only this rank's shards.
Their values come from a restore step (a checkpoint, survivors, the peer tier) or, at step 0, from
:func:`elastictrain.parallel.init.init_by_name` (each rank its own modules, by name), or for a model without
``init_module`` from :func:`load_seeded_init`: rank 0 builds the seeded model once and broadcasts it tensor
by tensor. Either way every rank starts from exactly the values a non-meta build would have given it.

Buffers are not parameters: :func:`params_on_meta` leaves them real, because non-persistent buffers (causal
masks, rotary tables) are in no state dict, so no restore would bring them back. They are small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the ``meta`` device; buffers stay where they are made.
    Initialisation code in constructors runs on meta tensors (no work, no values)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter (whole or, after ``fully_shard``, this rank's shard) uninitialised memory
    on ``device``; buffers keep their values (moved to ``device``). Call after parallelizing, before
    building the optimizer.

    This is ``model.to_empty(device=device)`` for the parameters, without its DTensor dispatch:
    ``empty_like`` of a DTensor decides the output's sharding afresh for every parameter shape on a new mesh
    (DTensor's sharding caches are cleared per membership generation, see ``parallel.mesh``; the cost:
    docs/perf/2026-11-23-code-figures.md); the empty local shard is wrapped with the
    parameter's own mesh, placements, global shape and stride instead (what the dispatch decides for an
    elementwise op). FSDP2's ``_apply`` override then re-registers the sharded parameters as it does for
    ``to_empty``."""

    def fill(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t.to(device)
        if isinstance(t, DTensor):
            local = torch.empty_like(t.to_local(), device=device)
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.size(),
                                      stride=t.stride())
        return torch.empty_like(t, device=device)

    with torch.no_grad():
        model._apply(fill)  # what Module.to_empty calls, with ``fill`` for its function


def load_seeded_init(model: nn.Module, build: Callable[[], nn.Module], rank: int) -> None:
    """Fill ``model`` (parallelized, materialized) with the values of ``build()``, which rank 0 alone calls:
    each tensor is broadcast from rank 0 and every rank keeps its slice. Collective over the default
    group; ``build`` must seed itself (it is the same build a non-meta start uses)."""
    # here, not at the top: DCP is imported where a state is moved, not by every worker's start
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = build().state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
