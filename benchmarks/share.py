"""The share rule (issue 36): under a layout that shards the training state, no rank ever holds more than
its share of it plus activations plus a fixed runtime floor -- measured through the real framework.

Run (one layout per command keeps the machine's memory safe; each appends its row to ``--out``)::

    python benchmarks/share.py --layouts fsdp4 --out /tmp/share.jsonl
    python benchmarks/share.py --layouts pp4,tp4,pp2xtp2 --out /tmp/share.jsonl
    python benchmarks/share.py --layouts fsdp4,pp4,tp4,pp2xtp2 --layers 4 --d-model 64 --heads 4 \
        --steps 2 --out /tmp/tiny.jsonl   # the same jobs on a ~0-parameter model: the runtime per layout
    python benchmarks/share.py --table /tmp/share.jsonl [--tiny /tmp/tiny.jsonl]

Each layout is a real job (``Trainer`` on a local Ray, 4 workers over gloo, ``parallel.meta_init`` on, the
peer memory tier off, the final model written by the workers) on the built-in GPT (default 32 layers of
d_model 1024: 404M parameters, 16 bytes each of fp32 training state). Measured: ``summary.json``'s per-rank
host peak (worker/memory_peak.py), from the worker's start to the final model's write. Bound: the rank's
share (params + grads + AdamW moments it owns, planner/memory.py), the planner's activations and gathered
weights, and a floor (an idle Ray worker that imported torch and this package, measured here); the rule
holds at measured / bound <= 1.1. ``ddp1``: one process holding the whole model (predicted; measured
with ``--layouts ddp1``).

Figures: docs/perf/2026-11-28-share-rule.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2 ** 20
LAYOUTS = {  # name -> (processes, the job's parallel section)
    "fsdp4": (4, {"plan": "fsdp", "meta_init": True}),
    "pp4": (4, {"plan": "ddp", "pp": 4, "pp_schedule": "1f1b", "meta_init": True}),
    "tp4": (4, {"plan": "ddp", "tp": 4, "meta_init": True}),
    "pp2xtp2": (4, {"plan": "ddp", "pp": 2, "tp": 2, "pp_schedule": "1f1b", "meta_init": True}),
    "ddp1": (1, {"plan": "ddp"}),  # the whole model on one process: what the share rule saves
}
# a step of a 400M model on 4 processes sharing 2 cores takes minutes: wide bounds, kept in their order
TIMEOUTS = {"collective_s": 600, "step_watchdog_cap_s": 1200, "watchdog_floor_s": 600, "poll_s": 1800,
            "restart_grace_s": 2400}
RULE = 1.1


def job(args: argparse.Namespace, layout: str) -> dict:
    world, parallel = LAYOUTS[layout]
    if getattr(args, "no_meta_init", False) and "meta_init" in parallel:  # every rank builds the whole model first
        parallel = {**parallel, "meta_init": False}
    return {"name": f"share-{layout}",
            "task": {"model": {"seq_len": args.seq_len, "n_layer": args.layers, "n_head": args.heads,
                               "d_model": args.d_model, "dropout": 0.0}},
            "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
            "workers": {"min": world, "max": world, "cpus_per_worker": 1, "standby": False},
            "checkpoint": {"memory_every_steps": 0}, "parallel": parallel, "timeouts": TIMEOUTS}


def predict(args: argparse.Namespace, layout: str) -> dict:
    """The planner's bytes for the worst rank of ``layout`` (planner/memory.py): the share (params, grads and
    optimizer state of its part, plain: what it owns, 16 bytes per parameter), activations and gathered."""
    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.planner import Candidate, Cluster
    from elastictrain.planner.cluster import CPU_DEFAULTS
    from elastictrain.planner.job import model_shape, training
    from elastictrain.planner.memory import memory, stage_params

    world = LAYOUTS[layout][0]
    cfg = build_config(job(args, layout))
    lay = resolve(spec_from_config(cfg), world)
    d = lay.dims
    c = Candidate(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, pp=d.pp, schedule=lay.pp_schedule,
                  stages_per_rank=lay.stages_per_rank, micro_batch=args.micro_batch,
                  sequence_parallel=lay.sp if d.tp > 1 else True)
    shape, train = model_shape(cfg), training(cfg)
    m = memory(shape, train, Cluster(nodes=1, devices_per_node=world, device_memory=1e12, **CPU_DEFAULTS), c)
    owned = stage_params(shape, c) / (c.tp * c.dp_shard)
    return {"params": shape.total_params, "share": owned * train.state_bytes_per_param,
            "activations": m.activations, "gathered": m.gathered}


def measure_floor() -> float:
    """MiB resident in an idle Ray worker that imported torch, torch.distributed and the worker's modules."""
    import ray

    @ray.remote(num_cpus=0)
    def idle() -> float:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        import elastictrain.worker.actor  # noqa: F401
        import elastictrain.worker.loop  # noqa: F401

        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024

    return ray.get(idle.remote())


def run_layout(args: argparse.Namespace, layout: str) -> dict:
    """One job under ``layout``; its per-rank peaks (summary.json) and the per-step maxima (step events)."""
    from elastictrain import Trainer, build_config
    from elastictrain.events import read_events

    run_dir = Path(tempfile.mkdtemp(prefix=f"share-{layout}-")) / "run"
    t0 = time.time()
    result = Trainer(build_config(job(args, layout)), run_dir=run_dir, console=None).fit()
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [{"step": e["step"], "host_mib": e["memory"]["host_mib"], "rank": e["memory"]["host_rank"]}
             for e in read_events(run_dir) if e["event"] == "step" and e.get("memory")]
    by_rank = {int(r): p["host_mib"] for r, p in summary["memory"]["by_rank"].items()}
    return {"layout": layout, "exit_code": result.exit_code, "by_rank": by_rank, "steps": steps,
            "wall_s": round(time.time() - t0, 1), "run_dir": str(run_dir), "load1": os.getloadavg()[0]}


def print_table(rows: list[dict], args: argparse.Namespace, tiny: dict[str, float] | None = None) -> None:
    """The table; with ``tiny`` (layout -> the highest peak of the same job on a model of ~0 parameters:
    the framework's own runtime under that layout), also the measured peak less it against share + act."""
    floor = next((r["floor_mib"] for r in rows if "floor_mib" in r), None)
    layouts = [r for r in rows if "layout" in r and r["layout"] != "ddp1"]
    one = next((r for r in rows if r.get("layout") == "ddp1"), None)
    if floor is None or not layouts:
        print("nothing to print: run a layout first")
        return
    whole = predict(args, "ddp1")
    print(f"model {whole['params'] / 1e6:.0f}M params; floor (idle Ray worker, torch imported) {floor:.0f} MiB; "
          f"MiB per rank; rule: measured <= {RULE} x (share + act + floor)")
    print(f"{'layout':11} {'share':>7} {'act+gath':>8} {'floor':>6} {'bound':>7} {'measured by rank':>28} "
          f"{'max':>7} {'ratio':>6}  verdict" + ("  [max - tiny job's peak] / (share + act+gath)" if tiny else ""))
    for r in layouts:
        p = predict(args, r["layout"])
        extra = (p["activations"] + p["gathered"]) / MIB
        bound = p["share"] / MIB + extra + floor
        worst = max(r["by_rank"].values())
        ranks = " ".join(f"{r['by_rank'][k]:.0f}" for k in sorted(r["by_rank"]))
        print(f"{r['layout'] + r.get('variant', ''):11} {p['share'] / MIB:7.0f} {extra:8.0f} {floor:6.0f} {bound:7.0f} {ranks:>28} "
              f"{worst:7.0f} {worst / bound:6.2f}  {'holds' if worst / bound <= RULE else 'BROKEN'}"
              f"{'' if r['exit_code'] == 0 else ' (run exit ' + str(r['exit_code']) + ')'}"
              + (f"  [{worst:.0f} - {tiny[r['layout']]:.0f}] / {bound - floor:.0f} = "
                 f"{(worst - tiny[r['layout']]) / (bound - floor):.2f}" if tiny and r["layout"] in tiny else ""))
    extra = (whole["activations"] + whole["gathered"]) / MIB
    bound = whole["share"] / MIB + extra + floor
    peak = max(one["by_rank"].values()) if one else 0.0
    got = f"{peak:28.0f} {peak:7.0f} {peak / bound:6.2f}" if one else \
        f"{'(not run: --layouts ddp1)':>28}"
    print(f"{'ddp1':11} {whole['share'] / MIB:7.0f} {extra:8.0f} {floor:6.0f} {bound:7.0f} {got}  the whole model")


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _tiny_peaks(path: Path) -> dict[str, float]:
    return {r["layout"]: max(r["by_rank"].values()) for r in _rows(path) if "layout" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--out", default=None, help="append each row (JSON lines) here; --table reads it")
    ap.add_argument("--table", default=None, help="print the table of the rows in this file and exit")
    ap.add_argument("--tiny", default=None, help="with --table: rows of the same layouts on a ~0-parameter "
                    "model (e.g. --layers 4 --d-model 64 --heads 4): the framework's runtime under each layout")
    ap.add_argument("--no-meta-init", action="store_true",
                    help="parallel.meta_init off: every rank builds the whole fp32 model before its layout splits it")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args()
    if args.table:
        tiny = _tiny_peaks(Path(args.tiny)) if args.tiny else None
        print_table(_rows(Path(args.table)), args, tiny)
        return
    # freed blocks over 128 KiB go back to the OS at once (as in benchmarks/parallel.py): the peak is live memory
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = [{"floor_mib": round(measure_floor(), 1)}]
    label = "-nometa" if args.no_meta_init else ""
    print(f"floor: {rows[0]['floor_mib']:.0f} MiB", flush=True)
    for layout in [x for x in args.layouts.split(",") if x]:
        rows.append({**run_layout(args, layout), "variant": label})
        r = rows[-1]
        print(f"{layout}: exit {r['exit_code']} in {r['wall_s']} s; peak MiB by rank {r['by_rank']}; per step "
              f"{[(s['step'], s['host_mib'], s['rank']) for s in r['steps']]}; {r['run_dir']}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rows[0]) + "\n" + json.dumps(r) + "\n")
    ray.shutdown()
    print_table(rows, args)


if __name__ == "__main__":
    main()
