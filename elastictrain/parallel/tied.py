"""Tied weights split across pipeline stages: Megatron's embedding group.

A model whose input embedding and output head are one Parameter (Hugging Face GPT-2, Llama 3.2, the built-in
Llama with ``tie_embeddings``) puts the two uses on different stages under ``parallel.pp > 1``: the first
stage's rank holds the embedding, the last stage's rank a copy of the same weight for the head. The contract
that keeps the math the whole model's:

* **values**: every stage holding a use holds the tied tensor under ALL its names (:func:`alias_sources`
  registers the missing names on the :class:`~elastictrain.parallel.pipeline.StageSet`, never on a stage
  module), so the seeded init, a checkpoint, a peer snapshot or a survivor fill the copy by the same name as
  the embedding: the copy equals the embedding at start and after every restore or regroup. The training
  state has the keys a non-pipelined tied model has (the optimizer's by the first name, as
  ``named_parameters`` gives it), so a pp checkpoint resumes under ddp and vice versa; DCP writes the
  tensor, which the holders hold alike, once per key (replicated entries are deduplicated).
* **gradients**: after the schedule's backward, :meth:`TiedWeights.sync_grads` sums the tied gradient over
  the embedding group (the pp ranks holding a use, one group per data-parallel / tp coordinate), so every
  copy takes the whole model's gradient (the embedding's plus the head's) and the same update.
* **clipping and the digest**: only the first holder counts the tied gradient in the norm
  (:attr:`TiedWeights.uncounted` names the other copies), so the norm is the whole model's; likewise only
  its values count in the model's digest (:attr:`TiedWeights.uncounted_names`, on the StageSet).

One rank holding two stages with different uses (``zbv`` puts stages 0 and ``2 pp - 1`` on rank 0) is
refused: its two stage copies are separate modules there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class TiedSplitError(ValueError):
    """A tied weight split in a way this module cannot keep as one tensor; the message names the fix."""


@dataclass(frozen=True)
class TiedSplit:
    """One tied tensor whose uses fall on several pp ranks, as this (holding) rank sees it."""

    names: tuple[str, ...]  # every name of the tensor in the whole model, in its named_parameters order
    param: nn.Parameter  # this rank's copy
    first: bool  # this rank is the lowest pp coordinate holding a use: its copy counts in the norm
    group: Any  # the embedding group: the pp ranks (of this rank's pp group) holding a use


class TiedWeights:
    """This rank's split tied tensors (empty when none is split or this rank holds no use)."""

    def __init__(self, splits: list[TiedSplit]) -> None:
        self.splits = splits

    @property
    def uncounted(self) -> tuple[torch.Tensor, ...]:
        """The copies whose gradient another rank already counts in the clipping norm."""
        return tuple(s.param for s in self.splits if not s.first)

    @property
    def uncounted_names(self) -> frozenset[str]:
        """The names (all of each) of the copies another rank counts: a whole-model digest leaves them out
        here (parallel/digest.py counts each element once)."""
        return frozenset(n for s in self.splits if not s.first for n in s.names)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum each split tensor's gradient over its embedding group (in place, on the local shard of a
        DTensor gradient). Call after the schedule's backward and the gradients' own reductions, before
        clipping. Collective over each embedding group."""
        for s in self.splits:
            grad = s.param.grad
            if grad is None:  # a use without gradient contributes zero (the others still wait for it)
                grad = s.param.grad = torch.zeros_like(s.param)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=s.group)


def find_splits(ties: list[tuple[str, ...]], stage_modules: list[nn.Module], pp_group: Any) -> TiedWeights:
    """The tied tensors (``ties``: each tensor's names in the whole model, from
    :func:`~elastictrain.parallel.pipeline.tied_parameters`) whose uses fall on several ranks of
    ``pp_group``, with their embedding groups. Collective over ``pp_group`` when ``ties`` is not empty (one
    gather of which uses each rank holds); then a group per tensor among its holders only where they are
    not the whole pp group. Raises :class:`TiedSplitError` on every rank of ``pp_group`` when one rank
    holds two uses in two stages."""
    if not ties:
        return TiedWeights([])
    held: list[nn.Parameter | None] = []
    uses: list[int] = []  # per tensor: how many separate copies this rank's stages hold (0, 1, or 2+: refused)
    for names in ties:
        mine = {id(p): p for m in stage_modules for n, p in m.named_parameters(remove_duplicate=False) if n in names}
        held.append(next(iter(mine.values()), None))
        uses.append(len(mine))
    everyone: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, uses, group=pp_group)  # every rank decides alike, none left waiting
    for i, names in enumerate(ties):
        if any(u[i] > 1 for u in everyone):
            raise TiedSplitError(
                f"tied parameters {', '.join(map(repr, names))} fall in two pipeline stages of one rank (the "
                "schedule puts the first and the last stage together, e.g. zbv): pick another "
                "parallel.pp_schedule (1f1b, interleaved_1f1b) or untie the weights")
    me = dist.get_rank(pp_group)
    ranks = dist.get_process_group_ranks(pp_group)
    splits = []
    for i, names in enumerate(ties):
        holders = [c for c, u in enumerate(everyone) if u[i]]
        if len(holders) < 2 or held[i] is None:
            continue  # whole on one stage (an ordinary tie), or this rank holds no use
        group = pp_group if len(holders) == len(ranks) else dist.new_group(
            [ranks[c] for c in holders], use_local_synchronization=True)
        splits.append(TiedSplit(names, held[i], me == holders[0], group))
    return TiedWeights(splits)


def alias_sources(splits: TiedWeights, stage_modules: list[nn.Module], whole: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Two parameter-only module trees for the StageSet to merge before and after the stages: ``before``
    registers a split tensor's first name where this rank's stages lack it (so ``named_parameters`` names
    the copy as the whole model does, the optimizer state is keyed alike, and an init by module name,
    parallel/init.py, initialises it as the first name's module: the holder is a childless copy of
    ``whole``'s module there, of its class), ``after`` its other missing names. Both hold this rank's copy
    itself: no memory."""
    before, after = nn.Module(), nn.Module()
    local = {n for m in stage_modules for n, _ in m.named_parameters(remove_duplicate=False)}
    for s in splits.splits:
        for k, name in enumerate(s.names):
            if name not in local:
                _register(before if k == 0 else after, name, s.param, whole)
    return before, after


def _register(root: nn.Module, name: str, param: nn.Parameter, whole: nn.Module) -> None:
    *path, leaf = name.split(".")
    node = root
    for part in path[:-1]:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    if not path:
        node.register_parameter(leaf, param)
        return
    holder = copy.copy(whole.get_submodule(".".join(path)))  # its class, none of its children or buffers
    holder._modules, holder._buffers, holder._non_persistent_buffers_set = {}, {}, set()
    holder._parameters = {n: (param if n == leaf else None) for n in holder._parameters}
    node.add_module(path[-1], holder)
