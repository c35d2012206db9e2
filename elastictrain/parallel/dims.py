"""The mesh as data: an ordered tuple of named axes and the ONE answer to "which rank holds what".

torchtitan's ``ParallelDims`` shape. The world is the row-major product of the axes, outermost first::

    pp x dp_replicate x dp_shard x cp x tp

so rank ``r``'s coordinate on an axis is ``(r // stride) % size`` with ``stride`` the product of the sizes
of the axes inside it (``tp`` innermost: a tensor-parallel group is consecutive ranks). Every other module
asks :class:`MeshDims` (``coord``, ``rank``, ``group_ranks`` and the role queries) instead of writing a
formula out; a new axis is one entry of :data:`AXES` plus its role.

Roles (what an axis does to the training state and to the data):

* ``model_axes`` (``pp``, ``tp``): split the model itself; a rank holds its stage / its tp shard;
* ``state_shard_axes``: the axes FSDP2 shards parameters and optimizer state over, ``dp_shard x cp``
  under ``fsdp``/``hsdp`` (torchtitan's rule: context-parallel ranks see the same weights, so they join
  the shard group), none under ``ddp``;
* ``replicate_axes``: the axes over which every rank holds an identical copy of its state;
* ``batch_axes`` (``dp_replicate``, ``dp_shard``): ranks that see different samples;
* ``seq_axes`` (``cp``): ranks that see different positions of the same samples.

Expert parallel (``ep``) is not a world axis: it factors the expert ranks of one pp coordinate -- the
data x cp x tp ranks, ``dp_shard x cp x tp = efsdp x ep`` (torchtitan's rule with expert tensor parallel
degree 1: the expert group borrows the cp ranks, which route other tokens of the same samples, and the tp
ranks, which split a data rank's tokens; under tp ``ep`` is a multiple of ``tp``) -- into groups of ``ep``
consecutive expert ranks that exchange tokens (all-to-all) and hold different experts
(:meth:`MeshDims.ep_group_ranks`, :meth:`MeshDims.expert_replica_ranks`). A rank's expert rank is
``(dp_rank x cp + cp coordinate) x tp + tp coordinate`` (:meth:`MeshDims.expert_rank`): without cp and tp,
its data-parallel rank. Under ``hsdp`` a group stays inside one replica (``ep`` divides
``dp_shard x cp x tp``), so the experts are HSDP too: replicated over ``dp_replicate``, FSDP-sharded over
the rest of the shard ranks.
Pure: no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod

# Every world axis, outermost first (the row-major rank order).
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MODEL_AXES: tuple[str, ...] = ("pp", "tp")
BATCH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")
SEQ_AXES: tuple[str, ...] = ("cp",)
# The axes whose coordinate names a distinct part of the state in a snapshot (coverage is by these).
SNAPSHOT_AXES: tuple[str, ...] = ("pp", "cp", "tp")


@dataclass(frozen=True)
class MeshDims:
    """Sizes of the mesh axes (all >= 1) and the data-parallel plan that lays out ``dp_*``.

    ``names``/``shape`` give the DeviceMesh to build: only the axes a layout uses (``pp``, ``cp``, ``tp``
    when > 1; the plan's data-parallel axes always). ``axes``/``sizes`` are every world axis, in order."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    plan: str = "ddp"
    cp: int = 1
    ep: int = 1  # not a world axis: factors the data ranks (module doc)

    def __post_init__(self) -> None:
        for name in AXES + ("ep",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MeshDims.{name} must be an int >= 1, got {v!r}")
        n = self.dp * self.cp * self.tp  # the expert ranks (module doc; that ep is a multiple of tp is ep_rule's)
        if n % self.ep:
            axes = "dp" + (" x cp" if self.cp > 1 else "") + (" x tp" if self.tp > 1 else "")
            what = f"data-parallel size {self.dp}" if self.cp == self.tp == 1 else f"expert ranks {axes} = {n}"
            raise ValueError(f"MeshDims.ep={self.ep} must divide the {what}")
        if self.plan == "hsdp" and self.dp_shard * self.cp * self.tp % self.ep:
            raise ValueError(f"MeshDims.ep={self.ep} must divide dp_shard x cp x tp = "
                             f"{self.dp_shard * self.cp * self.tp} under hsdp (an ep group inside one replica)")

    # ------------------------------------------------------------------ sizes
    @property
    def axes(self) -> tuple[str, ...]:
        return AXES

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in AXES)

    def size(self, name: str) -> int:
        """The size of axis ``name`` (``ep`` too). Raises KeyError for an unknown axis."""
        if name not in AXES and name != "ep":
            raise KeyError(f"no mesh axis {name!r}; axes are {list(AXES)} and ep")
        return getattr(self, name)

    @cached_property
    def world_size(self) -> int:
        return prod(self.sizes)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different samples."""
        return self.dp_replicate * self.dp_shard

    # ------------------------------------------------------------------ the DeviceMesh
    @property
    def names(self) -> tuple[str, ...]:
        """Mesh axes to build, outermost first: ``pp``, ``cp`` and ``tp`` only when > 1, the plan's
        data-parallel axes always (ddp/fsdp/hsdp meshes are unchanged)."""
        dp = {"ddp": ("dp_replicate",), "fsdp": ("dp_shard",)}.get(self.plan, ("dp_replicate", "dp_shard"))
        return tuple(n for n in AXES if n in dp or (n in ("pp", "cp", "tp") and self.size(n) > 1))

    @property
    def dp_names(self) -> tuple[str, ...]:
        """The data-parallel axes of :attr:`names` (what ``parallel.plan`` lays out)."""
        return tuple(n for n in self.names if n in BATCH_AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names)

    # ------------------------------------------------------------------ ranks and coordinates
    def stride(self, name: str) -> int:
        """How many ranks apart two neighbours on axis ``name`` are (the product of the axes inside it)."""
        return self._strides[name]

    @cached_property
    def _strides(self) -> dict[str, int]:  # (asked per rank by recovery decisions over 10,000 ranks)
        return {n: prod(getattr(self, m) for m in AXES[AXES.index(n) + 1:]) for n in AXES}

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the mesh of {self.world_size} ranks")

    def coord(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every world axis (row-major, outermost first)."""
        self._check_rank(rank)
        return {n: (rank // self.stride(n)) % getattr(self, n) for n in AXES}

    def rank(self, coord: Mapping[str, int]) -> int:
        """The rank at ``coord`` (axes left out are 0). Raises ValueError for an unknown axis or a
        coordinate outside its axis."""
        extra = set(coord) - set(AXES)
        if extra:
            raise ValueError(f"unknown mesh axes {sorted(extra)}; axes are {list(AXES)}")
        out = 0
        for n in AXES:
            c = coord.get(n, 0)
            if not 0 <= c < getattr(self, n):
                raise ValueError(f"coordinate {n}={c} is outside the axis of size {getattr(self, n)}")
            out += c * self.stride(n)
        return out

    def group_ranks(self, rank: int, axes: Iterable[str]) -> list[int]:
        """The ranks that differ from ``rank`` only on ``axes`` (``rank`` included), ascending."""
        axes = tuple(axes)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; axes are {list(AXES)}")
        base = self.coord(rank)
        out = [base]
        for a in axes:
            out = [{**c, a: i} for c in out for i in range(getattr(self, a))]
        return sorted(self.rank(c) for c in out)

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel rank: which share of each step's samples it reads (0..dp-1)."""
        c = self.coord(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ------------------------------------------------------------------ roles
    @property
    def model_axes(self) -> tuple[str, ...]:
        """Axes that split the model: a rank holds its pipeline stage(s) and its tp shard."""
        return MODEL_AXES

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Axes whose ranks see different samples."""
        return BATCH_AXES

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """Axes whose ranks see different positions of the same samples."""
        return SEQ_AXES

    @property
    def state_shard_axes(self) -> tuple[str, ...]:
        """Axes FSDP2 shards the parameters and optimizer state over: ``dp_shard x cp`` under fsdp/hsdp
        (even at size 1: the state is then a DTensor all the same), none under ddp."""
        return ("dp_shard", "cp") if self.plan in ("fsdp", "hsdp") else ()

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """Axes over which every rank holds the same state: the data-parallel and context-parallel axes
        that are neither model axes nor shard axes."""
        return tuple(n for n in ("dp_replicate", "dp_shard", "cp") if n not in self.state_shard_axes)

    @property
    def holds_whole_state(self) -> bool:
        """THE predicate: every rank of this layout holds the whole training state as plain tensors (no
        pipeline stages, no tp shards, no FSDP sharding -- FSDP's DTensors count as sharded even on a
        shard axis of size 1, since only plain replicas can be broadcast and kept across a re-mesh). Then
        any survivor can restore a joiner. Expert parallel (``ep > 1``) shards the experts: not whole."""
        return not self.state_shard_axes and self.ep == 1 and all(getattr(self, n) == 1 for n in self.model_axes)

    def holder_axes(self) -> tuple[str, ...]:
        """The axes on which a different coordinate means a different part of the state: the model axes,
        then the shard axes (``dp_shard`` always: at size 1 it tells no rank apart), in that order, then
        ``ep`` when > 1 (a state-sharding factor of the data ranks: each ep coordinate holds other experts)."""
        shard = ("dp_shard",) + tuple(a for a in self.state_shard_axes if a != "dp_shard")
        return self.model_axes + shard + (("ep",) if self.ep > 1 else ())

    def holder_key(self, rank: int) -> tuple[int, ...]:
        """What part of the state ``rank`` holds, as its coordinate on :meth:`holder_axes` (``ep``: its
        :meth:`ep_coord`): two ranks with the same key are replicas of each other (either can restore the
        other)."""
        if not 0 <= rank < self.world_size:
            self._check_rank(rank)  # raises, naming the mesh
        key = tuple((rank // st) % sz for st, sz in self._holder)
        return key + (self.ep_coord(rank),) if self.ep > 1 else key

    @cached_property
    def _holder(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.stride(n), getattr(self, n)) for n in self.holder_axes() if n != "ep")

    def holder_keys(self) -> list[tuple[int, ...]]:
        """Every :meth:`holder_key` of the layout, in lexicographic order. Under ep the ep coordinate is a
        function of other coordinates where ep spans tp ranks or factors the shard ranks (hsdp:
        ``dp_shard x cp x tp = efsdp x ep``), so only the keys some rank has are listed (not the product, whose
        other keys no rank could cover)."""
        if self.ep > 1:
            return sorted({self.holder_key(r) for r in range(self.world_size)})
        keys = [()]
        for a in self.holder_axes():
            keys = [(*k, i) for k in keys for i in range(getattr(self, a))]
        return keys

    def snapshot_coord(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on the axes its snapshot records (pp, cp, tp; data-parallel shards are in
        the DTensor metadata itself)."""
        c = self.coord(rank)
        return {n: c[n] for n in SNAPSHOT_AXES}

    def snapshot_sizes(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in SNAPSHOT_AXES}

    # ------------------------------------------------------------------ expert parallel
    def expert_rank(self, rank: int) -> int:
        """``rank``'s index among the expert ranks of its pp coordinate (0..dp x cp x tp - 1):
        ``(dp_rank x cp + cp coordinate) x tp + tp coordinate``, the row-major order of the data, cp and tp
        axes (cp ranks route other tokens of the same samples; tp ranks split a data rank's tokens)."""
        c = self.coord(rank)
        return (self.dp_rank(rank) * self.cp + c["cp"]) * self.tp + c["tp"]

    def ep_coord(self, rank: int) -> int:
        """``rank``'s position in its expert-parallel group (which experts it holds)."""
        return self.expert_rank(rank) % self.ep

    def edp_coord(self, rank: int) -> int:
        """Which expert-parallel group ``rank`` is in (its coordinate among the replicas of its experts)."""
        return self.expert_rank(rank) // self.ep

    def ep_group_ranks(self, rank: int) -> list[int]:
        """The ranks that exchange tokens with ``rank``: ``ep`` consecutive expert ranks of the same pp
        coordinate, ``rank`` included, ascending."""
        return self._expert_ranks(rank, lambda e: e // self.ep == self.edp_coord(rank))

    def expert_replica_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the same experts as ``rank`` (same ep coordinate, same pp coordinate): their
        expert gradients are summed together."""
        return self._expert_ranks(rank, lambda e: e % self.ep == self.ep_coord(rank))

    def _expert_ranks(self, rank: int, keep: object) -> list[int]:
        c = self.coord(rank)
        out = []
        for e in range(self.dp * self.cp * self.tp):
            if keep(e):  # type: ignore[operator]
                d, rest = divmod(e, self.cp * self.tp)
                out.append(self.rank({**c, "dp_replicate": d // self.dp_shard, "dp_shard": d % self.dp_shard,
                                      "cp": rest // self.tp, "tp": rest % self.tp}))
        return sorted(out)
