"""Command line: ``elastictrain run JOB.yaml``, ``elastictrain plan JOB.yaml``, ``elastictrain ckpt ...`` and
``elastictrain data prepare ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from elastictrain import __version__
from elastictrain.config import ConfigError, load_config
from elastictrain.exit_codes import EXIT_CHECKPOINT, EXIT_CONFIG


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="elastictrain", message="%(prog)s %(version)s")
def main() -> None:
    """elastictrain: fault-tolerant distributed PyTorch training on Ray."""


@main.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set train.steps=100 (repeatable)")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="where events.jsonl and summary.json go (default: runs/<name>-<timestamp>)")
@click.option("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
def run(job: Path, overrides: tuple[str, ...], run_dir: Path | None, ray_address: str | None) -> None:
    """Run the training job described by JOB (a YAML file)."""
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        _die(f"--run-dir {run_dir} is a file, not a directory; name a directory (it is created when missing)",
             EXIT_CONFIG)
    try:
        config = load_config(job, list(overrides))
        config = _prepare(config)
    except ConfigError as e:  # before torch is imported: a typo costs half a second, not three
        _die(f"config error: {e}", EXIT_CONFIG)
    from elastictrain.trainer import CheckpointUnavailable, RunDirInUse, Trainer

    try:
        # The task is built (and a python task's entry checked: ConfigError, exit 2) by Trainer, before Ray.
        result = Trainer(config, run_dir=run_dir, ray_address=ray_address).fit()
    except CheckpointUnavailable as e:
        _die(f"checkpoint error: {e}", EXIT_CHECKPOINT)
    except RunDirInUse as e:
        _die(str(e), EXIT_CONFIG)
    except ConfigError as e:  # pre-flight checks on the driver, before any Ray resource
        _die(f"config error: {e}", EXIT_CONFIG)
    s = result.summary
    if s.get("already_finished"):
        pass  # the trainer printed "run ... already finished at step ..."; nothing ran, nothing to sum up
    elif result.ok:
        loss = "n/a" if s.get("final_loss") is None else f"{s['final_loss']:.4f}"
        click.echo(f"elastictrain: finished step {s['final_step']} loss {loss} in {s['wall_s']:.1f}s "
                   f"({s['failures']} failures); summary: {result.run_dir / 'summary.json'}")
    else:
        click.echo(f"elastictrain: {s['state']} at step {s['final_step']}: {s.get('error') or s['state']}", err=True)
    sys.exit(result.exit_code)


def _prepare(config):  # noqa: ANN001, ANN202 - JobConfig in, JobConfig out
    """Edge decisions before any Ray resource: run id (ELASTICTRAIN_RUN_ID) and checkpoint URI."""
    import os

    from elastictrain.jobenv import resolve_for_driver

    config, notes = resolve_for_driver(config, os.environ)
    for note in notes:
        click.echo(f"elastictrain: {note}", err=True)
    return config


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="the HTML file to write (default: RUN_DIR/report.html; the PNG goes beside it)")
@click.option("--no-png", is_flag=True, help="skip the PNG (it needs a headless Chromium)")
def report(run_dir: Path, out: Path | None, no_png: bool) -> None:
    """Write RUN_DIR/report.html (self-contained) and report.png: loss, throughput, workers, checkpoints."""
    if not (run_dir / "events.jsonl").is_file():  # checked here: one line, not click's usage block
        what = "does not exist" if not run_dir.exists() else "is not a run directory (no events.jsonl in it)"
        _die(f"report: {run_dir} {what}; pass the --run-dir of a run (default runs/<name>-<timestamp>)",
             EXIT_CONFIG)
    from elastictrain.report import write_report

    written = write_report(run_dir, out, png=not no_png)
    for kind, path in written.items():
        click.echo(f"elastictrain: {kind} {path}")


def _die(message: str, code: int) -> None:
    click.echo(f"elastictrain: {message}", err=True)
    sys.exit(code)


def _attach_ckpt() -> None:
    try:
        from elastictrain.checkpoint.cli import ckpt
    except ImportError:  # pragma: no cover - checkpoint package always ships
        return
    main.add_command(ckpt)


def _attach_plan() -> None:
    from elastictrain.planner.cli import plan  # click and the standard library only: --help stays fast

    main.add_command(plan)


def _attach_data() -> None:
    from elastictrain.data_cli import data  # not under elastictrain.data (torch at import): --help stays fast

    main.add_command(data)


_attach_ckpt()
_attach_plan()
_attach_data()
