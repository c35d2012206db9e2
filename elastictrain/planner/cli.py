"""``elastictrain plan JOB.yaml``: rank the layouts for the job on a cluster and say why the winner won.

The cluster: the flags' figures over what Ray sees (when connected: ``--ray-address``/``RAY_ADDRESS``)
or this machine (without an address: no Ray is started, see :mod:`.cluster`), with the measured figures of
``parallel.calibration`` (or ``--calibration``) on top. The world size: the cluster's devices when
``--nodes``/``--gpus-per-node`` describe it, else ``min(workers.max, devices)`` as a run would start;
``--world`` sets it. Exit codes: 0 (a table; ``fits: false`` rows when nothing fits), 2 (bad input: one
line naming it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from elastictrain.exit_codes import EXIT_CONFIG


def _die(message: str) -> None:
    click.echo(f"elastictrain: {message}", err=True)
    sys.exit(EXIT_CONFIG)


@click.command("plan")
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config key (repeatable)")
@click.option("--nodes", type=int, default=None, help="nodes in the cluster to plan for")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node")
@click.option("--gpu-memory-gb", type=float, default=None, help="memory per GPU, GiB")
@click.option("--intra-node-gbps", type=float, default=None, help="per-device bandwidth inside a node, GB/s")
@click.option("--inter-node-gbps", type=float, default=None, help="per-device bandwidth across nodes, GB/s")
@click.option("--tflops", type=float, default=None, help="achieved matmul rate per device, TFLOP/s")
@click.option("--shape", default=None, metavar="K=V,...",
              help="model shape for python tasks: layers=,hidden=,heads=,seq_len=,vocab= (or params=)")
@click.option("--world", type=int, default=None, help="world size to plan (default: see `elastictrain plan -h`)")
@click.option("--top", type=int, default=10, show_default=True, help="rows of the table")
@click.option("--all-axes", is_flag=True, help="search every axis: context parallel (cp) too, and layouts "
                                              "elastictrain cannot run yet (marked)")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="measured figures to plan with (default: parallel.calibration)")
@click.option("--calibrate", is_flag=True, help="measure this cluster first (matmul rate, all-reduce bandwidth)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="with --calibrate: where to write the figures (default: calibration.json)")
@click.option("--ray-address", default=None, help="describe this Ray cluster (default: RAY_ADDRESS; none: "
                                                  "this machine)")
@click.option("--json", "as_json", is_flag=True, help="print the ranked list as JSON, best first")
def plan(job: Path, overrides: tuple[str, ...], nodes: int | None, gpus_per_node: int | None,
         gpu_memory_gb: float | None, intra_node_gbps: float | None, inter_node_gbps: float | None,
         tflops: float | None, shape: str | None, world: int | None, top: int, all_axes: bool,
         calibration: Path | None, calibrate: bool, out: Path | None, ray_address: str | None,
         as_json: bool) -> None:
    """Rank the parallel layouts of JOB (a YAML file) by predicted step time, with their memory per device.

    Without --nodes/--gpus-per-node the world size is min(workers.max, the devices of the cluster) as a run
    would start; with them, every device of the described cluster."""
    from elastictrain.config import ConfigError, load_config
    from elastictrain.planner import PlannerInputError, explain
    from elastictrain.planner import cluster as clusters
    from elastictrain.planner.job import configured, job_plan

    try:
        config = load_config(job, list(overrides))
        base = _observed(config, ray_address)
        if calibrate:
            from elastictrain.planner.calibrate import calibrate as measure, write

            probe = config.model_dump(mode="json") if config.task.kind != "python" else None
            figures = measure(config.workers.use_gpu, base.nodes, max(1, int(config.workers.cpus_per_worker)),
                              probe, ranks=world)
            target = out or Path("calibration.json")
            write(figures, target)
            if not as_json:
                click.echo(f"elastictrain: calibration written to {target}: {json.dumps(figures)}")
            calibration = target
        calibration = calibration or (Path(config.parallel.calibration) if getattr(
            config.parallel, "calibration", None) else None)
        if calibration is not None:
            base = clusters.with_calibration(base, calibration)
        cl = clusters.with_flags(base, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb,
                                 intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps, tflops=tflops)
        described = nodes is not None or gpus_per_node is not None
        w = world or (cl.devices if described else min(config.workers.max, cl.devices))
        if w < 1:
            raise PlannerInputError(f"--world must be positive, got {w}")
        ranked = job_plan(config, cl, w, shape, runnable_only=not all_axes)
        mine = configured(config, cl, w, shape)
    except (ConfigError, PlannerInputError, clusters.ClusterError) as e:
        _die(f"plan: {e}")
        return
    if as_json:
        click.echo(json.dumps([e.as_dict() for e in ranked], indent=1))
        return
    click.echo(f"cluster: {clusters.describe(cl)}")
    if not cl.device_known:
        click.echo("note: the GPUs' type is unknown, so their memory above is a default: pass --gpu-memory-gb "
                   "(and --tflops) or --calibration for figures that hold")
    click.echo(f"world size {w}: {len(ranked)} layouts priced, {sum(e.fits for e in ranked)} fit")
    if ranked:
        click.echo(explain.table(ranked, cl, top))
    click.echo(explain.why(ranked, cl) if ranked else
               "no layout is valid at this world size: global_batch must be a multiple of the data-parallel "
               "size x micro_batch; try --world or other batch sizes")
    if mine is not None and ranked:
        at = next((i for i, e in enumerate(ranked, 1) if e.candidate == mine.candidate), None)
        ratio = mine.time.total_s / ranked[0].time.total_s if ranked[0].time.total_s else 1.0
        click.echo(f"this job's layout ({mine.candidate.describe()}): "
                   + (f"#{at}" if at else "not among the pruned candidates") + f", {ratio:.2f}x the winner's "
                   f"step time, {explain.gib(mine.memory.total)} per device"
                   + ("" if mine.fits else f", does NOT fit (short by {explain.gib(mine.memory.shortfall)})"))


def _observed(config, ray_address: str | None):  # noqa: ANN001, ANN202 - JobConfig in, Cluster out
    """What Ray sees when connected or given an address, else this machine (no Ray is started)."""
    from elastictrain.planner import cluster as clusters

    w = config.workers
    address = ray_address or os.environ.get("RAY_ADDRESS")
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        ray = None
    if ray is not None and (ray.is_initialized() or address):
        if not ray.is_initialized():
            import logging

            from elastictrain.config import ConfigError
            from elastictrain.preflight import check_ray_address, unreachable_ray

            where = "--ray-address" if ray_address else "RAY_ADDRESS"
            check_ray_address(address, where)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except ConnectionError as e:
                raise ConfigError(unreachable_ray(address, where, str(e).split(". ")[0])) from None
        return clusters.from_ray(w.use_gpu, w.cpus_per_worker)
    return clusters.this_machine(w.use_gpu, w.cpus_per_worker)
