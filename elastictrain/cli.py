"""Command line: ``elastictrain run JOB.yaml`` and ``elastictrain ckpt ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from elastictrain.config import ConfigError, load_config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """elastictrain: fault-tolerant distributed PyTorch training on Ray."""


@main.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set train.steps=100 (repeatable)")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where events.jsonl and summary.json go (default: runs/<name>-<timestamp>)")
@click.option("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
def run(job: Path, overrides: tuple[str, ...], run_dir: Path | None, ray_address: str | None) -> None:
    """Run the training job described by JOB (a YAML file)."""
    from elastictrain.trainer import EXIT_CHECKPOINT, EXIT_CONFIG, CheckpointUnavailable, Trainer

    try:
        config = load_config(job, list(overrides))
    except ConfigError as e:
        _die(f"config error: {e}", EXIT_CONFIG)
    try:
        result = Trainer(config, run_dir=run_dir, ray_address=ray_address).fit()
    except CheckpointUnavailable as e:
        _die(f"checkpoint error: {e}", EXIT_CHECKPOINT)
    except ConfigError as e:  # pre-flight checks on the driver, before any Ray resource
        _die(f"config error: {e}", EXIT_CONFIG)
    s = result.summary
    if result.ok:
        click.echo(f"elastictrain: finished step {s['final_step']} loss {s['final_loss']:.4f} in {s['wall_s']:.1f}s "
                   f"({s['failures']} failures); summary: {result.run_dir / 'summary.json'}")
    else:
        click.echo(f"elastictrain: {s['state']} at step {s['final_step']}: {s.get('error') or s['state']}", err=True)
    sys.exit(result.exit_code)


def _die(message: str, code: int) -> None:
    click.echo(f"elastictrain: {message}", err=True)
    sys.exit(code)


def _attach_ckpt() -> None:
    try:
        from elastictrain.checkpoint.cli import ckpt
    except ImportError:  # pragma: no cover - checkpoint package always ships
        return
    main.add_command(ckpt)


_attach_ckpt()
