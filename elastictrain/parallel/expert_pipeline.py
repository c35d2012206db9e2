"""Mixture-of-experts layers inside pipeline stages (``task.model.moe`` with ``parallel.pp > 1``, and ep x pp).

Three things a pipeline changes for an MoE model; this module owns them, :mod:`elastictrain.parallel.pipeline`
only calls it.

* The load-balancing loss. Without pp the task's loss adds each MoE layer's per-sample auxiliary loss to the
  sample's loss (elastictrain/task.py ``_gpt_loss``). Under pp only the last stage computes a loss, and the
  MoE layers of the earlier stages are on other ranks. :class:`MoEStage` wraps a stage's forward: after it,
  the stage's auxiliary losses (``[B]`` per layer, :func:`~elastictrain.models.moe.moe_aux_loss`) are
  attached to the stage's output by :class:`_AuxGrad`, an identity in forward whose backward also gives the
  auxiliary sum its gradient ``scale`` (the micro-batch loss's ``D / G``; Megatron-LM's MoEAuxLossAutoScaler
  idea). So the stage's backward -- whatever the schedule calls it with, the output's gradient or the loss --
  differentiates ``scale * (sum(per-sample loss) + sum(aux))`` exactly as one process does, the aux's
  gradient flowing through the router into this stage's inputs and so on to the earlier stages. The aux
  VALUES join the (loss, stop) word from the stage that computed them: every stage adds its detached
  auxiliary sum to the rank's loss sum, the last stage its cross-entropy, and the word sums the world, so
  the step's loss is the one-process loss (per sample: cross-entropy + every layer's aux). Nothing depends
  on pp, the split, the schedule or ep (a sample's aux is computed from its own tokens, before dispatch).
* Expert parallel inside a stage: the experts of a stage's MoE layers are sharded over that stage's expert
  ranks, ``D x cp x tp = edp x ep`` per pipeline coordinate (:meth:`~elastictrain.parallel.dims.MeshDims.ep_group_ranks`
  never crosses a pp coordinate; under cp and tp an ep group borrows those ranks as without pp).
  :func:`ep_stage_mesh` is the ``(stage, edp, ep)`` DeviceMesh (``(stage, dp_replicate, efsdp, ep)`` under
  hsdp): its ``ep`` submesh the all-to-all group of this rank (a process group per (pp coordinate, edp
  coordinate)), its ``edp`` submesh (hsdp: ``(dp_replicate, efsdp)``) the ranks of the same stage holding
  the same experts. Gradients: the stage's dense parameters averaged over the stage's dp x cp group as
  without ep; the experts left out of that average and reduced by
  :meth:`~elastictrain.parallel.expert_wiring.ExpertParallel.reduce_grads` (sum over ``edp``, times
  ``1 / (D x cp)``), or by FSDP's reduce-scatter over ``edp`` under ``fsdp`` stages (HSDP under ``hsdp``).
* The router's token counts: the stages' forwards run inside the schedule, not where the step loop's
  per-micro-batch hook fires, so :class:`StageTokenTally` collects them in :class:`MoEStage`; its
  :meth:`~StageTokenTally.total` sums over the world with every MoE layer of the WHOLE model (zeros for the
  layers of other stages), so every rank all-reduces the same shape, and divides by tp (a stage's tp ranks
  each hold their group's counts).

torch's first-step metadata inference runs each stage's forward once more (on the first micro-batch, or on
uninitialised inputs on later stages): :class:`MoEStage` counts neither its auxiliary loss nor its tokens then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from elastictrain.models.moe import moe_aux_loss, moe_layers, moe_token_counts
from elastictrain.parallel.dims import MeshDims
from elastictrain.parallel.expert import step_token_counts
from elastictrain.parallel.expert_wiring import ExpertParallel, ep_mesh_layout

__all__ = ["MoEStage", "StageTokenTally", "ep_stage_mesh", "ep_stage_mesh_blocks", "expert_parameters",
           "stage_expert_parallel"]


class _AuxGrad(torch.autograd.Function):
    """``x``'s values in forward; in backward ``x``'s gradient passes through and ``aux`` (a scalar: the
    stage's auxiliary losses summed, times the micro-batch's loss scale) gets gradient 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, copy: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.aux_meta = (aux.dtype, aux.device)
        # ``copy`` (a stage before the last): torch's split backward (zero-bubble schedules) detaches such a
        # stage's outputs in place, which a view refuses; the stage module's own output is freed once nothing
        # else holds it. The last stage's output (the logits) only reaches the loss: a view, no copy.
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dtype, device = ctx.aux_meta
        return grad, torch.ones((), dtype=dtype, device=device), None


@dataclass
class StageTokenTally:
    """One step's token slots per expert of this rank's stages, padded to every MoE layer of the whole
    model (``layers``: name -> experts), so every rank of the world all-reduces the same tensor."""

    layers: dict[str, int]
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def reset(self) -> None:
        self.parts = []

    def add(self, module: nn.Module) -> None:
        self.parts.append(dict(moe_token_counts(module)))

    def total(self, group: dist.ProcessGroup | None, device: torch.device, copies: int = 1
              ) -> dict[str, list[int]] | None:
        """``{layer: [slots per expert]}`` summed over ``group`` (every rank of it calls this, each stage's
        layers counted by their stage's ranks), None when the model has no MoE layer. ``copies``: how many
        ranks of ``group`` hold each count (ep x tp: a stage's tp ranks, whose layers sum it over tp),
        divided out."""
        if not self.layers:
            return None
        padded = [{n: part.get(n, torch.zeros(e, dtype=torch.int64, device=device)).to(device)
                   for n, e in self.layers.items()} for part in self.parts or [{}]]
        got = step_token_counts(padded, group)
        return got if copies == 1 else {n: [c // copies for c in v] for n, v in got.items()}


class MoEStage(nn.Module):
    """What ``PipelineStage`` runs for a stage module with MoE layers: ``run`` (the stage module, or its
    autocast wrapper) then the stage's auxiliary losses attached to the output (module doc). ``module``:
    the stage module itself (its MoE layers hold the last forward's aux losses and token counts); ``loss``:
    the pipeline's loss object (``scale``, ``loss_sum``: the micro-batch loss scale, the rank's loss sum);
    ``clock.inferring``: inside torch's metadata inference (nothing counted); ``last``: the pipeline's last
    stage (its output is not copied, see :class:`_AuxGrad`)."""

    def __init__(self, run: nn.Module, module: nn.Module, loss: Any, clock: Any, tally: StageTokenTally,
                 last: bool) -> None:
        super().__init__()
        self.run, self.last = run, last
        self._module = [module]  # (not a child: the parameters' names stay the stage module's)
        self._loss, self._clock, self._tally = loss, clock, tally

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.run(*args, **kwargs)
        module = self._module[0]
        aux = moe_aux_loss(module) if module.training else None
        if aux is None:
            return out
        total = aux.float().sum()
        if not self._clock.inferring:
            self._loss.loss_sum += total.detach().double()
            self._tally.add(module)
        if isinstance(out, torch.Tensor):
            return _AuxGrad.apply(out, total * self._loss.scale, not self.last)
        # several outputs (a user's stage): the first one carries the stage's auxiliary gradient
        first = next(i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.requires_grad)
        return type(out)(_AuxGrad.apply(t, total * self._loss.scale, not self.last) if i == first else t
                         for i, t in enumerate(out))


def expert_parameters(module: nn.Module) -> set[int]:
    """The ids of ``module``'s expert parameters (sharded by ep: left out of the stage's dp average)."""
    return {id(getattr(layer, p)) for layer in moe_layers(module).values() for p in layer.expert_names}


def ep_stage_mesh_blocks(dims: MeshDims) -> list:
    """The ``(stage, edp, ep)`` mesh as nested lists of ranks (under hsdp ``(stage, dp_replicate, efsdp,
    ep)``): one block per pipeline coordinate, in it one row per ep group (ranks that exchange tokens,
    :meth:`MeshDims.ep_group_ranks`: a stage's expert ranks ``dp x cp x tp`` factored as ``edp x ep``),
    column ``j`` the ranks of ep coordinate ``j`` (expert replicas). :func:`ep_mesh_layout`'s, with ``pp > 1``."""
    return ep_mesh_layout(dims)[0]


def ep_stage_mesh(dims: MeshDims, device: torch.device) -> DeviceMesh:
    """The ``(stage, edp, ep)`` DeviceMesh of :func:`ep_stage_mesh_blocks` (``(stage, dp_replicate, efsdp,
    ep)`` under hsdp). Collective over the default group (every rank calls it, in the same order relative
    to other group creations)."""
    blocks, names = ep_mesh_layout(dims)
    return DeviceMesh(device.type, torch.tensor(blocks, dtype=torch.int), mesh_dim_names=names)


def stage_expert_parallel(dims: MeshDims, device: torch.device) -> ExpertParallel | None:
    """ep x pp's wiring for a generation (None when ``dims.ep == 1``): the ``(stage, edp, ep)`` mesh
    (collective: :func:`ep_stage_mesh`), the expert gradient scale ``1 / (D x cp)`` (D: a stage's data
    ranks; the mean over the ranks a stage's dense gradients are averaged over, as without pp) and whether
    FSDP/HSDP stages reduce the expert gradients. The pipeline shards each stage's experts over
    ``mesh["ep"]`` (:func:`elastictrain.parallel.pipeline.build_pipeline`'s ``ep_mesh``)."""
    if dims.ep == 1:
        return None
    return ExpertParallel(ep_stage_mesh(dims, device), 1.0 / (dims.dp * dims.cp), dims.plan in ("fsdp", "hsdp"))
