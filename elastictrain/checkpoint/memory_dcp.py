"""Sharded state in host memory, readable by DCP: per-rank snapshots and a reader over a set of them.

:func:`take_snapshot` copies one rank's DCP-style state dict (nested dicts of plain tensors, DTensors and
small Python objects) into host memory WITHOUT any collective: it runs DCP's own local save planning
(``DefaultSavePlanner.create_local_plan``), so every DTensor becomes its local shard plus the shard's global
offsets exactly as a DCP save would write it, and every non-tensor becomes ``torch.save`` bytes.

:class:`SnapshotReader` is a DCP ``StorageReader`` over a *set* of such snapshots (from any ranks, any
layout, all of one step): it merges their chunk metadata, so ``dcp.load(state_dict, storage_reader=reader,
process_group=pg)`` reshards them into whatever the new ``state_dict`` holds (another mesh, another world
size, a plain replicated module). Bytes are pulled per source through :class:`SnapshotSource.start_fetch`
(every source asked at once), so a source may be a local object, a keeper actor on another node or a live
survivor.

:func:`coverage` is the pure check that the union of a set of snapshots covers every element of every
tensor (and every non-tensor entry); when it does not, it names the fqn and the missing region.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.futures import Future
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader

from elastictrain.checkpoint.host_copy import DONE, PendingCopy, copy_to_host
from elastictrain.parallel.dims import AXES, MODEL_AXES

Key = tuple[str, tuple[int, ...] | None]  # (fqn, global offsets of the chunk) or (fqn, None) for bytes


@dataclass(frozen=True)
class SnapshotMeta:
    """What a snapshot holds, without its bytes (small: travels to the controller)."""

    rank: int
    step: int
    tensors: dict[str, TensorStorageMetadata]  # fqn -> global size, properties and THIS rank's chunks
    objects: frozenset[str]                     # fqns of non-tensor entries
    mappings: dict[str, Any]                    # DCP's flatten mappings (fqn -> path in the nested dict)
    nbytes: int
    generation: int = 0                         # membership generation that took it (same step, same math)
    coord: dict[str, int] = field(default_factory=dict)  # the rank's coordinate on MeshDims.snapshot_axes
    sizes: dict[str, int] = field(default_factory=dict)  # those axes' sizes in the layout that took it
    # the generation's reporting rank only: the step records (worker/loop.py StepRecord) of the newest steps up to
    # ``step``, so a recovery from this snapshot reports the steps whose records died with the workers
    # (Ledger.replay); the controller strips them before the meta goes to the loading ranks
    records: tuple[Any, ...] = ()

    def at(self, axis: str) -> int:
        """The rank's coordinate on ``axis`` (0 where the snapshot names none)."""
        return self.coord.get(axis, 0)

    def size(self, axis: str) -> int:
        """The size of ``axis`` in the layout that took it (1 where the snapshot names none)."""
        return self.sizes.get(axis, 1)

    # Pickled compactly: a meta travels keeper -> controller -> every joining rank (one per old rank in
    # each ``join`` call), and pickling DCP's metadata objects (torch dtypes, layouts, memory formats,
    # torch.Size per chunk) cost ~2-4 ms per meta of the 2-layer GPT, paid again for each joining member.
    def __getstate__(self) -> tuple:
        return (self.rank, self.step, [(fqn, *_pack_tensor_md(md)) for fqn, md in self.tensors.items()],
                tuple(self.objects), self.mappings, self.nbytes, self.generation, self.coord, self.sizes,
                self.records)

    def __setstate__(self, state: tuple) -> None:
        rank, step, tensors, objects, mappings, nbytes, generation, coord, sizes, records = state
        for name, value in (("rank", rank), ("step", step), ("objects", frozenset(objects)),
                            ("tensors", {t[0]: _unpack_tensor_md(*t[1:]) for t in tensors}),
                            ("mappings", mappings), ("nbytes", nbytes), ("generation", generation),
                            ("coord", coord), ("sizes", sizes), ("records", tuple(records))):
            object.__setattr__(self, name, value)


def _pack_tensor_md(md: TensorStorageMetadata) -> tuple:
    p = md.properties
    props = (str(p.dtype).removeprefix("torch."), str(p.layout).removeprefix("torch."), p.requires_grad,
             str(p.memory_format).removeprefix("torch."), p.pin_memory)
    return props, tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]


def _unpack_tensor_md(props: tuple, size: tuple, chunks: list) -> TensorStorageMetadata:
    dtype, layout, requires_grad, memory_format, pin_memory = props
    properties = TensorProperties(dtype=getattr(torch, dtype), layout=getattr(torch, layout),
                                  requires_grad=requires_grad, memory_format=getattr(torch, memory_format),
                                  pin_memory=pin_memory)
    return TensorStorageMetadata(properties, torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in chunks])


@dataclass
class Snapshot:
    """One rank's state in host memory: ``data`` maps (fqn, offsets) to a host tensor, (fqn, None) to the
    ``torch.save`` bytes of a non-tensor entry."""

    meta: SnapshotMeta
    data: dict[Key, Any] = field(repr=False)
    ready: PendingCopy = field(default=DONE, repr=False, compare=False)  # copies from a GPU still in flight

    def wait(self) -> None:
        """Return once every host tensor holds its data (copies from CUDA sources run asynchronously)."""
        self.ready.wait()

    def fetch(self, keys: Iterable[Key]) -> dict[Key, Any]:
        self.wait()
        return {k: self.data[k] for k in keys}

    def start_fetch(self, keys: Iterable[Key]) -> Callable[[], dict[Key, Any]]:
        got = self.fetch(keys)  # local: nothing to overlap
        return lambda: got

    def __getstate__(self) -> dict[str, Any]:  # sent to a keeper: complete bytes, no CUDA event, one buffer
        self.wait()
        return {"meta": self.meta, "packed": pack(self.data)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.meta, self.data, self.ready = state["meta"], unpack(state["packed"]), DONE


_ALIGN = 64  # every chunk starts at a multiple of this in a packed buffer (any dtype can view it)


@dataclass(frozen=True)
class Packed:
    """Chunks as ONE byte buffer plus where each lies: how snapshots and fetched chunks travel between
    processes. Pickling a tensor has a fixed cost of its own, so a shard of many small tensors is dear
    sent one by one: measured for 87 chunks through a Ray actor call, 25-35 ms as a dict of tensors,
    6-18 ms packed (per fetch of every reader from every source, on the recovery path)."""

    tensors: dict[Key, tuple[int, torch.dtype, tuple[int, ...]]]  # key -> (byte offset, dtype, shape)
    buffer: torch.Tensor                                          # uint8, on the host
    objects: dict[Key, Any]                                       # non-tensor entries as they are


def pack(chunks: Mapping[Key, Any]) -> Packed:
    """Copy the tensors of ``chunks`` into one host byte buffer (see :class:`Packed`)."""
    where: dict[Key, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    total = 0
    for k, v in chunks.items():
        if isinstance(v, torch.Tensor):
            where[k] = (total, v.dtype, tuple(v.shape))
            total += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8)
    for k, (offset, _, _) in where.items():
        v = chunks[k].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + v.numel()].copy_(v)
    return Packed(where, buffer, {k: v for k, v in chunks.items() if k not in where})


def unpack(packed: Packed) -> dict[Key, Any]:
    """The chunks of ``packed``: tensors are views into its buffer (no copy)."""
    out = dict(packed.objects)
    for k, (offset, dtype, shape) in packed.tensors.items():
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[k] = packed.buffer[offset:offset + n].view(dtype).reshape(shape)
    return out


class SnapshotSource(Protocol):
    """Anything that can hand out a snapshot's chunks: a local :class:`Snapshot`, a keeper on another node."""

    meta: SnapshotMeta

    def fetch(self, keys: Iterable[Key]) -> dict[Key, Any]: ...

    def start_fetch(self, keys: Iterable[Key]) -> Callable[[], dict[Key, Any]]:
        """Ask for ``keys`` now; the returned function waits for them (reads from several sources overlap)."""
        ...

    # Optional: sources with the same non-None ``batch_key`` are asked together through their class's
    # ``start_fetch_batch([(source, keys), ...])`` (one call per keeper; see ``start_fetches``).


def start_fetches(requests: Sequence[tuple[Any, Iterable[Key]]]) -> list[Callable[[], dict[Key, Any]]]:
    """``source.start_fetch(keys)`` for each ``(source, keys)``, except that sources sharing a ``batch_key``
    (snapshots held by one keeper) are asked in one ``start_fetch_batch`` call. Same order as ``requests``."""
    out: list[Any] = [None] * len(requests)
    groups: dict[Any, list[int]] = {}
    for i, (src, keys) in enumerate(requests):
        key = getattr(src, "batch_key", None)
        if key is None:
            out[i] = src.start_fetch(keys)
        else:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        if len(members) == 1:
            src, keys = requests[members[0]]
            out[members[0]] = src.start_fetch(keys)
            continue
        waits = type(requests[members[0]][0]).start_fetch_batch([requests[i] for i in members])
        for i, wait in zip(members, waits):
            out[i] = wait
    return out


def take_snapshot(state_dict: dict[str, Any], *, rank: int, step: int, generation: int = 0,
                  coord: dict[str, int] | None = None, sizes: dict[str, int] | None = None,
                  reuse: Snapshot | None = None, records: Sequence[Any] = ()) -> Snapshot:
    """Copy this rank's part of ``state_dict`` to host memory. Collective-free. CPU sources are copied
    when this returns, so the caller may mutate them right away (this copy is the whole training stall).
    CUDA sources are copied into pinned host tensors on a side stream and may still be in flight
    (``Snapshot.ready``; see :mod:`elastictrain.checkpoint.host_copy` for who waits where).

    ``coord``/``sizes``: the rank's coordinate on the snapshot axes of its layout and their sizes
    (``MeshDims.snapshot_coord`` / ``snapshot_sizes``; none: one stage, no tp). The snapshot of one stage
    holds that stage's parameters only and a TP rank its shard of each TP-sharded parameter (global
    offsets): :func:`coverage` needs every stage and every tp coordinate of each.
    ``reuse``: a snapshot nobody reads any more; its host tensors are refilled where a chunk has the
    same key, shape and dtype (steady state: a plain copy into memory already faulted in).
    ``records``: step records the snapshot carries (:attr:`SnapshotMeta.records`)."""
    spare = {} if reuse is None else reuse.data
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    plan = planner.create_local_plan()
    tensors: dict[str, TensorStorageMetadata] = {}
    objects: set[str] = set()
    data: dict[Key, Any] = {}
    nbytes = 0
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if reuse is not None:
        reuse.wait()  # a spare whose own copy is still landing must not be refilled under it
    with torch.no_grad():
        for item in plan.items:
            fqn = item.index.fqn
            value = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = value.getvalue()
                data[(fqn, None)] = raw
                objects.add(fqn)
                nbytes += len(raw)
                continue
            td = item.tensor_data
            key = (fqn, tuple(td.chunk.offsets))
            host = spare.get(key)
            if not (isinstance(host, torch.Tensor) and host.shape == value.shape and host.dtype == value.dtype):
                # pinned for a CUDA source: the device -> host copy is a DMA, queued without blocking
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            pairs.append((host, value))
            data[key] = host
            nbytes += host.numel() * host.element_size()
            md = tensors.setdefault(fqn, TensorStorageMetadata(td.properties, td.size, []))
            md.chunks.append(td.chunk)
    ready = copy_to_host(pairs)
    meta = SnapshotMeta(rank, step, tensors, frozenset(objects), dict(plan.planner_data or {}), nbytes, generation,
                        dict(coord or {}), dict(sizes or {}), tuple(records))
    return Snapshot(meta, data, ready)


# ---------------------------------------------------------------------------------------------- coverage
_AXIS_ORDER = AXES
_NAMED = {"pp": ("pipeline", "stage", "pipeline"), "tp": ("tensor-parallel", "tp coordinate", "group"),
          "cp": ("context-parallel", "cp coordinate", "group"), "dp_replicate": ("replicate", "replica", "group"),
          "dp_shard": ("shard", "shard coordinate", "group")}
@dataclass(frozen=True)
class Coverage:
    """Whether a set of snapshots holds every element of every entry; ``missing`` says what is not."""

    complete: bool
    missing: tuple[str, ...]

    @property
    def reason(self) -> str:
        if self.complete:
            return "the snapshots cover every element of every entry"
        more = f" (+{len(self.missing) - 3} more)" if len(self.missing) > 3 else ""
        return "missing " + "; ".join(self.missing[:3]) + more


def _uncovered(size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> tuple[list[int], list[int]] | None:
    """A box of ``size`` not covered by any chunk (offsets, sizes), or None. Exact: cuts the tensor into
    the grid of all chunk boundaries and checks each cell's corner is inside some chunk."""
    if any(s == 0 for s in size):
        return None
    cuts = []
    for d, extent in enumerate(size):
        points = {0, extent}
        for c in chunks:
            points.update(p for p in (c.offsets[d], c.offsets[d] + c.sizes[d]) if 0 <= p <= extent)
        cuts.append(sorted(points))
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if all(n > 0 for n in c.sizes)]
    for cell in itertools.product(*(range(len(p) - 1) for p in cuts)):
        corner = [cuts[d][i] for d, i in enumerate(cell)]
        if not any(all(o[d] <= corner[d] < o[d] + s[d] for d in range(len(size))) for o, s in boxes):
            return corner, [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]
    return None


def coverage(metas: Sequence[SnapshotMeta], expected: Iterable[str] | None = None) -> Coverage:
    """Pure check: does the union of ``metas`` (one step of one generation) hold every element of every
    tensor they name, and every fqn of ``expected``? Mixed steps or generations are incomplete: another
    generation's state of the same step may differ in the last bits (another reduction order).

    Under pipeline parallelism a snapshot holds its stage's entries only, so a set that lacks a stage
    names none of that stage's parameters and would look whole: the set must also hold every pipeline
    coordinate ``0..pp_size-1`` of one ``pp_size``, and the snapshots of each coordinate must cover every
    element of every tensor they name (as a whole set does without pipelining, ``pp_size`` 1).

    Under tensor parallelism each snapshot holds its TP shard of the sharded parameters (global offsets),
    so a lost TP coordinate leaves holes the element check finds; the set must also agree on one
    ``tp_size`` and hold every tp coordinate ``0..tp_size-1`` of each stage (named when one lacks). The
    axes are the snapshots' ``coord``/``sizes`` keys (:meth:`MeshDims.snapshot_coord`): every model axis is
    checked this way; axes that shard through DTensor chunks (dp_shard, cp) are found by the element check."""
    missing: list[str] = []
    steps = sorted({(m.generation, m.step) for m in metas})
    if len(steps) > 1:
        missing.append(f"snapshots of different (generation, step) {steps} cannot be combined")
    if not metas:
        return Coverage(False, ("no snapshot",))
    axes = sorted({a for m in metas for a in (*m.coord, *m.sizes)} | {"pp"}, key=_AXIS_ORDER.index)
    for a in axes:
        got = sorted({m.size(a) for m in metas})
        if len(got) > 1:
            missing.append(f"snapshots of different {_NAMED[a][0]} sizes ({a}_size {got}) cannot be combined")
        strays = sorted({(m.rank, m.at(a), m.size(a)) for m in metas if not 0 <= m.at(a) < m.size(a)})
        if strays:
            missing.append(f"snapshots (rank, {a}_rank, {a}_size) {strays} name a {_NAMED[a][1]} outside their "
                           f"{_NAMED[a][2]}")
    pp = max(m.size("pp") for m in metas)
    stages: dict[int, list[SnapshotMeta]] = {}
    for m in metas:
        stages.setdefault(m.at("pp"), []).append(m)
    lacking = [p for p in range(pp) if p not in stages]
    if lacking:
        missing.append(f"no snapshot of pipeline stage(s) {lacking} of pp_size {pp}")
    # every coordinate of the other model axes (tp) in each stage: a lost TP rank with no replica is named
    # (its shards are holes below too); data and context axes shard through DTensor chunks, found below
    for a in (a for a in axes if a in MODEL_AXES and a != "pp"):
        n = max(m.size(a) for m in metas)
        for p, group in sorted(stages.items()):
            held = {m.at(a) for m in group}
            lacking = [t for t in range(n) if t not in held]
            if lacking:
                where = f" of pipeline stage {p}" if pp > 1 else ""
                missing.append(f"no snapshot of {_NAMED[a][1]}(s) {lacking}{where} of {a}_size {n}")
    merged: dict[str, Any] = {}
    for p, group in sorted(stages.items()):
        stage = merge_metadata(group)
        where = f" (stage {p})" if pp > 1 else ""
        for fqn, md in sorted(stage.items()):
            if isinstance(md, TensorStorageMetadata):
                hole = _uncovered(tuple(md.size), md.chunks)
                if hole is not None:
                    missing.append(f"{fqn}{where}: offsets {hole[0]} sizes {hole[1]} of {list(md.size)}")
        merged.update(stage)
    for fqn in sorted(set(expected or ()) - set(merged)):
        missing.append(f"{fqn}: no snapshot holds it")
    return Coverage(not missing, tuple(missing))


def merge_metadata(metas: Sequence[SnapshotMeta]) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """fqn -> DCP storage metadata with the union of chunks (identical chunks counted once)."""
    out: dict[str, Any] = {}
    for m in metas:
        for fqn, md in m.tensors.items():
            have = out.get(fqn)
            if have is None:
                out[fqn] = TensorStorageMetadata(md.properties, md.size, list(md.chunks))
                continue
            if tuple(have.size) != tuple(md.size):
                raise ValueError(f"{fqn}: rank {m.rank} has global size {list(md.size)}, others {list(have.size)}")
            seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
            have.chunks.extend(c for c in md.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen)
        for fqn in m.objects:
            out.setdefault(fqn, BytesStorageMetadata())
    return out


# ---------------------------------------------------------------------------------------------- reader
class SnapshotReader(StorageReader):
    """DCP ``StorageReader`` over a set of snapshot sources of one step (see module doc).

    Every rank of the loading group must build it over the same sources. Raises ``ValueError`` at
    construction if the sources do not cover the state (use :func:`coverage` first to decide)."""

    def __init__(self, sources: Sequence[SnapshotSource]) -> None:
        super().__init__()
        self.sources = list(sources)
        cov = coverage([s.meta for s in self.sources])
        if not cov.complete:
            raise ValueError(f"snapshot sources are incomplete: {cov.reason}")
        self.step = self.sources[0].meta.step
        self._owner: dict[Key, int] = {}
        for i, s in enumerate(self.sources):
            for fqn, md in s.meta.tensors.items():
                for c in md.chunks:
                    self._owner.setdefault((fqn, tuple(c.offsets)), i)
            for fqn in s.meta.objects:
                self._owner.setdefault((fqn, None), i)
        mappings: dict[str, Any] = {}
        for s in self.sources:
            mappings.update(s.meta.mappings)
        self._metadata = Metadata(merge_metadata([s.meta for s in self.sources]), planner_data=mappings)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @staticmethod
    def _key(index: MetadataIndex) -> Key:
        return index.fqn, None if index.offset is None else tuple(index.offset)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_source: dict[int, list[Any]] = {}
        for item in plan.items:
            by_source.setdefault(self._owner[self._key(item.storage_index)], []).append(item)
        # every source is asked at once (remote ones answer in the background; one call per keeper), then read
        order = sorted(by_source)
        started = start_fetches([(self.sources[i], {self._key(it.storage_index) for it in by_source[i]})
                                 for i in order])
        waits = dict(zip(order, started))
        for i, items in sorted(by_source.items()):
            got = waits[i]()
            for it in items:
                value = got[self._key(it.storage_index)]
                if it.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(it, io.BytesIO(value))
                    continue
                src = narrow_tensor_by_index(value, it.storage_offsets, it.lengths)
                dst = planner.resolve_tensor(it).detach()
                if dst.size() != src.size():
                    raise ValueError(f"{it.storage_index.fqn}: chunk {list(src.size())} does not fit {list(dst.size())}")
                dst.copy_(src)
                planner.commit_tensor(it, dst)
        done: Future[None] = Future()
        done.set_result(None)
        return done  # reads are synchronous: the future is already complete

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def sources_by_step(metas: Mapping[int, SnapshotMeta]) -> dict[int, list[SnapshotMeta]]:
    """Group snapshot metadata (keyed by any id) by step, newest first."""
    out: dict[int, list[SnapshotMeta]] = {}
    for m in metas.values():
        out.setdefault(m.step, []).append(m)
    return dict(sorted(out.items(), reverse=True))
