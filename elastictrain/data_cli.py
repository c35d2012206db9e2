"""``elastictrain data prepare``: the command line of :mod:`elastictrain.data.prepare` (click and the standard
library at import: ``--help`` stays fast)."""

from __future__ import annotations

import json
import os
import sys

import click


@click.group()
def data() -> None:
    """Prepare tokenized corpora for training (task.data.source)."""


@data.command()
@click.argument("source")
@click.option("--tokenizer", "tokenizer", required=True, metavar="TOK",
              help="tokenizer.json of a Hugging Face `tokenizers` tokenizer: a local path or a URL (no hub names)")
@click.option("--out", required=True, metavar="URI", help="where the shards and manifest.json go (path or s3://...)")
@click.option("--text-column", default="text", show_default=True, help="the text column (Parquet) or key (JSON lines)")
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="check that every split holds at least one window of this length")
@click.option("--val-fraction", type=float, default=0.0, show_default=True,
              help="hold out this fraction of documents (chosen by a hash of file and row) as the validation split")
@click.option("--val-source", default=None, metavar="SOURCE", help="text files that form the validation split")
@click.option("--eos", default=None, help="the end-of-document token (default: the tokenizer's <|endoftext|>, </s>, ...)")
@click.option("--storage-options", default=None, metavar="JSON", help="fsspec options for s3:// URIs, as JSON")
@click.option("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def prepare(source: str, tokenizer: str, out: str, text_column: str, seq_len: int | None, val_fraction: float,
            val_source: str | None, eos: str | None, storage_options: str | None, ray_address: str | None,
            no_progress: bool) -> None:
    """Tokenize the text files at SOURCE into token shards and a manifest at --out, on Ray Data.

    The output is a pure function of the sorted input files and the tokenizer; an interrupted prepare run
    again skips the shards it already wrote. Bad input: one line and exit 2."""
    from elastictrain.exit_codes import EXIT_CONFIG

    try:
        opts = json.loads(storage_options) if storage_options else {}
        if not isinstance(opts, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        click.echo(f"elastictrain: --storage-options is not a JSON object ({e}); e.g. "
                   "'{\"client_kwargs\": {\"endpoint_url\": \"http://...\"}}'", err=True)
        sys.exit(EXIT_CONFIG)
    from elastictrain.data.prepare import PrepareError, prepare as run_prepare
    from elastictrain.jobenv import absolute_input, ray_working_dir

    # Ray Data's tasks open SOURCE and write --out from their own directory (the one their Ray was started
    # in): relative local paths are the user's, made absolute here as `elastictrain run` does (jobenv.py)
    here, working_dir = os.getcwd(), ray_working_dir(os.environ)
    source_at, val_source_at, out_at = (absolute_input(p, cwd=here, working_dir=working_dir)
                                        for p in (source, val_source, out))
    try:
        m = run_prepare(source_at, tokenizer, out_at, text_column=text_column, seq_len=seq_len,
                        val_fraction=val_fraction, val_source=val_source_at, eos=eos, storage_options=opts,
                        progress=not no_progress, ray_address=ray_address)
    except PrepareError as e:
        click.echo(f"elastictrain: data prepare: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    splits = ", ".join(f"{k} {v['tokens']:,} tokens in {len(v['shards'])} shards" for k, v in m["splits"].items())
    reused = f"; {m['_skipped']} file(s) already prepared" if m["_skipped"] else ""
    click.echo(f"elastictrain: prepared {out}: {splits} ({m['dtype']}, vocab {m['vocab_size']}){reused}")

