"""``elastictrain ckpt ...``: inspect, verify, export and sign checkpoints.

URI is either a run root (``<checkpoint.uri>/<run id>``: lists its steps) or one step directory.
Storage options (e.g. an S3 endpoint) come as ``--option key=value`` (values parsed as JSON when they
parse, dotted keys nest: ``--option client_kwargs.endpoint_url=http://...``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import Manifest, parse_step_dir
from elastictrain.checkpoint.store import CheckpointStore


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: expected key=value", param_hint="--option")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _split(uri: str) -> tuple[str, int | None]:
    """(run root, step) for a step dir (or its manifest); (uri, None) for a run root."""
    uri = uri.rstrip("/").removesuffix("/manifest.json")
    parent, _, name = uri.rpartition("/")
    step = parse_step_dir(name)
    return (parent, step) if step is not None and parent else (uri, None)


def _open(uri: str, option: tuple[str, ...]) -> tuple[CheckpointStore, int | None]:
    root, step = _split(uri)
    return CheckpointStore(root, _options(option)), step


def _fail(e: CheckpointError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


_option = click.option("--option", "-o", multiple=True, help="storage option key=value (repeatable)")


@click.group("ckpt")
def ckpt() -> None:
    """Inspect, verify, export and sign elastictrain checkpoints."""


@ckpt.command("ls")
@click.argument("uri")
@_option
def ls_cmd(uri: str, option: tuple[str, ...]) -> None:
    """List the committed checkpoints (and uncommitted step dirs) under a run root (exit 2 if it has none)."""
    try:
        store, _ = _open(uri, option)
        good, bad = store._scan()
        if not good and not bad:  # a typo'd path must not read as "a run with no checkpoints yet"
            raise CheckpointError(f"{uri}: no checkpoint here (nothing saved under this path); a run root is "
                                  "<checkpoint.uri>/<run id>, e.g. ./checkpoints/tiny_gpt")
    except CheckpointError as e:
        _fail(e)
    click.echo(f"{'step':>10}  {'ranks':>5}  {'bytes':>12}  status")
    rows = {m.step: f"{m.step:>10}  {m.world_size:>5}  {m.total_bytes:>12}  committed" for m in good}
    rows.update({s: f"{s:>10}  {'-':>5}  {'-':>12}  {why}" for s, why in bad.items()})
    for step in sorted(rows):
        click.echo(rows[step])


def _manifest_for(uri: str, option: tuple[str, ...]) -> tuple[CheckpointStore, Manifest]:
    store, step = _open(uri, option)
    if step is None:
        found = store.committed()
        if not found:
            raise CheckpointError(f"{uri}: no committed checkpoint here")
        return store, found[-1]
    try:
        return store, store.read_manifest(step)
    except FileNotFoundError:
        raise CheckpointError(f"{store.step_uri(step)}: no manifest.json (not a committed checkpoint)") from None


@ckpt.command("show")
@click.argument("uri")
@_option
def show_cmd(uri: str, option: tuple[str, ...]) -> None:
    """Print the manifest of one checkpoint (the newest if URI is a run root)."""
    try:
        store, manifest = _manifest_for(uri, option)
    except CheckpointError as e:
        _fail(e)
    click.echo(manifest.to_json(store.key))


@ckpt.command("verify")
@click.argument("uri")
@_option
def verify_cmd(uri: str, option: tuple[str, ...]) -> None:
    """Check sizes and SHA-256 of a checkpoint's files; exit 1 listing the problems."""
    try:
        store, manifest = _manifest_for(uri, option)
        problems = store.verify(manifest)
    except CheckpointError as e:
        _fail(e)
    if problems:
        for p in problems:
            click.echo(f"BAD  {p}", err=True)
        sys.exit(1)
    click.echo(f"OK   {manifest.location}: {len(manifest.files)} files, {manifest.total_bytes} bytes")


@ckpt.command("export")
@click.argument("uri")
@click.option("--out", "out", required=True, type=click.Path(),
              help="file to write (hf: a new or empty directory)")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", "hf"]), default="torch", show_default=True,
              help="hf: a Hugging Face model directory (config.json + safetensors) of a task.kind: llama run")
@click.option("--key", default="model", show_default=True, help="top-level entry to export")
@_option
def export_cmd(uri: str, out: str, fmt: str, key: str, option: tuple[str, ...]) -> None:
    """Consolidate the full model state of a checkpoint into one file, or (--format hf) a Hugging Face
    model directory that transformers' from_pretrained loads."""
    from elastictrain.checkpoint.export import export_state

    try:
        store, manifest = _manifest_for(uri, option)
        problems = store.verify(manifest)
        if problems:
            raise CheckpointError(f"{manifest.location} is damaged, not exporting: " + "; ".join(problems))
        n = export_state(manifest, out, fmt, key, store.storage_options)
    except CheckpointError as e:
        _fail(e)
    click.echo(f"wrote {n} tensors from {manifest.location} to {out} ({fmt})")


@ckpt.command("sign")
@click.argument("uri")
@click.option("--previous-key-env", metavar="NAME", default=None,
              help="environment variable holding the key the checkpoints are signed with now (key rotation)")
@_option
def sign_cmd(uri: str, previous_key_env: str | None, option: tuple[str, ...]) -> None:
    """Sign one checkpoint (or every committed one under a run root) under ELASTICTRAIN_CHECKPOINT_KEY, after
    hashing its files: for a rotated key (--previous-key-env) or checkpoints written before signing was on.
    Exit 1 listing the ones it refused."""
    import os

    from elastictrain.checkpoint.resign import sign_step
    from elastictrain.checkpoint.signing import KEY_ENV, key_from_env

    key = key_from_env()
    if key is None:
        _fail(CheckpointError(f"{KEY_ENV} is not set: it holds the key to sign with (docs/config.md)"))
    previous = None
    if previous_key_env is not None:
        previous = os.environ.get(previous_key_env, "").encode() or None
        if previous is None:
            _fail(CheckpointError(f"--previous-key-env {previous_key_env}: that environment variable is not set "
                                  "or empty; export the key the checkpoints are signed with now under that name"))
    refused = 0
    try:
        root, step = _split(uri)
        store = CheckpointStore(root, _options(option), key=None)  # each manifest's signature is judged below
        if step is None:
            steps = [m.step for m in store.committed()]
            for bad, why in sorted(store.refused().items()):
                click.echo(f"BAD  {store.step_uri(bad)}: {why}", err=True)
                refused += 1
            if not steps and not refused:
                raise CheckpointError(f"{uri}: no committed checkpoint here")
        else:
            steps = [step]
        for s in steps:
            decision = sign_step(store, s, key, previous)
            if decision.action == "refuse":
                refused += 1
                click.echo(f"BAD  {store.step_uri(s)}: {decision.reason}", err=True)
            else:
                click.echo(f"{'SIGNED' if decision.action == 'sign' else 'OK':<6} {store.step_uri(s)}: {decision.reason}")
    except CheckpointError as e:
        _fail(e)
    if refused:
        sys.exit(1)
