"""Recovery benchmark: elastictrain against Ray Train V2 on the same model, data, schedule and kill.

One process, one Ray instance (C's and D's runs each start on a fresh one), four scenarios (A-C: 2 CPU
workers, tiny GPT, builtin:pydoc, global batch 32, micro batch 8; D: 4 CPU workers, the same job):

A. elastictrain, rank 1 SIGKILLed mid-step at step K: once through the injected fault (``faults``), once
   by an external ``os.kill`` of the pid from the ``worker_started`` event (not only the injected path).
   Each twice: without checkpoints, and with a checkpoint every ``ckpt_every`` steps (local disk), the
   same cadence Ray Train uses, so the cost of saving is on both sides.
B. Ray Train V2 ``TorchTrainer``, the loop a Ray Train user writes: ``prepare_model``, a checkpoint every
   ``ckpt_every`` steps through ``ray.train.report``, ``ray.train.get_checkpoint()`` on start. Rank 1
   SIGKILLs itself at the same point of step K on the first attempt only.

The kill step K is drawn uniformly from ``[steps/4, steps/2]`` (``--kill-seed``, printed), not placed at a
checkpoint boundary: where K falls relative to Ray Train's last checkpoint decides how many steps it
redoes (0 to ``ckpt_every - 1``). Besides the measured figures, Ray Train's row reports the expectation
over a uniformly random kill: ``(ckpt_every - 1) / 2`` lost steps and the time to next step adjusted by
``(expected - measured lost steps) x median step time``.
C. elastictrain alone: the current rank-1 worker SIGKILLed every ``chaos_interval_s`` over a ~100 s run,
   compared with a failure-free run of the same steps (``--chaos-ckpt-every``: both with checkpoints).
   Per kill it also reports death -> the replacement joined (the next generation at full size) and death
   -> the replacement's first step (the first step completed at full size; null when the next kill came
   first: the killer does not wait for the replacement).
D. elastictrain alone, layouts against ddp on the same job (issue #39: kill -> next step under cp2 x dp2 and
   ep2 x dp2 <= 2x ddp's): 4 workers (``workers.min`` 2, the smallest world cp2 and ep2 accept), rank 1
   SIGKILLed mid-step at step K by the injected fault, as in A (no durable checkpoint, the peer memory tier
   off: the survivors hold every rank's state, the killed ep rank's experts on its expert replica), for four
   layouts: ddp (dp4) and cp2 x dp2 on the tiny dense GPT (``seq_len`` 64, a multiple of 2 x cp), ddp (dp4)
   and ep2 x dp2 (``parallel.ep`` 2) on the same GPT with an 8-expert top-2 MoE feed-forward in every block
   (``task.model.moe``). Rank 1 is cp (ep) coordinate 1 of data replica 0. Each run gets ``layout_steps``
   steps (80; ``--quick`` 40) and the kill step drawn by the same ``--kill-seed`` over them, the same K for
   all four. Per layout: time to next step, lost steps, the recovery source and world size, the first
   recovered step's own time (``first_step_after_s``: at the shrunk size, more accumulation), and the ratio
   to the ddp row of the same model (cp2 x dp2 / ddp on the dense GPT, ep2 x dp2 / ddp on the MoE GPT)
   against the target (<= 2). D runs only when named (``--only D``).

Metrics, the same definitions for both systems (and for D's layouts):

- time to next step: from the kill to the first completed step of the recovered run. Exact kill time for
  Ray Train and for external kills; for the injected elastictrain kill the last progress before the kill
  (``recovered.downtime_s``) is used (an upper bound: the kill happens one micro-batch forward later).
  Step times on both sides are the worker's own clock when the optimizer step finished (elastictrain:
  the step event's ``finished_at``, stamped by rank 0; Ray Train: rank 0's ``time.time()`` in the loop).
- lost steps: steps completed before the kill that were run again (last completed step before the kill
  minus the step the recovered run started from).
- goodput: failure-free-equivalent time / wall time over the training window (first to last completed
  step; the one-off initial start-up is left out for both): ``steps x median failure-free step time /
  (t_last - t_first + median step time)``. Scenario C compares with a measured failure-free run instead.

Usage::

    python benchmarks/recovery.py            # full run, about 8-10 minutes on an idle 2-core machine
    python benchmarks/recovery.py --quick    # smoke run, about 3-4 minutes
    # endurance under churn (issue #21 item 13): a kill every 15 s over ~100 s, a checkpoint every 20 steps;
    # C's rows give goodput and, per kill, death_to_replacement_first_step_s_each
    python benchmarks/recovery.py --only C --chaos-interval 15 --chaos-ckpt-every 20
    # layouts against ddp on one job (issue #39): four runs of 80 steps on 4 workers, under 4 minutes on an
    # idle 2-core machine (--quick: 40 steps each; most of a run is start-up either way)
    python benchmarks/recovery.py --only D --kill-seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Ray Train V2 is chosen by this variable, read when ray.train is first imported.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

Record = dict[str, Any]


def _t(step_record: Record) -> float:
    """When a step completed, on the worker's clock (events are written when the driver polls, later)."""
    return step_record.get("finished_at", step_record["time"])


SEED = 0
GLOBAL_BATCH = 32
MICRO_BATCH = 8
WORKERS = 2


@dataclass(frozen=True)
class Plan:
    """What each scenario runs. ``kill_step`` is 1-based, as in ``step`` events."""

    steps: int = 300
    kill_step: int = 100
    ckpt_every: int = 10
    chaos_s: float = 100.0
    chaos_interval_s: float = 20.0
    chaos_ckpt_every: int = 0  # scenario C: a checkpoint every this many steps (0: none)
    layout_steps: int = 80  # scenario D: steps of each layout's run (4 workers: slower steps than A's)
    kill_seed: int | None = None  # what ``kill_step`` was drawn with (``with_random_kill``)

    @classmethod
    def quick(cls) -> Plan:
        return cls(steps=150, kill_step=60, ckpt_every=10, chaos_s=24.0, chaos_interval_s=8.0, layout_steps=40)

    def with_random_kill(self, seed: int) -> Plan:
        """The same plan with ``kill_step`` drawn uniformly from ``[steps/4, steps/2]``."""
        k = random.Random(seed).randint(self.steps // 4, self.steps // 2)
        return dataclasses.replace(self, kill_step=k, kill_seed=seed)

    def for_layouts(self) -> Plan:
        """Scenario D's plan: ``layout_steps`` steps, the kill step drawn by the same seed over them."""
        return dataclasses.replace(self, steps=self.layout_steps).with_random_kill(self.kill_seed or 0)


@dataclass
class Outcome:
    """One scenario's figures."""

    name: str
    time_to_next_step_s: float | None
    lost_steps: int | None
    goodput: float | None
    detail: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- metrics


def goodput(times: list[float], n_steps: int, step_s: float) -> float:
    """Failure-free-equivalent time over the training window (first to last completed step)."""
    window = max(times) - min(times) + step_s
    return n_steps * step_s / window


def job_config(plan: Plan, steps: int, faults: list[Record] | None = None, spares: int = 0,
               ckpt_dir: Path | None = None, layout: Layout | None = None) -> Any:
    """The elastictrain job every scenario uses (Ray Train's loop copies its model and optimizer). With
    ``ckpt_dir``: a checkpoint every ``plan.ckpt_every`` steps there, Ray Train's cadence. With ``layout``
    (scenario D): its world, parallel section and model."""
    from elastictrain import build_config

    # the peer memory tier is off on elastictrain's side: Ray Train has none, and its rows without
    # checkpoints must mean no snapshot of any kind (survivors are the source of a single kill anyway)
    ckpt = ({"uri": str(ckpt_dir), "every_steps": plan.ckpt_every, "resume": "never", "memory_every_steps": 0}
            if ckpt_dir else {"uri": None, "memory_every_steps": 0})
    spec: Record = {
        "checkpoint": ckpt,
        "name": "recovery-bench",
        "train": {"steps": steps, "seed": SEED, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                  "log_every": 10_000},
        "workers": {"min": 1, "max": WORKERS, "cpus_per_worker": 1, "spares": spares},
        "recovery": {"max_failures": 20, "max_failures_per_rank": 20},
        "faults": faults or [],
    }
    if layout is not None:
        # world 2 is the smallest size cp2 and ep2 accept (whole cp/ep groups): every layout gets it
        spec["workers"] = {**spec["workers"], "min": 2, "max": layout.world}
        spec["parallel"] = dict(layout.parallel)
        spec["task"] = {"model": {"moe": dict(layout.moe) if layout.moe else None}}
    return build_config(spec)


# ------------------------------------------------------------------------------------ following a run


class EventTail:
    """Follows ``run_dir/events.jsonl`` from a thread so that other threads can wait on conditions over
    the records seen so far. Observes only: it never touches the run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "events.jsonl"
        self.records: list[Record] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="event-tail", daemon=True)

    def __enter__(self) -> EventTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        buf, handle = "", None
        try:
            while not self._stop.is_set():
                if handle is None and self.path.exists():
                    handle = self.path.open()
                chunk = handle.read() if handle else ""
                if not chunk:
                    self._stop.wait(0.01)  # a file has no change notification here: poll it
                    continue
                buf += chunk
                *lines, buf = buf.split("\n")
                with self._cond:
                    self.records.extend(json.loads(line) for line in lines if line.strip())
                    self._cond.notify_all()
        finally:
            if handle:
                handle.close()
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[Record]], Any], timeout: float) -> Any:
        """The first truthy ``predicate(records)`` within ``timeout`` seconds; None on timeout or once the
        run finished without it."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self.records) or self._finished(), timeout)
            return predicate(self.records) or None

    def finished_within(self, timeout: float) -> bool:
        """True if the run finishes within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(self._finished, timeout)

    def _finished(self) -> bool:
        return self._stop.is_set() or any(r["event"] in ("run_finished", "run_failed") for r in self.records)


def member_rank1_pid(records: list[Record], killed: set[int]) -> int | None:
    """The pid of the rank-1 worker of the current generation, once that generation has two members."""
    pid, joined = None, False
    for r in records:
        if r["event"] == "worker_started" and r["rank"] == 1:
            pid, joined = r["pid"], False
        elif r["event"] == "generation_started":
            joined = r["world_size"] == WORKERS
    return pid if joined and pid not in killed else None


def sigkill(pid: int) -> float:
    now = time.time()
    os.kill(pid, signal.SIGKILL)
    return now


# ------------------------------------------------------------------------------------ elastictrain runs


def run_elastictrain(config: Any, run_dir: Path, killer: Callable[[EventTail], None] | None = None) -> list[Record]:
    """Run one job to the end (``killer`` runs in a thread beside it); return its event records."""
    from elastictrain import Trainer
    from elastictrain.events import read_events

    run_dir.mkdir(parents=True, exist_ok=True)
    with EventTail(run_dir) as tail:
        thread = threading.Thread(target=killer, args=(tail,), daemon=True) if killer else None
        if thread:
            thread.start()
        result = Trainer(config, run_dir=run_dir, console=None).fit()
    if thread:
        thread.join(timeout=10)
    if not result.ok:
        raise RuntimeError(f"elastictrain run in {run_dir} failed: {result.summary.get('error')}")
    return read_events(run_dir)


def recovery_after(records: list[Record], t_kill: float) -> tuple[int, int, float] | None:
    """For the first recovery after ``t_kill``: (steps completed before the kill, step the recovered
    generation starts from, time of its first completed step).

    Step events lag the workers by a poll, so "completed before the kill" is every step the controller
    had recorded before it formed the recovery generation: no step can complete while a rank is dead,
    so all of them completed before the kill."""
    i = next((i for i, r in enumerate(records) if r["event"] == "generation_started"
              and r["reason"] == "recover" and r["time"] >= t_kill), None)
    if i is None:
        return None
    resumed = records[i]["step"]
    done = max((r["step"] for r in records[:i] if r["event"] == "step"), default=0)
    nxt = next((r for r in records[i:] if r["event"] == "step" and r["step"] > resumed), None)
    return done, resumed, (_t(nxt) if nxt else float("nan"))


def elastictrain_outcome(name: str, records: list[Record], t_kill: float, summary: Record,
                         n_steps: int, world: int | None = WORKERS) -> Outcome:
    """``world``: the median step time is over the steps at ``world`` data ranks; None: over the steps
    completed before the kill (a cp run's step events count data ranks, not workers)."""
    steps = [r for r in records if r["event"] == "step"]
    done_before, resumed, t_next = recovery_after(records, t_kill) or (0, None, float("nan"))
    step_s = statistics.median(r["step_s"] for r in steps
                               if (r["step"] <= done_before if world is None else r["world_size"] == world))
    failure = next((r for r in records if r["event"] == "failure"), {})
    recovered = next((r for r in records if r["event"] == "recovered"), {})
    return Outcome(
        name, t_next - t_kill, None if resumed is None else max(0, done_before - resumed),
        goodput([_t(r) for r in steps], n_steps, step_s),
        {"killed_during_step": done_before + 1, "resumed_from_step": resumed, "median_step_s": round(step_s, 4),
         "failure_detected_after_s": failure.get("detected_after_s"),
         "recovered_downtime_s": recovered.get("downtime_s"), "recovered_source": recovered.get("source"),
         "recovered_world_size": recovered.get("world_size"), "summary_lost_steps": summary.get("lost_steps"),
         "summary_goodput": summary.get("goodput", {}).get("fraction"), "wall_s": summary.get("wall_s")})


def scenario_injected(plan: Plan, base: Path, ckpt: bool) -> Outcome:
    fault = {"rank": 1, "step": plan.kill_step, "point": "mid_step", "kind": "kill"}
    run_dir = base / f"et-injected{'-ckpt' if ckpt else ''}"
    records = run_elastictrain(job_config(plan, plan.steps, [fault], ckpt_dir=run_dir / "ckpt" if ckpt else None),
                               run_dir)
    recovered = next(r for r in records if r["event"] == "recovered")
    t_kill = recovered["time"] - recovered["downtime_s"]  # last progress before the kill: an upper bound
    summary = json.loads((run_dir / "summary.json").read_text())
    return elastictrain_outcome(f"elastictrain injected kill{_ck(ckpt, plan)}", records, t_kill, summary,
                                plan.steps)


def _ck(ckpt: bool, plan: Plan) -> str:
    return f", ckpt/{plan.ckpt_every}" if ckpt else ", no ckpt"


def scenario_external(plan: Plan, base: Path, ckpt: bool) -> Outcome:
    kills: list[float] = []

    def killer(tail: EventTail) -> None:
        def armed(recs: list[Record]) -> int | None:
            if not any(r["event"] == "step" and r["step"] >= plan.kill_step - 1 for r in recs):
                return None
            return member_rank1_pid(recs, set())
        pid = tail.wait_for(armed, timeout=300)
        if pid:
            kills.append(sigkill(pid))

    run_dir = base / f"et-external{'-ckpt' if ckpt else ''}"
    records = run_elastictrain(job_config(plan, plan.steps, ckpt_dir=run_dir / "ckpt" if ckpt else None),
                               run_dir, killer)
    if not kills:
        raise RuntimeError("the external kill never fired")
    summary = json.loads((run_dir / "summary.json").read_text())
    return elastictrain_outcome(f"elastictrain external SIGKILL{_ck(ckpt, plan)}", records, kills[0], summary,
                                plan.steps)


# ------------------------------------------------------------------------------------ scenario D


@dataclass(frozen=True)
class Layout:
    """One of scenario D's runs: a layout of the same job on ``world`` workers. ``model`` names the model
    (the ratio's denominator is the ``ddp`` layout of the same model); ``moe`` is ``task.model.moe``."""

    name: str
    model: str
    parallel: dict[str, Any]
    moe: dict[str, Any] | None = None
    world: int = 4


MOE = {"experts": 8, "top_k": 2, "every": 1}
# the tiny GPT's seq_len (64) is a multiple of 2 x cp; rank 1 is cp (ep) coordinate 1 of data replica 0
LAYOUTS = (
    Layout("ddp", "dense GPT", {"plan": "ddp"}),
    Layout("cp2 x dp2", "dense GPT", {"plan": "ddp", "cp": 2}),
    Layout("ddp", "MoE GPT (8 experts)", {"plan": "ddp"}, MOE),
    Layout("ep2 x dp2", "MoE GPT (8 experts)", {"plan": "ddp", "ep": 2}, MOE),
)
LAYOUT_TARGET = 2.0  # issue #39: kill -> next step under cp2 x dp2 and ep2 x dp2 <= 2x ddp's on the same job


def scenario_layouts(plan: Plan, base: Path, fresh_ray: Callable[[], None]) -> Iterator[Outcome]:
    """Scenario D: each of :data:`LAYOUTS` once, rank 1 SIGKILLed mid-step at ``plan.kill_step`` by the
    injected fault (scenario A's kill and metrics), each on a fresh local Ray so that every run finds the
    same pool of pre-started worker processes. Yields each layout's outcome as its run ends."""
    for i, layout in enumerate(LAYOUTS):
        fault = {"rank": 1, "step": plan.kill_step, "point": "mid_step", "kind": "kill"}
        run_dir = base / f"et-layout{i}-{layout.name.replace(' ', '')}"
        fresh_ray()
        records = run_elastictrain(job_config(plan, plan.steps, [fault], layout=layout), run_dir)
        recovered = next(r for r in records if r["event"] == "recovered")
        t_kill = recovered["time"] - recovered["downtime_s"]  # as in A: last progress before the kill
        summary = json.loads((run_dir / "summary.json").read_text())
        o = elastictrain_outcome(f"D {layout.name}, {layout.model}", records, t_kill, summary, plan.steps,
                                 world=None)
        first = next((r for r in records if r["event"] == "step" and r["step"] > recovered["step"]
                      and r["time"] >= recovered["time"]), {})
        # how much of the time to next step is that one step (at the shrunk size: more accumulation)
        o.detail.update(layout=layout.name, model=layout.model, world=layout.world, kill_step=plan.kill_step,
                        steps=plan.steps, first_step_after_s=first.get("step_s"))
        yield o


def layout_ratios(outcomes: list[Outcome]) -> list[tuple[str, float, bool]]:
    """For every scenario-D row that is not ddp: (its name, its time to next step over the ddp row's of the
    same model, whether that is within :data:`LAYOUT_TARGET`)."""
    rows = [o for o in outcomes if "layout" in o.detail]
    ddp = {o.detail["model"]: o for o in rows if o.detail["layout"] == "ddp"}
    found = []
    for o in rows:
        base = ddp.get(o.detail["model"])
        if o.detail["layout"] == "ddp" or base is None:
            continue
        ratio = o.time_to_next_step_s / base.time_to_next_step_s
        found.append((o.name, ratio, ratio <= LAYOUT_TARGET))
    return found


# ------------------------------------------------------------------------------------ Ray Train V2


def ray_train_loop(cfg: dict[str, Any]) -> None:
    """The per-worker loop a Ray Train user writes for this model: same model, data order, loss scaling,
    optimizer and schedule as elastictrain's built-in task; checkpoints through ``ray.train.report``."""
    import torch
    import ray.train
    from ray.train.torch import prepare_model

    from elastictrain.data.cursor import rank_micro_batches
    from elastictrain.data.datasets import TokenWindows, collate, load_text_tokens
    from elastictrain.models.gpt import GPT, GPTConfig, per_sample_loss, sample_seeds
    from elastictrain.task import warmup_cosine

    torch.set_num_threads(1)  # as elastictrain's workers.cpus_per_worker=1
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    m, o, steps, g, mb = cfg["model"], cfg["optimizer"], cfg["steps"], cfg["global_batch"], cfg["micro_batch"]
    torch.manual_seed(cfg["seed"])
    model = GPT(GPTConfig(vocab_size=256, seq_len=m["seq_len"], n_layer=m["n_layer"], n_head=m["n_head"],
                          d_model=m["d_model"], dropout=m["dropout"]))
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                            weight_decay=o["weight_decay"], foreach=False)
    data = TokenWindows(load_text_tokens("builtin:pydoc"), m["seq_len"])
    start = _load_checkpoint(model, opt)
    log = Path(cfg["log_path"])
    if rank == 0:
        _append(log, f"start,{start},{time.time()},0")
    ddp = prepare_model(model)
    for s in range(start, steps):
        t0 = time.perf_counter()
        micro = rank_micro_batches(s, rank, world, mb, g, cfg["seed"], len(data))
        for k, ids in enumerate(micro):
            batch = collate([data[int(i)] for i in ids])
            with ddp.no_sync() if k < len(micro) - 1 else _nullcontext():
                loss = per_sample_loss(ddp(batch["input"], sample_seeds=sample_seeds(cfg["seed"], s, ids)),
                                       batch["target"])
                if rank == 1 and s + 1 == cfg["kill_step"] and k == 0:
                    _kill_once(Path(cfg["marker"]))
                (loss.sum() * (world / g)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"], foreach=False)
        for group in opt.param_groups:
            group["lr"] = o["lr"] * warmup_cosine(s, o["warmup_steps"], steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            _append(log, f"step,{s + 1},{time.time()},{time.perf_counter() - t0}")
        if (s + 1) % cfg["ckpt_every"] == 0 or s + 1 == steps:
            _report(s + 1, model, opt, rank)


def _nullcontext() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _kill_once(marker: Path) -> None:
    """SIGKILL this worker the first time only: the marker survives the restart."""
    if marker.exists():
        return
    marker.write_text(f"{time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


def _load_checkpoint(model: Any, opt: Any) -> int:
    import torch
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def _report(step: int, model: Any, opt: Any, rank: int) -> None:
    import torch
    import ray.train
    from ray.train import Checkpoint

    metrics = {"step": step}
    if rank != 0:
        ray.train.report(metrics)  # a barrier: every rank reports the same number of times
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                   Path(d) / "state.pt")
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def scenario_ray_train(plan: Plan, base: Path) -> Outcome:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    work = base / "ray-train"
    work.mkdir(parents=True, exist_ok=True)
    config = job_config(plan, plan.steps)
    cfg = {"model": config.task.model.model_dump(), "optimizer": config.task.optimizer.model_dump(),
           "steps": plan.steps, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "seed": SEED,
           "kill_step": plan.kill_step, "ckpt_every": plan.ckpt_every, "log_path": str(work / "steps.csv"),
           "marker": str(work / "killed")}
    t0 = time.time()
    TorchTrainer(
        ray_train_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name="recovery-bench", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=3)),
    ).fit()
    wall = time.time() - t0
    return ray_outcome(plan, work, wall)


def ray_outcome(plan: Plan, work: Path, wall: float) -> Outcome:
    rows = [line.split(",") for line in (work / "steps.csv").read_text().splitlines()]
    t_kill = float((work / "killed").read_text())
    starts = [(int(r[1]), float(r[2])) for r in rows if r[0] == "start"]
    steps = [(int(r[1]), float(r[2]), float(r[3])) for r in rows if r[0] == "step"]
    resumed = next(s for s, t in starts if t > t_kill)
    t_next = next(t for s, t, _ in steps if t > t_kill and s > resumed)
    done_before = max(s for s, t, _ in steps if t <= t_kill)
    step_s = statistics.median(d for s, t, d in steps if t <= t_kill)
    persisted = persisted_checkpoint_step(work / "storage", t_kill)
    lost = max(0, done_before - resumed)
    expected_lost = (plan.ckpt_every - 1) / 2  # a kill uniformly placed between two checkpoints
    return Outcome(
        "Ray Train V2", t_next - t_kill, lost,
        goodput([t for _, t, _ in steps], plan.steps, step_s),
        {"expected_lost_steps_uniform_kill": expected_lost,
         "expected_time_to_next_step_s": round(t_next - t_kill + (expected_lost - lost) * step_s, 3),
         "killed_during_step": done_before + 1, "resumed_from_step": resumed, "median_step_s": round(step_s, 4),
         "attempts": len(starts), "ckpt_every": plan.ckpt_every, "persisted_ckpt_step_at_kill": persisted,
         "lost_if_resumed_from_persisted": max(0, done_before - persisted), "wall_s": round(wall, 3)})


def persisted_checkpoint_step(storage: Path, t_kill: float) -> int:
    """The newest step whose checkpoint was fully in storage before the kill, registered by Ray Train's
    controller or not (a reported checkpoint is registered only when the controller next polls every
    worker, every 2 s by default)."""
    import torch

    found = [0]
    for f in storage.glob("*/checkpoint_*/state.pt"):
        if f.stat().st_mtime <= t_kill:
            found.append(int(torch.load(f, weights_only=True)["step"]))
    return max(found)


# ------------------------------------------------------------------------------------ scenario C


def scenario_chaos(plan: Plan, base: Path, step_s: float, fresh_ray: Callable[[], None]) -> list[Outcome]:
    """Kill the current rank-1 worker every ``chaos_interval_s`` over ~``chaos_s`` of training, and
    compare with a failure-free run of the same steps: once shrinking while a replacement starts (the
    default), once with a pre-started spare (``workers.spares=1``) that takes the place at once.

    Each run starts on a fresh local Ray (``fresh_ray``), so each finds the same pool of pre-started worker
    processes: run after run on one Ray, the first found its pool's imports done and the later ones started
    their workers cold (1.8 s against 3.2 s of start-up in the summary's goodput, measured)."""
    n_steps = max(plan.kill_step, round(plan.chaos_s / step_s))
    every = plan.chaos_ckpt_every
    ck = (lambda name: base / name / "ckpt") if every else (lambda name: None)
    cplan = dataclasses.replace(plan, ckpt_every=every or plan.ckpt_every)
    fresh_ray()
    free = run_elastictrain(job_config(cplan, n_steps, ckpt_dir=ck("et-free")), base / "et-free")
    outcomes = []
    for spares in (0, 1):
        kills: list[float] = []
        name = f"et-chaos-spares{spares}"
        fresh_ray()
        chaos = run_elastictrain(job_config(cplan, n_steps, spares=spares, ckpt_dir=ck(name)), base / name,
                                 lambda tail: _chaos_killer(tail, plan.chaos_interval_s, kills))
        outcomes.append(chaos_outcome(n_steps, free, chaos, kills, base, name, spares))
    return outcomes


def _chaos_killer(tail: EventTail, interval: float, kills: list[float]) -> None:
    first = tail.wait_for(lambda recs: next((r for r in recs if r["event"] == "step"), None), timeout=300)
    if not first:
        return
    next_at, killed = first["time"] + interval, set()
    while True:
        if tail.finished_within(max(0.0, next_at - time.time())):
            return
        pid = tail.wait_for(lambda recs: member_rank1_pid(recs, killed), timeout=120)
        if not pid:
            return
        killed.add(pid)
        kills.append(sigkill(pid))
        next_at = kills[-1] + interval


def _window(records: list[Record]) -> float:
    times = [_t(r) for r in records if r["event"] == "step"]
    return max(times) - min(times)


def _degraded_spans(records: list[Record]) -> list[float]:
    """Seconds spent below full size after each failure: from the recovery generation to the regrow."""
    spans, since = [], None
    for r in records:
        if r["event"] == "generation_started":
            if r["world_size"] < WORKERS and since is None:
                since = r["time"]
            elif r["world_size"] == WORKERS and since is not None:
                spans.append(round(r["time"] - since, 2))
                since = None
    return spans


def back_to_full_size(records: list[Record], t_kill: float, t_next_kill: float = float("inf")) -> float | None:
    """Seconds from ``t_kill`` to the first step completed at full size after it: death -> the
    replacement's first step (it joins when the world is back to ``WORKERS``). None: no step completed at
    full size before the next kill (a replacement slower than the kill interval)."""
    i = next((i for i, r in enumerate(records) if r["event"] == "generation_started" and r["time"] >= t_kill
              and r["world_size"] == WORKERS and r["reason"] != "start"), None)
    if i is None:
        return None
    first = next((r for r in records[i:] if r["event"] == "step" and r["world_size"] == WORKERS), None)
    return None if first is None or _t(first) > t_next_kill else round(_t(first) - t_kill, 3)


def back_in_group(records: list[Record], t_kill: float) -> float | None:
    """Seconds from ``t_kill`` to the next generation at full size (the replacement joined)."""
    r = next((r for r in records if r["event"] == "generation_started" and r["time"] >= t_kill
              and r["world_size"] == WORKERS and r["reason"] != "start"), None)
    return None if r is None else round(r["time"] - t_kill, 3)


def chaos_outcome(n_steps: int, free: list[Record], chaos: list[Record], kills: list[float],
                  base: Path, name: str, spares: int) -> Outcome:
    nexts, lost = [], []
    for t_kill in kills:
        found = recovery_after(chaos, t_kill)
        if found is None:
            continue
        done_before, resumed, t_next = found
        nexts.append(t_next - t_kill)
        lost.append(max(0, done_before - resumed))
    free_s, chaos_s = (json.loads((base / d / "summary.json").read_text()) for d in ("et-free", name))
    return Outcome(
        f"elastictrain chaos (spares={spares})", max(nexts) if nexts else None, sum(lost), _window(free) / _window(chaos),
        {"steps": n_steps, "kills": len(kills), "time_to_next_step_each_s": [round(x, 3) for x in nexts],
         "lost_steps_each": lost, "world1_s_each": _degraded_spans(chaos),
         "death_to_replacement_joined_s_each": [back_in_group(chaos, t) for t in kills],
         "death_to_replacement_first_step_s_each": [back_to_full_size(chaos, t, n) for t, n
                                                    in zip(kills, kills[1:] + [float("inf")])],
         "replacement_setup_s_each": [round(r["setup_s"], 2) for r in chaos
                                      if r["event"] == "worker_started" and r["generation"] > 0],
         "window_free_s": round(_window(free), 2),
         "window_chaos_s": round(_window(chaos), 2), "wall_free_s": free_s["wall_s"],
         "wall_chaos_s": chaos_s["wall_s"], "goodput_wall_ratio": round(free_s["wall_s"] / chaos_s["wall_s"], 4),
         "summary_goodput_chaos": chaos_s["goodput"]["fraction"], "failures": chaos_s["failures"],
         # the summary's fraction is productive step time over the whole wall time (start-up, time between
         # steps and the final save included), so a run without failures is below 1 too: compare with it
         "summary_goodput_free": free_s["goodput"]["fraction"],
         "final_loss_free": free_s["final_loss"], "final_loss_chaos": chaos_s["final_loss"]})


# ------------------------------------------------------------------------------------ report


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "n/a"
    return f"{x:.3f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def report(outcomes: list[Outcome], out: Path) -> bool:
    print("\n== results ==")
    for o in outcomes:
        print(f"{o.name:32s} time-to-next-step {_fmt(o.time_to_next_step_s, ' s'):>10s}  "
              f"lost steps {_fmt(o.lost_steps):>4s}  goodput {_fmt(o.goodput):>6s}")
        print(f"{'':32s} {json.dumps(o.detail)}")
    by = {o.name: o for o in outcomes}
    ray_o, checks = by.get("Ray Train V2"), []
    for name in [n for n in by if n.startswith(("elastictrain injected", "elastictrain external"))]:
        et = by.get(name)
        if et is None or ray_o is None:
            continue
        ratio_t = et.time_to_next_step_s / ray_o.time_to_next_step_s
        expected = ray_o.detail.get("expected_time_to_next_step_s") or ray_o.time_to_next_step_s
        print(f"{name} / Ray Train: time-to-next-step x{ratio_t:.3f} (x{et.time_to_next_step_s / expected:.3f} "
              f"of Ray Train's expectation over a random kill), lost steps {et.lost_steps} vs {ray_o.lost_steps} "
              f"(expected {ray_o.detail.get('expected_lost_steps_uniform_kill')}), goodput "
              f"x{et.goodput / ray_o.goodput:.3f}")
        checks += [(f"{name}: time-to-next-step <= 1/10 of Ray Train's", ratio_t <= 0.1),
                   (f"{name}: time-to-next-step < 1 s", et.time_to_next_step_s < 1.0),
                   (f"{name}: at most 1 step lost", (et.lost_steps or 0) <= 1)]
    for name, o in by.items():
        if name.startswith("elastictrain chaos"):
            checks.append((f"{name}: goodput vs failure-free >= 0.9", o.goodput >= 0.9))
    for name, ratio, ok in layout_ratios(outcomes):
        print(f"{name} / ddp of the same model: time-to-next-step x{ratio:.3f} (target <= {LAYOUT_TARGET:g})")
        checks.append((f"{name}: time-to-next-step <= {LAYOUT_TARGET:g}x ddp's on the same model", ok))
    for text, ok in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {text}")
    (out / "results.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    print(f"results: {out / 'results.json'}")
    return all(ok for _, ok in checks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (~2 minutes)")
    p.add_argument("--out", type=Path, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--only", choices=["A", "B", "C", "D"], action="append",
                   help="run only these scenarios (default A, B and C; D only when named)")
    p.add_argument("--verbose", action="store_true", help="show worker logs")
    p.add_argument("--kill-seed", type=int, default=None, help="seed of the random kill step (default: random)")
    p.add_argument("--chaos-interval", type=float, default=None, help="scenario C: seconds between kills")
    p.add_argument("--chaos-s", type=float, default=None, help="scenario C: seconds of training (about)")
    p.add_argument("--chaos-ckpt-every", type=int, default=0, help="scenario C: a checkpoint every N steps")
    args = p.parse_args(argv)
    seed = args.kill_seed if args.kill_seed is not None else random.SystemRandom().randrange(1 << 30)
    plan = (Plan.quick() if args.quick else Plan()).with_random_kill(seed)
    plan = dataclasses.replace(plan, chaos_ckpt_every=args.chaos_ckpt_every,
                               chaos_interval_s=args.chaos_interval or plan.chaos_interval_s,
                               chaos_s=args.chaos_s or plan.chaos_s)
    only = set(args.only or "ABC")
    if only - {"D"}:
        print(f"kill step {plan.kill_step} of {plan.steps} (--kill-seed {seed}); checkpoints every "
              f"{plan.ckpt_every} steps on both sides in the checkpointed rows", flush=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):  # stale markers and logs of an earlier run would corrupt every figure
        p.error(f"--out {out} is not empty; give a new directory")
    if "D" in only:
        dplan = plan.for_layouts()
        print(f"scenario D: kill step {dplan.kill_step} of {dplan.steps} (--kill-seed {seed} over D's steps)",
              flush=True)

    import ray

    # address="local": always a private instance, never a cluster another process started on this machine
    from elastictrain.local_ray import init_local_ray

    # the Ray `elastictrain run` starts for itself (worker processes preload their imports; its daemons tuned)
    def start_ray() -> None:
        init_local_ray(4, logging_level=logging.WARNING, log_to_driver=args.verbose)

    def fresh_ray() -> None:
        ray.shutdown()
        start_ray()
        time.sleep(5.0)  # its pre-started workers import (~2.6 s of CPU each) before the run starts

    start_ray()
    outcomes: list[Outcome] = []
    load_before = os.getloadavg()  # other processes on the machine skew every timing: say how busy it was
    try:
        t0 = time.time()
        if "A" in only:
            for ckpt in (False, True):
                outcomes.append(scenario_injected(plan, out, ckpt))
                print(f"[{time.time() - t0:5.0f}s] {outcomes[-1]}", flush=True)
                outcomes.append(scenario_external(plan, out, ckpt))
                print(f"[{time.time() - t0:5.0f}s] {outcomes[-1]}", flush=True)
        if "B" in only:
            outcomes.append(scenario_ray_train(plan, out))
            print(f"[{time.time() - t0:5.0f}s] {outcomes[-1]}", flush=True)
        if "C" in only:
            step_s = next((o.detail["median_step_s"] for o in outcomes if o.name.startswith("elastictrain")), 0.1)
            for outcome in scenario_chaos(plan, out, step_s, fresh_ray):
                outcomes.append(outcome)
                print(f"[{time.time() - t0:5.0f}s] {outcome}", flush=True)
        if "D" in only:
            for outcome in scenario_layouts(dplan, out, fresh_ray):
                outcomes.append(outcome)
                print(f"[{time.time() - t0:5.0f}s] {outcome}", flush=True)
        print(f"total {time.time() - t0:.0f}s; run directories under {out}; load average "
              f"{load_before} -> {os.getloadavg()} on {os.cpu_count()} CPUs")
    finally:
        ray.shutdown()
    return 0 if report(outcomes, out) else 1


if __name__ == "__main__":
    sys.exit(main())
