"""Which virtual pipeline stages a pp rank holds, and how a model's repeated blocks split between stages.

Pure functions, no torch.distributed. The stage -> rank mapping follows torch 2.13's own convention
(``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping``): "loop" style for gpipe, 1f1b,
interleaved_1f1b and zero_bubble (stage ``v`` on rank ``v % pp``), "v" style for zbv (rank ``r`` holds stages
``r`` and ``2*pp - 1 - r``).
"""

from __future__ import annotations

from collections.abc import Sequence


class StageSplitError(ValueError):
    """A model that cannot be split into the asked number of stages; the message names the numbers."""


def stage_owner(schedule: str, pp: int, n_stages: int) -> dict[int, int]:
    """``{stage index: pp rank}`` for ``n_stages`` virtual stages on ``pp`` ranks under ``schedule``."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not divide over pp={pp} ranks")
    if schedule != "zbv":
        return {v: v % pp for v in range(n_stages)}
    owner = {}
    for v in range(n_stages):
        lap, pos = divmod(v, pp)
        owner[v] = pos if lap % 2 == 0 else pp - 1 - pos
    return owner


def local_stages(schedule: str, pp: int, n_stages: int, pp_rank: int) -> list[int]:
    """The stage indices pp rank ``pp_rank`` runs, ascending (the order the schedules expect)."""
    return [v for v, r in stage_owner(schedule, pp, n_stages).items() if r == pp_rank]


def block_ranges(n_blocks: int, n_stages: int, splits: Sequence[int] | None = None) -> list[range]:
    """The repeated blocks of each stage. Balanced by default (the first ``n_blocks % n_stages`` stages take
    one block more); ``splits`` = the index of the first block of stages 1.. (``n_stages - 1`` ascending
    numbers in ``1..n_blocks-1``). Every stage holds at least one block. Raises :class:`StageSplitError`."""
    if n_blocks < n_stages:
        raise StageSplitError(f"a model of {n_blocks} repeated blocks cannot fill {n_stages} pipeline stages "
                              f"(parallel.pp x stages_per_rank); use a model of >= {n_stages} blocks or fewer stages")
    if splits is None:
        per, extra = divmod(n_blocks, n_stages)
        bounds = [0]
        for v in range(n_stages):
            bounds.append(bounds[-1] + per + (1 if v < extra else 0))
    else:
        bounds = [0, *splits, n_blocks]
        if len(splits) != n_stages - 1 or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise StageSplitError(f"split points {list(splits)} do not cut {n_blocks} blocks into {n_stages} "
                                  f"non-empty stages: give {n_stages - 1} ascending block indices in 1..{n_blocks - 1}")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
