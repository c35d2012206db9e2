"""The global sample cursor: which sample ids a (step, rank, world size, micro-batch) sees.

Pure functions only: no torch.distributed, no Ray, no clocks. Contract (see docs/design.md):

* ``G`` = global batch, ``m`` = micro batch, ``W`` = world size; a layout is valid iff
  ``G % (W * m) == 0`` and then ``accum = G // (W * m)``.
* Step ``s`` consumes the global positions ``[s*G, (s+1)*G)``.
* Position ``p`` maps to sample id ``epoch_permutation(seed, p // N, N)[p % N]``.
* Rank ``r``, micro-batch ``k`` (``0 <= k < accum``) takes positions
  ``s*G + (k*W + r)*m ... + m``.

So the set of ids a step sees depends only on ``(step, G, seed, N)``, never on ``W`` or ``m``: a job
can resume at another world size without skipping or repeating a sample.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

__all__ = [
    "CursorError",
    "CursorState",
    "check_layout",
    "epoch_permutation",
    "micro_batch_positions",
    "rank_micro_batches",
    "sample_ids",
    "eval_sample_ids",
    "step_sample_ids",
    "valid_world_sizes",
]

# How many world sizes an error message lists; enough for any cluster we plan for, short enough to read.
_LISTED_WORLD_SIZES = 64


class CursorError(ValueError):
    """An invalid data layout or an incompatible cursor state; the message names the values and the fix."""


def _check_int(name: str, value: int, minimum: int) -> None:
    # bool is an int subclass; True as a batch size is always a bug.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CursorError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise CursorError(f"{name} must be >= {minimum}, got {value}")


def valid_world_sizes(global_batch: int, micro_batch: int, max_world: int) -> list[int]:
    """All world sizes ``W`` in ``1..max_world`` with ``global_batch % (W * micro_batch) == 0``.

    Raises CursorError if any argument is not a positive int.
    """
    _check_int("global_batch", global_batch, 1)
    _check_int("micro_batch", micro_batch, 1)
    _check_int("max_world", max_world, 1)
    return [w for w in range(1, max_world + 1) if global_batch % (w * micro_batch) == 0]


def check_layout(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Return the gradient accumulation steps ``G // (W * m)`` of a valid layout.

    Raises CursorError, naming the values, the rule, the valid world sizes and a fix, when
    ``global_batch % (world_size * micro_batch) != 0``.
    """
    _check_int("global_batch", global_batch, 1)
    _check_int("micro_batch", micro_batch, 1)
    _check_int("world_size", world_size, 1)
    per_step = world_size * micro_batch
    if global_batch % per_step == 0:
        return global_batch // per_step
    valid = valid_world_sizes(global_batch, micro_batch, _LISTED_WORLD_SIZES)
    if valid:
        fix = (
            f"run with a world size in {valid}, or pick a global_batch that is a multiple of "
            f"world_size*micro_batch={per_step}"
        )
    else:
        fix = f"make global_batch a multiple of micro_batch={micro_batch} (no world size fits now)"
    raise CursorError(
        f"invalid data layout: global_batch={global_batch}, micro_batch={micro_batch}, "
        f"world_size={world_size}; the rule is global_batch % (world_size * micro_batch) == 0 but "
        f"{global_batch} % {per_step} = {global_batch % per_step}. Valid world sizes "
        f"(1..{_LISTED_WORLD_SIZES}) for this global_batch and micro_batch: {valid}. Fix: {fix}."
    )


@functools.lru_cache(maxsize=8)
def _cached_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    perm = rng.permutation(n).astype(np.int64, copy=False)
    # Shared by every caller through the cache: a write would silently corrupt the data order.
    perm.flags.writeable = False
    return perm


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64, read-only) that is a pure function of ``(seed, epoch, n)``.

    The last few permutations are cached, so callers must not (and cannot) modify the result.
    Raises CursorError for a negative seed or epoch or a non-positive ``n``.
    """
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    _check_int("n", n, 1)
    return _cached_permutation(int(seed), int(epoch), int(n))


def sample_ids(position_start: int, count: int, seed: int, n: int) -> np.ndarray:
    """Sample ids (int64) of the global positions ``[position_start, position_start + count)``.

    Positions past the end of an epoch continue in the next epoch's permutation.
    """
    _check_int("position_start", position_start, 0)
    _check_int("count", count, 0)
    _check_int("n", n, 1)
    out = np.empty(count, dtype=np.int64)
    pos, filled = int(position_start), 0
    while filled < count:
        epoch, offset = divmod(pos, n)
        take = min(count - filled, n - offset)
        out[filled : filled + take] = epoch_permutation(seed, epoch, n)[offset : offset + take]
        filled += take
        pos += take
    return out


def micro_batch_positions(
    step: int, rank: int, world_size: int, micro_batch: int, global_batch: int, k: int
) -> range:
    """Global positions of micro-batch ``k`` of rank ``rank`` at ``step``.

    Positions are ``step*G + (k*W + rank)*m ... + m``. Raises CursorError for an invalid layout, a
    rank outside ``[0, W)`` or ``k`` outside ``[0, accum)``.
    """
    accum = check_layout(global_batch, micro_batch, world_size)
    _check_int("step", step, 0)
    _check_int("rank", rank, 0)
    _check_int("k", k, 0)
    if rank >= world_size:
        raise CursorError(f"rank={rank} is outside [0, world_size={world_size})")
    if k >= accum:
        raise CursorError(f"micro-batch k={k} is outside [0, accum={accum})")
    start = step * global_batch + (k * world_size + rank) * micro_batch
    return range(start, start + micro_batch)


def rank_micro_batches(
    step: int, rank: int, world_size: int, micro_batch: int, global_batch: int, seed: int, n: int
) -> list[np.ndarray]:
    """The ``accum`` arrays of sample ids that ``rank`` processes at ``step``, in order."""
    accum = check_layout(global_batch, micro_batch, world_size)
    batches = []
    for k in range(accum):
        positions = micro_batch_positions(step, rank, world_size, micro_batch, global_batch, k)
        batches.append(sample_ids(positions.start, micro_batch, seed, n))
    return batches


def step_sample_ids(step: int, global_batch: int, seed: int, n: int) -> np.ndarray:
    """All ``global_batch`` sample ids of ``step``, in position order."""
    _check_int("step", step, 0)
    _check_int("global_batch", global_batch, 1)
    return sample_ids(step * global_batch, global_batch, seed, n)


def eval_sample_ids(eval_batch: int, rank: int, world_size: int, micro_batch: int, global_batch: int, k: int,
                    n: int) -> np.ndarray:
    """Validation sample ids of micro-batch ``k`` of ``rank`` in evaluation batch ``eval_batch``: the batch's
    positions are ``[eval_batch*G, (eval_batch+1)*G)``, split over ranks and micro-batches as a step's are
    (``micro_batch_positions``), and position ``p`` is window ``p % n`` of the validation split (in order, no
    shuffle). So every evaluation of a run scores the same windows, whatever the world size."""
    _check_int("eval_batch", eval_batch, 0)
    _check_int("n", n, 1)
    within = micro_batch_positions(0, rank, world_size, micro_batch, global_batch, k)
    return (eval_batch * global_batch + np.arange(within.start, within.stop, dtype=np.int64)) % n


@dataclass(frozen=True)
class CursorState:
    """The data position a checkpoint stores: the next step to run and what defines the data order.

    ``step`` is the number of completed steps, so the next step consumes positions starting at
    ``position``. Resuming with a different ``global_batch``, ``seed`` or ``dataset_len`` would
    silently change which samples are seen; ``check_compatible`` refuses that.
    """

    step: int
    global_batch: int
    seed: int
    dataset_len: int

    def __post_init__(self) -> None:
        _check_int("step", self.step, 0)
        _check_int("global_batch", self.global_batch, 1)
        _check_int("seed", self.seed, 0)
        _check_int("dataset_len", self.dataset_len, 1)

    @property
    def position(self) -> int:
        """Global position of the first sample of ``step``."""
        return self.step * self.global_batch

    @property
    def epoch(self) -> int:
        """Epoch that ``position`` falls in."""
        return self.position // self.dataset_len

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CursorState:
        """Inverse of ``to_dict``; raises CursorError on missing or unknown keys."""
        names = {f.name for f in fields(cls)}
        missing = sorted(names - data.keys())
        unknown = sorted(data.keys() - names)
        if missing or unknown:
            raise CursorError(
                f"cursor state has missing keys {missing} and unknown keys {unknown}; "
                f"expected exactly {sorted(names)}"
            )
        return cls(**{name: data[name] for name in names})

    def check_compatible(self, other: CursorState) -> None:
        """Raise CursorError if ``other`` defines a different data order (step may differ).

        Call on resume with ``self`` = the running config's cursor and ``other`` = the checkpoint's.
        """
        for name in ("global_batch", "seed", "dataset_len"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise CursorError(
                    f"incompatible cursor state: {name} is {theirs} in the checkpoint but {mine} now; "
                    f"resuming would change which samples each step sees. Fix: restore {name}={theirs} "
                    f"or start a fresh run."
                )
