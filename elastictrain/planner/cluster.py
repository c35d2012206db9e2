"""The cluster the planner prices: from command-line figures, from the Ray cluster a driver is connected to,
or from this machine, with measured figures (:mod:`.calibrate`) on top when a calibration file is named.

Devices are what a worker takes: one GPU with ``workers.use_gpu``, else ``workers.cpus_per_worker`` CPUs
(a CPU worker process is a device then, and a node's memory is shared by its workers). Figures nothing
measured come from :data:`GPU_DEFAULTS` / :data:`CPU_DEFAULTS` (an H100-class GPU node; a CPU process
running gloo) and are labelled as such in :attr:`Cluster.source`.

``elastictrain plan`` does not start Ray to describe this machine (a local Ray would see exactly what this
module reads from the OS, seconds later); it asks Ray only when connected or given an address.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from elastictrain.planner.inputs import GB, GIB, Cluster, PlannerInputError

# optimizer_s_per_param: fused AdamW reads and writes ~32 bytes a parameter at ~3 TB/s; CPU: the per-tensor
# loop and the gradient norm of one thread. call_s on CPU: a gloo call among processes that share cores.
# dtensor_op_s: DTensor's dispatch of one op (its C++ fast path with a cached sharding, tens of us of host
# time; an assumption until `--calibrate` measures it on CPU). fsdp_param_s: FSDP2's host work per parameter
# tensor and micro-batch (on GPUs an assumption, tens of us of Python per tensor; on CPU the default is what
# `--calibrate` measured over pairs of gloo processes on the development machine). gloo_byte_s: the CPU a
# gloo process spends per byte it moves (the CPU default likewise `--calibrate`'s, 4 MiB all-reduces between
# computes); GPUs: none (NCCL's work is not the host's). Where the CPU defaults came from:
# docs/perf/2026-11-23-code-figures.md.
GPU_DEFAULTS = dict(device_memory=80 * GIB, flops=400e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB,
                    runtime_bytes=1.5 * GIB, fragmentation=0.10, overlap=0.8, latency_s=20e-6, call_s=0.0,
                    dtensor_op_s=20e-6, fsdp_param_s=20e-6, gloo_byte_s=None, optimizer_s_per_param=1e-11,
                    cores_per_node=None,
                    kind="gpu")
CPU_DEFAULTS = dict(flops=30e9, intra_node_bw=2 * GB, inter_node_bw=1 * GB, runtime_bytes=0.45 * GIB,
                    fragmentation=0.05, overlap=0.1, latency_s=100e-6, call_s=1e-3, dtensor_op_s=30e-6,
                    fsdp_param_s=200e-6, gloo_byte_s=7.5e-10, optimizer_s_per_param=1e-8, kind="cpu")


class ClusterError(ValueError):
    """A cluster description that cannot be used (a bad flag value, a calibration file that does not read)."""


def _memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# The share of a GPU's dense bf16 peak a training step's matmuls are planned at (GPU_DEFAULTS' 400 TFLOP/s
# on an H100's 989): a planning assumption until a calibration measures the cluster.
PLANNED_SHARE_OF_PEAK = 0.4


def _gpu_figures(name: str | None) -> dict[str, Any] | None:
    """GPU_DEFAULTS with a known device's memory and planned FLOP/s (:mod:`elastictrain.devices`)."""
    from elastictrain.devices import lookup

    device = lookup(name)
    if device is None:
        return None
    return {**GPU_DEFAULTS, "device_memory": device.memory, "flops": device.bf16_flops * PLANNED_SHARE_OF_PEAK}


def this_machine(use_gpu: bool, cpus_per_worker: float = 1.0) -> Cluster:
    """One node: this machine's GPUs (torch's count, name and memory) or its CPUs as worker processes."""
    if use_gpu:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count():
            props = torch.cuda.get_device_properties(0)
            base = {**(_gpu_figures(props.name) or GPU_DEFAULTS), "device_memory": float(props.total_memory)}
            return Cluster(nodes=1, devices_per_node=torch.cuda.device_count(), **base,
                           source=f"this machine ({torch.cuda.device_count()} x {props.name}; "
                                  "speeds: the device table's)")
        return Cluster(nodes=1, devices_per_node=1, **GPU_DEFAULTS, device_known=False,
                       source="this machine has no GPU: one default GPU assumed")
    cpus = os.cpu_count() or 1
    workers = max(1, int(cpus // cpus_per_worker))
    return Cluster(nodes=1, devices_per_node=workers, device_memory=_memory_bytes() / workers, **CPU_DEFAULTS,
                   cores_per_node=cpus / cpus_per_worker,
                   source=f"this machine ({cpus} CPUs, {_memory_bytes() / GIB:.0f} GiB; speeds: defaults)")


def from_ray(use_gpu: bool, cpus_per_worker: float = 1.0) -> Cluster:
    """The Ray cluster this process is connected to: its alive nodes and their GPUs (or CPUs as workers).
    Nodes differ in size: the smallest worker node sets ``devices_per_node``."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if use_gpu:
        return gpu_cluster([n["Resources"] for n in nodes])
    sized = [(int(n["Resources"].get("CPU", 0) // cpus_per_worker), n["Resources"].get("memory", 0.0),
              n["Resources"]["CPU"]) for n in nodes if n["Resources"].get("CPU", 0) >= cpus_per_worker]
    if not sized:
        raise ClusterError(f"no Ray node has workers.cpus_per_worker={cpus_per_worker} CPUs")
    per = min(w for w, _, _ in sized)
    mem = min(m / w for w, m, _ in sized)
    cores = min(c for _, _, c in sized) / cpus_per_worker
    return Cluster(nodes=len(sized), devices_per_node=per, device_memory=mem, **CPU_DEFAULTS, cores_per_node=cores,
                   source=f"Ray: {len(sized)} nodes of >= {per} CPU workers (speeds: defaults)")


def gpu_cluster(resources: list[dict[str, float]]) -> Cluster:
    """The GPU nodes among Ray nodes' ``resources``: their count, the smallest node's GPUs, and the device
    from Ray's ``accelerator_type:NAME`` resource (the smallest memory and slowest peak when node types
    differ). A type the device table does not know, or none, gives :data:`GPU_DEFAULTS` with
    ``device_known=False``: ``plan: auto`` refuses to size memory from a guess."""
    gpu_nodes = [r for r in resources if r.get("GPU", 0) >= 1]
    if not gpu_nodes:
        raise ClusterError("the Ray cluster has no GPU node and workers.use_gpu=true; pass --nodes and "
                           "--gpus-per-node to plan for a cluster you do not have, or use_gpu=false")
    counts = [int(r["GPU"]) for r in gpu_nodes]
    types = sorted({k.split(":", 1)[1] for r in gpu_nodes for k in r if k.startswith("accelerator_type:")})
    figures = [_gpu_figures(t) for t in types]
    if types and all(figures):
        base = {**GPU_DEFAULTS, "device_memory": min(f["device_memory"] for f in figures),
                "flops": min(f["flops"] for f in figures)}
        return Cluster(nodes=len(counts), devices_per_node=min(counts), **base,
                       source=f"Ray: {len(counts)} GPU nodes of {'/'.join(types)} (memory and peak: the "
                              "device table; speeds: defaults)")
    what = f"accelerator_type {'/'.join(types)}, not in the device table" if types else "no accelerator_type"
    return Cluster(nodes=len(counts), devices_per_node=min(counts), **GPU_DEFAULTS, device_known=False,
                   source=f"Ray: {len(counts)} GPU nodes ({what}; memory and speeds: defaults)")


def unknown_device_refusal(c: Cluster) -> str | None:
    """Why a cluster cannot be planned for automatically (its GPUs' memory is a guess), or None."""
    if c.device_known:
        return None
    return (f"parallel.plan=auto cannot size a layout for GPUs of unknown type ({c.source}): set "
            "parallel.calibration to a file written on this cluster by `elastictrain plan JOB --calibrate`, or "
            "plan with `elastictrain plan JOB --gpu-memory-gb N` and set that layout in parallel.*")


def with_flags(base: Cluster, *, nodes: int | None = None, gpus_per_node: int | None = None,
               gpu_memory_gb: float | None = None, intra_node_gbps: float | None = None,
               inter_node_gbps: float | None = None, tflops: float | None = None) -> Cluster:
    """``base`` with the command line's figures in place (bandwidths in GB/s, memory in GiB). A GPU figure
    on a CPU description switches to :data:`GPU_DEFAULTS` for the figures not given."""
    given = {k: v for k, v in dict(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb,
                                   intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps,
                                   tflops=tflops).items() if v is not None}
    for k, v in given.items():
        if isinstance(v, bool) or not v > 0:
            raise ClusterError(f"--{k.replace('_', '-')} must be positive, got {v}")
    if not given:
        return base
    if base.kind == "cpu" and (gpus_per_node or gpu_memory_gb):
        base = replace(base, **GPU_DEFAULTS, devices_per_node=1)
    changes: dict[str, Any] = {}
    if nodes:
        changes["nodes"] = int(nodes)
    if gpus_per_node:
        changes["devices_per_node"] = int(gpus_per_node)
    if gpu_memory_gb:
        changes["device_memory"] = gpu_memory_gb * GIB
        changes["device_known"] = True
    if intra_node_gbps:
        changes["intra_node_bw"] = intra_node_gbps * GB
    if inter_node_gbps:
        changes["inter_node_bw"] = inter_node_gbps * GB
    if tflops:
        changes["flops"] = tflops * 1e12
    flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in given.items())
    return replace(base, **changes, source=f"{base.source}; flags {flags}")


CALIBRATED = ("flops", "intra_node_bw", "inter_node_bw", "runtime_bytes", "latency_s", "device_memory", "call_s",
              "tp_call_s", "dtensor_op_s", "fsdp_param_s", "gloo_byte_s", "optimizer_s_per_param", "cores_per_node")


def with_calibration(base: Cluster, path: str | Path) -> Cluster:
    """``base`` with the figures a calibration file measured (:mod:`.calibrate`; a figure it could not
    measure, e.g. ``inter_node_bw`` on one node, is null there and keeps ``base``'s)."""
    data = read_calibration(path)
    measured = {k: float(data[k]) for k in CALIBRATED if data.get(k) is not None}
    known = base.device_known or "device_memory" in measured
    return replace(base, **measured, device_known=known, source=f"{base.source}; measured: {path}")


def read_calibration(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ClusterError(f"calibration file {p} not found; write one with `elastictrain plan JOB.yaml "
                           f"--calibrate --out {p}` or leave parallel.calibration unset")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"calibration file {p} is not JSON ({e}); write it again with --calibrate") from None
    bad = [k for k in CALIBRATED if data.get(k) is not None
           and (not isinstance(data[k], (int, float)) or isinstance(data[k], bool) or data[k] <= 0)] \
        if isinstance(data, dict) else []
    if not isinstance(data, dict) or bad:
        raise ClusterError(f"calibration file {p}: {bad or 'content'} not positive numbers; write it again "
                           "with --calibrate")
    return data


def describe(c: Cluster) -> str:
    unit = "GPUs" if c.kind == "gpu" else "CPU workers"
    rate = f"{c.flops / 1e12:.0f} TFLOP/s" if c.flops >= 1e12 else f"{c.flops / 1e9:.1f} GFLOP/s"
    return (f"{c.nodes} node(s) x {c.devices_per_node} {unit}, {c.device_memory / GIB:.1f} GiB and {rate} each, "
            f"{c.intra_node_bw / GB:.3g} GB/s inside a node, {c.inter_node_bw / GB:.3g} GB/s across ({c.source})")


__all__ = ["ClusterError", "CPU_DEFAULTS", "GPU_DEFAULTS", "PlannerInputError", "describe", "from_ray", "gpu_cluster",
           "read_calibration", "this_machine", "unknown_device_refusal", "with_calibration", "with_flags"]
