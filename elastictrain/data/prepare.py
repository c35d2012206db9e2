"""``elastictrain data prepare``: text files -> token shards + manifest, on Ray Data, deterministically.

The unit of work is one input file: Ray Data runs one task per (split, file) (``from_items`` +
``map_batches``, batch size 1) that reads the file's documents in row order, tokenizes them with the
``tokenizers`` tokenizer, appends the end-of-document id to each, and writes that file's shard itself (the
shard name is the file's index in sorted order). So the bytes depend only on (the sorted input files, the
tokenizer), never on which node ran which task or in what order blocks finished; a cluster prepares with every
node; the driver writes only the manifest, last and atomically (a partial output has no manifest).

Resume: each shard has a record beside it (``NNNNN.json``: tokens, bytes, SHA-256 and what made it). A task
whose record matches its inputs and whose shard's SHA-256 matches the record skips the work.

Bad input raises :class:`PrepareError` (one line: problem and fix; the command exits 2).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from elastictrain.data.shards import (
    MANIFEST,
    Shard,
    dtype_for,
    join,
    manifest_json,
    numpy_dtype,
    shard_name,
)

__all__ = ["PrepareError", "PrepareSpec", "prepare", "prepare_unit"]

TEXT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
# End-of-document tokens looked up in the tokenizer's vocabulary when --eos is not given, in this order.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class PrepareError(ValueError):
    """Bad input to prepare: the message names the problem and the fix (exit 2)."""


@dataclass(frozen=True)
class Unit:
    """One task: tokenize source file ``path`` into shard ``index`` of ``split`` (and, with a validation
    fraction, the same index of the validation split)."""

    split: str
    index: int
    path: str       # the file's URL (protocol included)
    rel: str        # the path relative to the source root: what the manifest and the split hash use
    size: int
    kind: str       # parquet | jsonl | text


@dataclass(frozen=True)
class PrepareSpec:
    out: str
    tokenizer_json: str
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    text_column: str
    val_fraction: float
    source_options: dict[str, Any] = field(default_factory=dict)
    out_options: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return dtype_for(self.vocab_size)


# ------------------------------------------------------------------------------------------ driver side


def list_sources(source: str, storage_options: dict[str, Any]) -> tuple[Any, list[tuple[str, str, int, str]]]:
    """``(fs, [(path, rel, size, kind), ...])`` of the text files at ``source`` (a file, a directory searched
    recursively, or a glob), sorted by path. Raises PrepareError when there is nothing to read."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source, **storage_options)
        if any(ch in path for ch in "*?["):
            found, root = sorted(p for p in fs.glob(path) if not fs.isdir(p)), path.split("*")[0].rsplit("/", 1)[0]
        elif fs.isdir(path):
            found, root = sorted(fs.find(path)), path
        elif fs.exists(path):
            found, root = [path], path.rsplit("/", 1)[0]
        else:
            raise PrepareError(f"no such source: {source!r}; pass a text file, a directory or a glob "
                               "(.parquet, .jsonl, .txt; local or s3://...)")
        out = []
        for p in found:
            kind = next((k for suffix, k in TEXT_SUFFIXES.items() if p.endswith(suffix)), None)
            if kind:
                rel = p[len(root):].lstrip("/") if p.startswith(root) else p.rsplit("/", 1)[-1]
                # the full URL: a task opens it with its own file system (an s3 path without s3:// is local)
                out.append((fs.unstrip_protocol(p), rel, int(fs.size(p)), kind))
    except PrepareError:
        raise
    except (OSError, ValueError) as e:
        raise PrepareError(f"cannot list source {source!r}: {e}") from None
    if not out:
        raise PrepareError(f"no text files at {source!r} (looked for {', '.join(TEXT_SUFFIXES)}); point SOURCE at "
                           "Parquet, JSON lines or plain text files")
    return fs, out


def load_tokenizer(where: str) -> tuple[str, str, Any]:
    """``(tokenizer.json text, its SHA-256, Tokenizer)`` from a local path or a URL (http(s), s3: read as a
    file, never a hub name). Raises PrepareError when it cannot be read or parsed."""
    import fsspec

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError("elastictrain data prepare needs Hugging Face tokenizers: pip install "
                           "'elastictrain[data]'") from None
    try:
        with fsspec.open(where, "rb") as f:
            data = f.read()
    except (OSError, ValueError) as e:
        raise PrepareError(f"cannot read tokenizer {where!r}: {e}; pass the path or URL of a tokenizer.json") from None
    try:
        text = data.decode("utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise PrepareError(f"unreadable tokenizer {where!r}: not a tokenizers tokenizer.json ({str(e)[:120]}); "
                           "save one with Tokenizer.save() or take tokenizer.json from a model repository") from None
    return text, hashlib.sha256(data).hexdigest(), tok


def eos_id_of(tok: Any, eos: str | None, where: str) -> int:
    """The end-of-document id: ``eos`` if given, else the first of EOS_CANDIDATES in the vocabulary."""
    names = [eos] if eos else list(EOS_CANDIDATES)
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    if eos:
        raise PrepareError(f"--eos {eos!r} is not a token of {where!r}; pass a token in its vocabulary")
    raise PrepareError(f"tokenizer {where!r} has none of the end-of-document tokens {list(EOS_CANDIDATES)}; "
                       "name its token with --eos")


def check_column(fs: Any, path: str, kind: str, column: str) -> None:
    """Fail early (on the driver) when the first file lacks the text column."""
    if kind == "text":
        return
    names = _columns(fs, path, kind)
    if names is not None and column not in names:
        raise PrepareError(f"column {column!r} not found in {path!r} (columns: {sorted(names)}); pass "
                           "--text-column NAME")


def _columns(fs: Any, path: str, kind: str) -> list[str] | None:
    if kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            return list(pq.ParquetFile(f).schema_arrow.names)
    with fs.open(path, "rb") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                return list(row) if isinstance(row, dict) else []
    return None


# ------------------------------------------------------------------------------------------- task side


def _documents(fs: Any, unit: Unit, column: str) -> list[str]:
    """The file's documents in row order (nulls and empty strings skipped)."""
    if unit.kind == "text":
        with fs.open(unit.path, "rb") as f:
            text = f.read().decode("utf-8")
        return [text] if text else []
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open(unit.path, "rb") as f:
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise PrepareError(f"column {column!r} not found in {unit.path!r} (columns: "
                                   f"{sorted(pf.schema_arrow.names)}); pass --text-column NAME")
            values = pf.read(columns=[column]).column(column).to_pylist()
    else:
        values = []
        with fs.open(unit.path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or column not in row:
                    raise PrepareError(f"line {n} of {unit.path!r} has no key {column!r}; pass --text-column NAME")
                values.append(row[column])
    docs = []
    for v in values:
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise PrepareError(f"column {column!r} of {unit.path!r} holds {type(v).__name__}, not text")
        docs.append(v)
    return docs


def in_validation(rel: str, row: int, fraction: float) -> bool:
    """Whether document ``row`` of file ``rel`` belongs to the validation split: a hash of (file, row), so the
    split does not depend on the files around it or on how the work was scheduled."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{rel}\0{row}".encode()).digest()[:8], "little")
    return h < fraction * 2.0**64


def _record_key(spec: PrepareSpec, unit: Unit) -> dict[str, Any]:
    # what made a shard: a record with another key is stale (other tokenizer, column, split rule or file)
    return {"tokenizer": spec.tokenizer_sha256, "eos_id": spec.eos_id, "column": spec.text_column,
            "val_fraction": spec.val_fraction, "source": unit.rel, "source_bytes": unit.size, "dtype": spec.dtype}


def _existing(out_fs: Any, root: str, name: str, key: dict[str, Any]) -> Shard | None:
    """The shard ``name`` if its record matches ``key`` and its bytes match the record's SHA-256."""
    record_path = join(root, name[:-4] + ".json")
    try:
        record = json.loads(out_fs.cat_file(record_path))
        if record.get("key") != key:
            return None
        shard = Shard(**record["shard"])
        data = out_fs.cat_file(join(root, name))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(data) != shard.bytes or hashlib.sha256(data).hexdigest() != shard.sha256:
        return None
    return shard


def _write(out_fs: Any, path: str, data: bytes) -> None:
    """Write whole or not at all: a local file by rename, an object store by its single PUT."""
    if _is_local(out_fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        out_fs.pipe_file(path, data)


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol


def prepare_unit(spec: PrepareSpec, unit: Unit, tokenizer: Any = None) -> dict[str, Any]:
    """Tokenize one file and write its shard(s); return ``{split: Shard fields, ...}`` plus ``skipped``.
    Pure in (spec, unit): run anywhere, any number of times, the same bytes."""
    import fsspec
    import numpy as np

    out_fs, root = fsspec.core.url_to_fs(spec.out, **spec.out_options)
    key = _record_key(spec, unit)
    splits = [unit.split] + (["validation"] if unit.split == "train" and spec.val_fraction > 0 else [])
    names = {s: shard_name(s, unit.index) for s in splits}
    done = {s: _existing(out_fs, root, n, key) for s, n in names.items()}
    if all(done.values()):
        return {"skipped": True, **{s: shard.__dict__ for s, shard in done.items()}}
    if tokenizer is None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    src_fs, _ = fsspec.core.url_to_fs(unit.path, **spec.source_options)
    docs = _documents(src_fs, unit, spec.text_column)
    dtype = numpy_dtype(spec.dtype)
    pieces: dict[str, list[np.ndarray]] = {s: [] for s in splits}
    eos = np.array([spec.eos_id], dtype=dtype)
    for lo in range(0, len(docs), 1024):  # bounded batches: a large file does not hold every Encoding at once
        for row, enc in enumerate(tokenizer.encode_batch(docs[lo:lo + 1024], add_special_tokens=False), lo):
            target = "validation" if len(splits) > 1 and in_validation(unit.rel, row, spec.val_fraction) else splits[0]
            pieces[target] += [np.asarray(enc.ids, dtype=dtype), eos]
    out: dict[str, Any] = {"skipped": False}
    for s, name in names.items():
        data = (np.concatenate(pieces[s]) if pieces[s] else np.empty(0, dtype=dtype)).tobytes()
        shard = Shard(name, len(data) // dtype.itemsize, len(data), hashlib.sha256(data).hexdigest())
        _write(out_fs, join(root, name), data)
        record = json.dumps({"key": key, "shard": shard.__dict__}, sort_keys=True).encode()
        _write(out_fs, join(root, name[:-4] + ".json"), record)  # after the shard: the record vouches for it
        out[s] = shard.__dict__
    return out


_TOKENIZERS: dict[str, Any] = {}  # per Ray worker process: the tokenizer parsed once, by its SHA-256


def _prepare_batch(batch: dict[str, Any], spec: PrepareSpec) -> dict[str, Any]:
    """The Ray Data ``map_batches`` function: one unit per batch (batch size 1). A data problem becomes an
    ``error`` result that the driver reports (exit 2), not a task failure that Ray would retry."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one CPU per task: the tokenizer's own pool stays at one
    tok = _TOKENIZERS.get(spec.tokenizer_sha256)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZERS[spec.tokenizer_sha256] = Tokenizer.from_str(spec.tokenizer_json)
    results = []
    for unit_json in batch["unit"]:
        unit = Unit(**json.loads(unit_json))
        try:
            results.append(json.dumps(prepare_unit(spec, unit, tok)))
        except PrepareError as e:
            results.append(json.dumps({"error": str(e)}))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            results.append(json.dumps({"error": f"cannot read {unit.path!r}: {type(e).__name__}: {e}"}))
    return {"unit": batch["unit"], "result": results}


# ------------------------------------------------------------------------------------------- the command


def plan_units(train: list[tuple[str, str, int, str]], val: list[tuple[str, str, int, str]]) -> list[Unit]:
    """One unit per file: the training files' indices in sorted order, then the validation source's."""
    return ([Unit("train", i, p, rel, size, kind) for i, (p, rel, size, kind) in enumerate(train)]
            + [Unit("validation", i, p, rel, size, kind) for i, (p, rel, size, kind) in enumerate(val)])


def prepare(source: str, tokenizer: str, out: str, *, text_column: str = "text", seq_len: int | None = None,
            val_fraction: float = 0.0, val_source: str | None = None, eos: str | None = None,
            storage_options: dict[str, Any] | None = None, progress: bool = True,
            local_process: bool = False, ray_address: str | None = None) -> dict[str, Any]:
    """Prepare ``source`` into ``out`` (see the module docstring); return the manifest as a dict.

    The inputs are checked before Ray starts (source, tokenizer, the first file's column). Ray is the one
    running in this process, else the cluster at ``ray_address`` / ``RAY_ADDRESS``, else a private local one.
    ``local_process=True`` runs every unit in this process, in order (no Ray: the one-process baseline of
    benchmarks/data.py); the bytes are the same. Raises PrepareError for bad input."""
    opts = dict(storage_options or {})
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1); e.g. 0.01 holds out 1% of documents")
    if val_fraction and val_source:
        raise PrepareError("--val-fraction and --val-source both given: pick one way to declare the validation split")
    tok_json, tok_sha, tok = load_tokenizer(tokenizer)
    eos_id = eos_id_of(tok, eos, tokenizer)
    fs, train = list_sources(source, opts)
    val = list_sources(val_source, opts)[1] if val_source else []
    check_column(fs, train[0][0], train[0][3], text_column)
    if not any(size for _, _, size, _ in train):
        raise PrepareError(f"empty corpus: the {len(train)} file(s) at {source!r} are empty; check SOURCE")
    spec = PrepareSpec(out=out, tokenizer_json=tok_json, tokenizer_sha256=tok_sha,
                       vocab_size=int(tok.get_vocab_size(with_added_tokens=True)), eos_id=eos_id,
                       text_column=text_column, val_fraction=val_fraction, source_options=opts, out_options=opts)
    units = plan_units(train, val)
    if local_process:
        results = [_run_one(spec, u, tok) for u in units]
    else:
        init_ray(ray_address)
        results = _run_on_ray(spec, units, progress)
    splits: dict[str, list[Shard]] = {"train": [], "validation": []}
    for unit, result in zip(units, results):
        if "error" in result:
            raise PrepareError(result["error"])
        for split in ("train", "validation"):
            if split in result:
                splits[split].append(Shard(**result[split]))
    for split in splits:
        splits[split].sort(key=lambda s: s.name)
    if not sum(s.tokens for s in splits["train"]):
        raise PrepareError(f"empty corpus: no text in column {text_column!r} of the {len(train)} file(s) at "
                           f"{source!r}; check SOURCE and --text-column")
    if seq_len is not None:
        for split, shards in splits.items():
            have = sum(s.tokens for s in shards)
            if shards and have and have < seq_len + 1:
                raise PrepareError(f"the {split} split has {have} tokens, fewer than one window of --seq-len "
                                   f"{seq_len} needs ({seq_len + 1}); prepare more text or a smaller --seq-len")
    rule = ({"kind": "fraction", "fraction": val_fraction, "by": "sha256(file, row)"} if val_fraction
            else {"kind": "source", "files": len(val)} if val_source else {"kind": "none"})
    sources = [{"split": u.split, "path": u.rel, "bytes": u.size} for u in units]
    text = manifest_json(dtype=spec.dtype, vocab_size=spec.vocab_size, eos_id=eos_id, tokenizer_sha256=tok_sha,
                         text_column=text_column, sources=sources,
                         splits={k: v for k, v in splits.items() if v and any(s.tokens for s in v)},
                         split_rule=rule, seq_len=seq_len)
    import fsspec

    out_fs, root = fsspec.core.url_to_fs(out, **opts)
    _write(out_fs, join(root, MANIFEST), text.encode())  # last: its presence means the output is complete
    manifest = json.loads(text)
    manifest["_skipped"] = sum(1 for r in results if r.get("skipped"))
    return manifest


def _run_one(spec: PrepareSpec, unit: Unit, tok: Any) -> dict[str, Any]:
    try:
        return prepare_unit(spec, unit, tok)
    except PrepareError as e:
        return {"error": str(e)}


def _run_on_ray(spec: PrepareSpec, units: list[Unit], progress: bool) -> list[dict[str, Any]]:
    """Run the units as a Ray Data job (one block and one task per unit, one CPU each); results in unit order."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ctx.execution_options.preserve_order = True  # the results come back in unit order (the shards do not care)
    items = [{"unit": json.dumps(u.__dict__, sort_keys=True)} for u in units]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    # one unit per task; a task's CPU is the tokenizer's (its own threads are limited below)
    ds = ds.map_batches(_prepare_batch, fn_kwargs={"spec": spec}, batch_size=1, num_cpus=1)
    by_unit = {row["unit"]: json.loads(row["result"]) for row in ds.take_all()}
    return [by_unit[item["unit"]] for item in items]


def init_ray(address: str | None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``) or start a private local Ray, as ``elastictrain
    run`` does. Raises PrepareError when nothing answers at the address."""
    import logging

    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as e:
            raise PrepareError(f"no Ray cluster answers at {address!r} ({str(e).split('. ')[0]}); start one or "
                               "leave --ray-address and RAY_ADDRESS unset for a local Ray") from None
    else:
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 logging_level=logging.WARNING)
