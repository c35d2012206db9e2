"""Hugging Face safetensors in (``task.init_from``) for the built-in Llama: headers, config.json, and each
rank's own slices loaded into a parallelized model.

A checkpoint is a directory (local, Lustre, or any fsspec URL such as ``s3://``) holding ``config.json`` and
one or more ``*.safetensors`` files (``model.safetensors.index.json`` names them when there are several).
:func:`read_source` reads only ``config.json`` and each file's header (8 bytes + a JSON header): the driver
checks names and shapes with it before any worker starts. :func:`load_hf_weights` fills a parallelized
model (whole under ddp, DTensor shards under fsdp/hsdp/tp, a stage's subset under pp) through
``torch.distributed.checkpoint.load``: DCP's planner asks for exactly the slice each local tensor holds.
Local paths read through torch's own ``HuggingFaceStorageReader`` (``safe_open`` + ``get_slice``); other
filesystems through a ranged reader (:func:`make_reader`), which fetches only the bytes a rank holds: a slice of rows
is one range; a slice of columns (a tensor-parallel row-wise layer) is read by row blocks, each rank of the
tp group reading 1/tp of the rows whole and one all-to-all of the group giving each its columns
(:mod:`elastictrain.models.hf_rows`, which says where that applies); a slice of columns outside it is one range
per row. Every range of the rank's plan goes out together, merged where the bytes between two are few
(:mod:`elastictrain.byte_ranges`). DCP plans without collectives (``no_dist=True``): each rank plans alone;
the row-block exchanges are the only collectives, over each tp group.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.byte_ranges import WEIGHTS_MERGE_GAP, fetch, slice_runs
from elastictrain.config import ConfigError
from elastictrain.models.hf_llama import hf_from_ours
from elastictrain.models.hf_rows import RowJob, exchange, row_jobs

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and the byte offset of its first element."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in ``file``
    end: int


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face checkpoint directory as read from its metadata: config.json and the tensor table."""

    uri: str
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: e.shape for n, e in self.tensors.items()}


def _fs(uri: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(uri, **(storage_options or {}))


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _header(fs: Any, path: str, uri: str) -> dict[str, TensorEntry]:
    raw = fs.cat_file(path, start=0, end=8)  # two exact ranges: the length, then the JSON header
    if len(raw) != 8:
        raise ConfigError(f"task.init_from={uri}: {path} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise ConfigError(f"task.init_from={uri}: {path} is not a safetensors file (header of {n} bytes)")
    try:
        head = json.loads(fs.cat_file(path, start=8, end=8 + n))
    except ValueError:
        raise ConfigError(f"task.init_from={uri}: {path} is not a safetensors file (header not JSON)") from None
    out = {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        out[name] = TensorEntry(path, info["dtype"], tuple(int(d) for d in info["shape"]), 8 + n + s, 8 + n + e)
    return out


def read_source(uri: str, storage_options: dict[str, Any] | None = None) -> HFSource:
    """config.json and the headers of every safetensors file of the checkpoint at ``uri`` (no tensor data
    read). Raises ConfigError naming the path for a missing or unreadable directory, config.json or file."""
    fs, root = _fs(uri, storage_options)
    root = root.rstrip("/")
    try:
        config = json.loads(fs.cat_file(f"{root}/config.json"))
    except FileNotFoundError:
        raise ConfigError(f"task.init_from={uri}: no config.json there; point it at a Hugging Face model "
                          "directory (save_pretrained's output)") from None
    except ValueError as e:
        raise ConfigError(f"task.init_from={uri}: config.json is not JSON ({e})") from None
    except OSError as e:  # permissions, an unreachable endpoint: the driver reads it too
        raise ConfigError(f"task.init_from={uri}: cannot read config.json ({e}); the driver and the workers "
                          "need read access (task.init_from_storage_options)") from None
    if fs.exists(f"{root}/{INDEX_FILE}"):
        weight_map = json.loads(fs.cat_file(f"{root}/{INDEX_FILE}")).get("weight_map", {})
        files = sorted({f"{root}/{name}" for name in weight_map.values()})
    else:
        files = sorted(p for p in fs.ls(root, detail=False) if str(p).endswith(".safetensors"))
    if not files:
        raise ConfigError(f"task.init_from={uri}: no *.safetensors files there (only safetensors are read; "
                          "convert a pytorch_model.bin with transformers' save_pretrained)")
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        try:
            tensors.update(_header(fs, path, uri))
        except FileNotFoundError:
            raise ConfigError(f"task.init_from={uri}: {INDEX_FILE} names {path}, which does not exist") from None
    return HFSource(uri, config, tensors)


def _element_bytes(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def make_reader(uri: str, storage_options: dict[str, Any] | None, source: HFSource | None = None,
                merge_gap: int | None = None, row_blocks: dict[str, RowJob] | None = None) -> Any:
    """The DCP StorageReader for the checkpoint at ``uri``: torch's ``HuggingFaceStorageReader`` for a local
    path, a ranged reader otherwise (:func:`_read_plan`; ``merge_gap``: bytes between two ranges read as one,
    default :data:`elastictrain.byte_ranges.WEIGHTS_MERGE_GAP`). ``row_blocks`` (ranged reader only): the
    tensors, by Hugging Face name, whose slices come from row blocks exchanged over their group
    (:mod:`elastictrain.models.hf_rows`); its ``read_data`` is then collective over those groups: every rank
    of each calls it, with the same names. None or empty: each rank reads its slices alone."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       StorageMeta, TensorProperties, TensorStorageMetadata)
    from torch.futures import Future

    if is_local(uri):
        return HuggingFaceStorageReader(uri.removeprefix("file://"))
    src = source or read_source(uri, storage_options)
    fs, _ = _fs(uri, storage_options)

    class _Ranged(HuggingFaceStorageReader):
        def __init__(self) -> None:
            super().__init__(path=".")  # torch's local path is never used: I/O is overridden

        def read_metadata(self) -> Metadata:
            sd_md, storage = {}, {}
            for name, e in src.tensors.items():
                if e.dtype not in _DTYPES:
                    continue
                zero = torch.Size([0] * len(e.shape))
                sd_md[name] = TensorStorageMetadata(TensorProperties(dtype=_DTYPES[e.dtype]), torch.Size(e.shape),
                                                    [ChunkStorageMetadata(zero, torch.Size(e.shape))])
                storage[MetadataIndex(fqn=name, offset=zero)] = e
            md = Metadata(state_dict_metadata=sd_md, storage_data=storage)
            md.storage_meta = StorageMeta()
            return md

        def read_data(self, plan: Any, planner: Any) -> Future[None]:
            gap = WEIGHTS_MERGE_GAP if merge_gap is None else merge_gap
            jobs = row_blocks or {}
            _read_plan(fs, [(self.storage_data[req.storage_index], req) for req in plan.items
                            if req.storage_index.fqn not in jobs], planner, gap)
            if jobs:
                _read_row_blocks(fs, src.tensors, jobs, [r for r in plan.items if r.storage_index.fqn in jobs],
                                 planner, gap)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

    return _Ranged()


# Bytes spanned by the items of one ``cat_ranges`` call: a rank's whole plan (GBs for a large model) is never
# held twice, and a row-wise slice whose gaps merge counts its rows whole
_FETCH_BYTES = 256 << 20


def _read_plan(fs: Any, items: list[tuple[TensorEntry, Any]], planner: Any, gap: int) -> None:
    """Read DCP's ``(entry, ReadItem)`` pairs of one rank and commit each into its target: each item's byte
    runs (:func:`~elastictrain.byte_ranges.slice_runs`) fetched together, in calls of about
    :data:`_FETCH_BYTES` spanned, merged over gaps of at most ``gap`` bytes."""
    batch: list[tuple[TensorEntry, Any, list[tuple[int, int]]]] = []
    size = 0
    for e, req in sorted(items, key=lambda it: (it[0].file, it[0].start, list(it[1].storage_offsets))):
        runs = slice_runs(e.shape, list(req.storage_offsets), list(req.lengths), _element_bytes(e.dtype))
        batch.append((e, req, runs))
        size += runs[-1][1] - runs[0][0] if runs else 0  # the span: what its merged reads may fetch
        if size >= _FETCH_BYTES:
            _fetch_and_commit(fs, batch, planner, gap)
            batch, size = [], 0
    if batch:
        _fetch_and_commit(fs, batch, planner, gap)


def _read_row_blocks(fs: Any, entries: dict[str, TensorEntry], jobs: dict[str, RowJob], items: list[Any],
                     planner: Any, gap: int) -> None:
    """Every tensor of ``jobs`` by row blocks (this rank's rows read, one exchange per group and ~
    :data:`_FETCH_BYTES` read per rank), and DCP's ``items`` of them committed from this rank's slice.
    Every rank of a group cuts the same batches: they depend on the global shapes and the group only."""
    wanted: dict[str, list[Any]] = {}
    for req in items:
        wanted.setdefault(req.storage_index.fqn, []).append(req)
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, job in jobs.items():
        groups.setdefault(job.ranks, []).append(name)
    for ranks in sorted(groups):
        names = sorted(groups[ranks], key=lambda n: (entries[n].file, entries[n].start, n))
        batch: list[str] = []
        size = 0
        for name in names:
            b = jobs[name].block
            batch.append(name)
            size += b.bounds[-1] * b.row_bytes  # the group's rows: each rank reads 1/n of them
            if size >= b.peers * _FETCH_BYTES:
                _exchange_and_commit(fs, entries, jobs, batch, wanted, planner, gap)
                batch, size = [], 0
        if batch:
            _exchange_and_commit(fs, entries, jobs, batch, wanted, planner, gap)


def _exchange_and_commit(fs: Any, entries: dict[str, TensorEntry], jobs: dict[str, RowJob], names: list[str],
                         wanted: dict[str, list[Any]], planner: Any, gap: int) -> None:
    pieces = []
    for name in names:
        a, b = jobs[name].block.read_range()
        pieces.append((entries[name].file, entries[name].start + a, entries[name].start + b))
    raws = fetch(fs, pieces, gap)
    for (path, start, end), raw in zip(pieces, raws):
        if len(raw) != end - start:  # raised before the exchange: the group's peers fail on its timeout
            raise OSError(f"short read of {path}: {len(raw)} bytes at {start}, {end - start} expected (the "
                          "file is shorter than its safetensors header says)")
    job = jobs[names[0]]
    slices = exchange([(jobs[n].block, raw) for n, raw in zip(names, raws)], job.group, job.device)
    for name, got in zip(names, slices):
        b = jobs[name].block
        mine = got.view(_DTYPES[entries[name].dtype]).reshape(b.lengths)
        for req in wanted.get(name, []):
            part = mine[tuple(slice(o - mo, o - mo + n)
                              for o, mo, n in zip(req.storage_offsets, b.offsets, req.lengths))]
            target = planner.resolve_tensor(req).detach()
            target.copy_(part)
            planner.commit_tensor(req, target)


def _fetch_and_commit(fs: Any, batch: list[tuple[TensorEntry, Any, list[tuple[int, int]]]], planner: Any,
                      gap: int) -> None:
    pieces = [(e.file, e.start + a, e.start + b) for e, _, runs in batch for a, b in runs]
    got = iter(fetch(fs, pieces, gap))
    for e, req, runs in batch:
        t = _assemble(e, list(req.lengths), runs, [next(got) for _ in runs])
        target = planner.resolve_tensor(req).detach()
        target.copy_(t)
        planner.commit_tensor(req, target)


def _assemble(e: TensorEntry, lengths: list[int], runs: list[tuple[int, int]], parts: list[memoryview]
              ) -> torch.Tensor:
    """The slice of ``lengths`` from its runs' bytes (C order, as :func:`slice_runs` lists them)."""
    buf = bytearray(sum(b - a for a, b in runs))
    pos = 0
    for (a, b), part in zip(runs, parts):
        if len(part) != b - a:
            raise OSError(f"short read of {e.file}: {len(part)} bytes at {e.start + a}, {b - a} expected (the "
                          "file is shorter than its safetensors header says)")
        buf[pos:pos + b - a] = part
        pos += b - a
    if not buf:
        return torch.empty(lengths, dtype=_DTYPES[e.dtype])
    return torch.frombuffer(buf, dtype=_DTYPES[e.dtype]).reshape(lengths)


def _read_slice(fs: Any, e: TensorEntry, offsets: list[int], lengths: list[int], gap: int = WEIGHTS_MERGE_GAP
                ) -> torch.Tensor:
    """The slice ``[offsets, offsets + lengths)`` of one stored tensor, read alone (its runs merged as a
    plan's are)."""
    runs = slice_runs(e.shape, offsets, lengths, _element_bytes(e.dtype))
    return _assemble(e, lengths, runs, fetch(fs, [(e.file, e.start + a, e.start + b) for a, b in runs], gap))


def load_hf_weights(model: torch.nn.Module, uri: str, storage_options: dict[str, Any] | None,
                    tied: bool) -> None:
    """Fill ``model``'s parameters (parallelized and materialized: plain tensors, DTensor shards, or a
    pipeline stage set holding a subset of the names) from the Hugging Face checkpoint at ``uri``. Each
    rank reads only the slices it holds (its share of the row blocks, for the ranged reader). Collective over
    each tp group where row blocks apply (every rank of it calls this for the same model), else over none.
    ``tied``: ``output.weight`` comes from the
    embedding (Hugging Face files of tied models have no ``lm_head.weight``). Raises ConfigError naming
    the tensor for a name the table lacks, a tensor the files lack, or a shape that differs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    request: dict[str, torch.Tensor] = {}
    aliases: list[tuple[str, str]] = []  # (our name, Hugging Face name already requested for another tensor)
    for name, t in state.items():
        hf = "model.embed_tokens.weight" if tied and name == "output.weight" else hf_from_ours(name)
        if hf is None:
            raise ConfigError(f"task.init_from={uri}: our tensor {name} has no Hugging Face name "
                              "(elastictrain/models/hf_llama.py NAME_TABLE)")
        if hf in request:
            aliases.append((name, hf))
        else:
            request[hf] = t
    # a tensor-parallel row-wise layer's columns: row blocks read and exchanged (models/hf_rows.py), planned
    # in the files' dtype (bf16 files into an fp32 model); local paths keep torch's reader (a column slice of
    # a memory map costs no request per row)
    src = None if is_local(uri) else read_source(uri, storage_options)
    jobs = None if src is None else row_jobs(request, {n: _element_bytes(e.dtype) for n, e in src.tensors.items()
                                                         if e.dtype in _DTYPES})
    reader = make_reader(uri, storage_options, source=src, row_blocks=jobs)
    found = reader.read_metadata().state_dict_metadata
    for hf, t in request.items():
        if hf not in found:
            raise ConfigError(f"task.init_from={uri}: tensor {hf} is missing from the safetensors files")
        if tuple(found[hf].size) != tuple(t.shape):
            raise ConfigError(f"task.init_from={uri}: tensor {hf} has shape {list(found[hf].size)}, the model "
                              f"expects {list(t.shape)}")
    dcp.load(request, storage_reader=reader, no_dist=True)
    for name, hf in aliases:  # one tensor under two names (tied): the same values
        if state[name] is not request[hf]:
            state[name] = request[hf]
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=False))


__all__ = ["HFSource", "TensorEntry", "read_source", "load_hf_weights", "make_reader"]
