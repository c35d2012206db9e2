"""The Python API: ``Trainer(config, task).fit()`` runs a job on Ray and returns its summary."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from elastictrain import __version__, ray_console
from elastictrain.config import ConfigError, JobConfig, build_config, load_config
from elastictrain.events import EventLog, write_summary
from elastictrain.exit_codes import EXIT_OK
from elastictrain.local_ray import (  # noqa: F401 - re-exported: the tests and benchmarks import them here
    WORKER_PRELOAD_MODULES, init_local_ray, local_ray_system_config)
from elastictrain.metrics import RunMetrics
from elastictrain.task import Task
from elastictrain.task_loader import task_from_config


class CheckpointUnavailable(RuntimeError):
    """The configured resume checkpoint cannot be used (message says why and what to do)."""


class RunDirInUse(ValueError):
    """``run_dir`` already holds a run's ``events.jsonl``: a second run would append to the first's log."""


@dataclass(frozen=True)
class RunResult:
    summary: dict[str, Any]
    run_dir: Path
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK


def default_run_dir(config: JobConfig, base: str | Path = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{config.name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{config.name}-{stamp}-{n}"
    return path


class Trainer:
    """Run a job: ``Trainer(config, task=None).fit()``.

    ``config`` is a :class:`JobConfig`, a path to a YAML job file, or a mapping. ``task`` is a
    :class:`Task`; ``None`` uses the built-in task named in ``config.task``. ``ray_address`` is passed to
    ``ray.init`` when Ray is not initialised yet (``None``: ``RAY_ADDRESS`` or a new local Ray).
    """

    def __init__(self, config: JobConfig | str | Path | dict, task: Task | None = None, *,
                 run_dir: str | Path | None = None, console: TextIO | None = sys.stdout,
                 ray_address: str | None = None) -> None:
        if isinstance(config, (str, Path)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = build_config(config)
        self.config: JobConfig = config
        # Pre-flight checks of task.data apply to the built-in task only (a python task brings its own data).
        self._builtin_task = task is None and config.task.kind != "python"
        self.task = task or task_from_config(config)  # ConfigError before any Ray resource
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(config)
        self.console = console
        self.ray_address = ray_address
        self.controller: Any = None

    def fit(self) -> RunResult:
        """Run the job. Raises ConfigError (pre-flight: e.g. a local data path that does not exist, GPUs asked
        of a local Ray on a machine without them, a Ray address where nothing answers, parallel.float8 on a
        cluster whose GPUs all lack it), RunDirInUse (a reused run directory) and CheckpointUnavailable (exit
        3) before any Ray resource is requested."""
        from elastictrain.preflight import check_job, check_local_gpus

        if (self.run_dir / "events.jsonl").exists():
            raise RunDirInUse(f"run directory {self.run_dir} already holds a run (events.jsonl); a second run "
                              "would mix its events with the first's: pass a new --run-dir or leave it out "
                              "(default: runs/<name>-<timestamp>)")
        check_job(self.config, builtin_task=self._builtin_task)
        if not self._builtin_task:  # a user model under parallel.cp needs the hook (the built-in ones have it)
            from elastictrain.parallel.context_wiring import check_task

            check_task(self.config, self.task)
        if self.config.workers.use_gpu and self._private_local_ray():  # (only then ask CUDA anything here)
            import torch

            check_local_gpus(self.config, torch.cuda.device_count())
        plan = self._resolve_resume()  # before any Ray resource is requested
        if plan.finished:
            return self._already_finished(plan)
        if plan.run_id != self.config.stable_id:
            self.config = self.config.model_copy(update={"run_id": plan.run_id})
        self._init_ray()  # an unreachable cluster is a config error: no run directory is left behind
        planned = None
        if self.config.parallel.plan == "auto":  # the cluster is known now; ConfigError when nothing fits
            from elastictrain.planner.job import plan_for_run

            self.config, planned = plan_for_run(self.config, self._builtin_task)
        if self.config.workers.use_gpu and self.config.parallel.float8:  # the cluster's GPU types are known now
            from elastictrain.controller.controller import gpu_types
            from elastictrain.preflight import check_float8_gpus

            check_float8_gpus(self.config, gpu_types())
        if self.config.workers.use_gpu and self.config.parallel.plan == "hsdp":  # a node's GPUs are known now
            from elastictrain.controller.controller import gpus_per_node
            from elastictrain.preflight import check_plan_on_gpus

            check_plan_on_gpus(self.config, gpus_per_node())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ray_console.install()  # Ray's paragraph on each dead worker goes to ray_errors.log, not the console
        ray_console.set_run_dir(self.run_dir)
        events = EventLog(self.run_dir, console=self.console, log_every=self.config.train.log_every)
        tb = _tensorboard(self.run_dir, events)
        events.listeners.append(RunMetrics(self.config.stable_id))  # Prometheus, through Ray's metrics agent
        if self.console is not None:
            print(f"elastictrain: run directory {self.run_dir}", file=self.console, flush=True)
            if plan.note:
                print(f"elastictrain: {plan.note}", file=self.console, flush=True)
            if planned is not None:
                print(f"elastictrain: parallel.plan=auto: {planned.reason}", file=self.console, flush=True)
        events.emit("run_started", name=self.config.name, version=__version__, run_id=self.config.stable_id,
                    run_dir=str(self.run_dir),
                    workers_min=self.config.workers.min, workers_max=self.config.workers.max,
                    plan=self.config.parallel.plan, steps=self.config.train.steps,
                    global_batch=self.config.train.global_batch, checkpoint_uri=self.config.checkpoint.uri,
                    checkpoint_root=plan.root_uri, lineage=plan.lineage, note=plan.note,
                    planned=planned.as_event() if planned is not None else None)
        from elastictrain.controller.controller import Controller

        self.controller = Controller(self.config, self.task, events, store=plan.store,
                                     resume_manifest=plan.manifest, resume_plan=plan, planned=planned)
        self.controller.final_model_root = str(self.run_dir.resolve() / "final_model")
        restore = _install_signal_handlers(self.controller)
        try:
            summary = self.controller.run()
        finally:
            restore()
        summary.update(version=__version__, run_id=self.config.stable_id, checkpoint_root=plan.root_uri,
                       lineage=plan.lineage)
        write_summary(self.run_dir, summary)
        events.emit("run_finished", version=__version__, state=summary["state"], final_step=summary["final_step"],
                    final_loss=summary["final_loss"], wall_s=summary["wall_s"], exit_code=summary["exit_code"])
        if tb is not None:
            tb.close()
        events.close()
        return RunResult(summary, self.run_dir, summary["exit_code"])

    def _resolve_resume(self) -> Any:
        from elastictrain.checkpoint import CheckpointError
        from elastictrain.checkpoint.resume import plan_resume

        try:
            return plan_resume(self.config, self.task.lr_fn, self._builtin_task)
        except CheckpointError as e:
            raise CheckpointUnavailable(str(e)) from None

    def _already_finished(self, plan: Any) -> RunResult:
        """Nothing to run: the checkpoint is at or past ``train.steps``. No run directory, no Ray."""
        m = plan.manifest
        message = (f"run {plan.run_id} already finished at step {m.step} from checkpoint {m.location}; "
                   "to train again use a new run_id or --set checkpoint.resume=never")
        if self.console is not None:
            print(f"elastictrain: {message}", file=self.console, flush=True)
        summary = {"version": __version__, "state": "finished", "already_finished": True, "message": message,
                   "final_step": m.step,
                   "final_loss": None, "wall_s": 0.0, "failures": 0, "exit_code": EXIT_OK, "run_id": plan.run_id,
                   "checkpoint": m.location, "checkpoint_root": plan.root_uri, "lineage": plan.lineage}
        return RunResult(summary, self.run_dir, EXIT_OK)

    def _private_local_ray(self) -> bool:
        """True when :meth:`_init_ray` will start a Ray of its own on this machine (no address given, none
        initialised): what it can place is this machine's, for good."""
        import ray

        return not ray.is_initialized() and not self._address()

    def _address(self) -> str | None:
        return self.ray_address or os.environ.get("RAY_ADDRESS")

    def _init_ray(self) -> None:
        """Connect to the cluster (``--ray-address``/``RAY_ADDRESS``) or start a local Ray. Raises ConfigError
        when nothing answers at the address (one line, exit 2), instead of Ray's traceback or endless wait."""
        import ray

        from elastictrain.preflight import check_ray_address, unreachable_ray

        if ray.is_initialized():
            return
        address = self._address()
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
        if address:
            where = "--ray-address" if self.ray_address else "RAY_ADDRESS"
            check_ray_address(address, where)
            try:
                ray.init(address=address, **kwargs)
            except ConnectionError as e:  # e.g. `auto` with no Ray running here, or a GCS that does not answer
                raise ConfigError(unreachable_ray(address, where, str(e).split(". ")[0])) from None
        else:
            w = self.config.workers
            cpus = max(os.cpu_count() or 1, int(w.max * w.cpus_per_worker + 0.999))
            # A private local Ray: never attach by accident to another instance on this machine
            # (`--ray-address auto` does that on purpose).
            init_local_ray(cpus, **kwargs)  # tuned for a small machine: elastictrain/local_ray.py


def _tensorboard(run_dir: Path, events: EventLog) -> Any:
    """TensorBoard scalars of each ``step`` event (``train/loss``, ``train/samples_per_s``,
    ``train/world_size``) under ``run_dir/tensorboard``. One event record per step holds the step's three
    values, built straight as the summary protocol message: the driver's CPU per step event is taken from the
    workers' cores, and ``SummaryWriter.add_scalar`` cost three records (each checksummed in Python) and a
    numpy round trip per value."""
    try:
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary
    except ImportError:  # optional: the run works without it
        return None
    writer = FileWriter(str(run_dir / "tensorboard"))

    def on_event(record: dict[str, Any]) -> None:
        if record["event"] == "step":
            values = [Summary.Value(tag="train/samples_per_s", simple_value=float(record["samples_per_s"])),
                      Summary.Value(tag="train/world_size", simple_value=float(record["world_size"]))]
            if record["loss"] is not None:  # a skipped (non-finite) step has none
                values.insert(0, Summary.Value(tag="train/loss", simple_value=float(record["loss"])))
            writer.add_summary(Summary(value=values), record["step"])

    events.listeners.append(on_event)
    return writer


def _install_signal_handlers(controller: Any) -> Any:
    """SIGTERM (``ray job stop``, Kubernetes) and SIGINT: stop at a step boundary, checkpoint, exit 75."""
    previous = {}

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if controller.preempt_reason and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        controller.request_preemption(f"received {name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


__all__ = ["Trainer", "RunResult", "ConfigError", "CheckpointUnavailable", "RunDirInUse"]
