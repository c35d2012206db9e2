"""The framework-owned step loop of one worker: one optimizer step over the global batch.

Step ``s`` (0-based) consumes the global sample positions ``[s*G, (s+1)*G)``. This rank's share is a pure
function of (step, rank, world size, micro batch) and gradient accumulation makes up the rest, so the
samples a step sees and its math do not depend on the world size. Each micro-batch loss is
``sum(per-sample loss) * D / G`` (``D`` the data-parallel size: the world size without pipelining): DDP's
(or FSDP2's) mean over the data-parallel ranks then yields the mean over the G samples.

The layout (DDP, FSDP2, HSDP, each optionally inside pipeline stages) is applied per membership generation
by :meth:`StepRunner.attach` through the task's ``parallelize_fn`` on a fresh DeviceMesh; the step itself
never asks which layout it runs under: the parallelized model's ``run_micro_batches`` runs the micro-batches
(see elastictrain/parallel/).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from elastictrain.config import ParallelConfig, TrainConfig
from elastictrain.checkpoint import host_copy
from elastictrain.data.cursor import CursorState, eval_sample_ids, rank_micro_batches
from elastictrain.models.gpt import sample_seed
from elastictrain.parallel.materialize import has_meta_params, load_seeded_init, materialize, params_on_meta
from elastictrain.parallel import optim
from elastictrain.parallel.bubble import schedule_bubble
from elastictrain.parallel.mesh import build_mesh
from elastictrain.parallel.parallelize import MicroBatch, MicroStepResult, ParallelModel, wrap
from elastictrain.parallel.plan import Layout
from elastictrain.parallel.train_state import TrainingState
from elastictrain.task import Task
from elastictrain.worker.faults import FaultInjector
from elastictrain.worker.rng import seed_micro_batch
from elastictrain.worker.step_stats import StepStats


@dataclass
class StepRecord:
    """What one completed optimizer step reports to the controller."""

    step: int                 # completed steps after this one (1-based step number)
    loss: float               # mean per-sample loss over the whole global batch
    world_size: int
    accum: int
    step_s: float             # wall time of the step on this rank
    compute_s: float          # forward (+ local backward) time: what a straggler is slow at
    finished_at: float        # time.time()
    sample_ids: list[int] = field(default_factory=list)  # only when audit is on
    pipeline: dict[str, Any] | None = None  # pp > 1: pp, schedule, n_microbatches, bubble_timeline/_measured
    mesh: str | None = None  # the layout this rank runs, as built (StepRunner.mesh): "fsdp: dp_shard=3"
    eval_loss: float | None = None  # mean validation loss after this step (train.eval_every)


def _default_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class StepRunner:
    """Model, optimizer and data of one worker, and the code that runs one step on the current group.

    Per generation :meth:`attach` builds the mesh, applies the layout and (for a sharded layout, or a
    change of layout) builds a fresh model and optimizer; the state then comes from a restore step
    (:attr:`state`'s ``load_from`` over any DCP reader, or a replicated peer's broadcast)."""

    def __init__(self, task: Task, train: TrainConfig, faults: FaultInjector, audit: bool = False,
                 parallel: ParallelConfig | None = None, device: torch.device | None = None) -> None:
        self.task = task
        self.train = train
        self.parallel = parallel or ParallelConfig()
        self.device = device or torch.device("cpu")
        self.faults = faults
        self.audit = audit
        self.dataset = task.dataset_fn()
        self.dataset_len = len(self.dataset)
        self.collate = task.collate_fn or _default_collate
        self.eval_dataset = task.eval_dataset_fn() if (train.eval_every and task.eval_dataset_fn) else None
        self.cursor = CursorState(0, train.global_batch, train.seed, max(1, self.dataset_len))
        self._meta_template: torch.nn.Module | None = None
        if self.parallel.plan != "ddp" or self.parallel.pp > 1 or self.parallel.tp > 1:  # rebuilds copy it
            self._meta_template = self._build_meta_model()
        # parallel.meta_init: no rank holds the whole model; values come at the first sync or restore
        self.model = self._meta_model() if self.parallel.meta_init else self._fresh_model()
        # parameters hold no step-0 values yet: set by attach for a meta build, and for a whole (seeded)
        # build when the step-0 values come from the task's init_weights (the sync loads them)
        self.uninitialized = task.init_weights is not None
        self.pm: ParallelModel | None = None
        self.layout: Layout | None = None
        self.mesh: str | None = None  # what attach built: the plan applied and the mesh's axes
        self.state = TrainingState(self.model, self._optimizer(), self.cursor)
        self.step_stats = StepStats(None)
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.phase = "idle"  # idle | compute | collective: tells a hung rank from its waiting peers
        self.phase_since = time.time()

    def _fresh_model(self) -> torch.nn.Module:
        return self._seeded_model().to(self.device)

    def _seeded_model(self) -> torch.nn.Module:
        """The initial model on the CPU: identical on every worker (seeded), whatever its device."""
        torch.manual_seed(self.train.seed)
        return self.task.model_fn()

    def _meta_model(self) -> torch.nn.Module:
        """The model's structure with parameters on the meta device (see parallel/materialize.py): a copy
        of one built at set-up. A sharded layout rebuilds its model at every membership change, and
        copying the meta model takes ~2 ms where building it again runs every initialiser on meta tensors
        (~10 ms for the tiny GPT when idle, 25-45 ms on a recovering rank). A model that cannot be
        deep-copied is built each time."""
        if self._meta_template is None:
            return self._build_meta_model()
        try:
            return copy.deepcopy(self._meta_template)
        except Exception:  # noqa: BLE001 - e.g. a model holding a lock or an open file
            self._meta_template = None
            return self._build_meta_model()

    def _build_meta_model(self) -> torch.nn.Module:
        with params_on_meta():
            return self.task.model_fn()

    def init_from_seed(self) -> None:
        """Give a materialized model the initial values (step 0). With the task's ``init_weights`` (e.g.
        ``task.init_from``), each rank fills what it holds from that source (no collective). Otherwise the
        seeded values: rank 0 builds the model once and broadcasts it (collective over the default group);
        pipeline stages hold disjoint keys: every rank builds the seeded model on the CPU and keeps its
        stages' values (no collective)."""
        if self.task.init_weights is not None:
            self.task.init_weights(self.model)
        elif self.layout is not None and self.layout.dims.pp > 1:
            from elastictrain.parallel.pipeline import load_stage_seeded_init

            load_stage_seeded_init(self.model, self._seeded_model)
        else:
            load_seeded_init(self.model, self._seeded_model, self.rank)
        self.uninitialized = False

    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self.task.optimizer_fn(self.model.parameters())
        self.base_lrs = [g["lr"] for g in opt.param_groups]
        return opt

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def step(self) -> int:
        """Completed optimizer steps."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole state (DDP, or not attached): a peer's broadcast can restore it."""
        return self.pm is None or self.pm.replicated

    # ------------------------------------------------------------------ membership
    def attach(self, rank: int, world_size: int, generation: int, layout: Layout) -> bool:
        """Apply ``layout`` on the current default process group (collective: builds the mesh). Called
        after every regroup. Returns True if this rank's state survived the re-mesh (a replicated model
        re-wrapped in place), False if a fresh model and optimizer were built and need a restore."""
        if layout.dims.world_size != world_size:
            raise ValueError(f"layout {layout.reason!r} does not match world size {world_size}")
        if self.device.type == "cuda":  # the state may be rebuilt or reloaded next: no copy may still read it
            host_copy.settle()
        self.rank, self.world_size, self.generation, self.layout = rank, world_size, generation, layout
        mesh = build_mesh(layout.dims, self.device)
        plan = parallel_of(layout, self.parallel)
        self.mesh = f"{plan.plan}: " + " x ".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape))
        if layout.dims.pp > 1:
            return self._attach_pipeline(mesh, layout, plan)
        whole = layout.plan == "ddp" and layout.dims.tp == 1  # each rank holds the whole model
        kept = self.model is not None and self.replicated and whole
        pristine = (self.model is not None and self.pm is None and self.step == 0
                    and not isinstance(self.model, FSDPModule))
        if not kept and not pristine:  # fully_shard changed the module in place (or release() dropped it)
            # a sharded rebuild is always filled by a restore (or init_from_seed): no values needed here
            self.model = self._fresh_model() if whole else self._meta_model()
            self.uninitialized = whole and self.task.init_weights is not None
        module = (self.task.parallelize_fn or _default_parallelize)(self.model, mesh, plan)
        if has_meta_params(module):  # this rank's shards get memory now; values at restore or sync
            materialize(module, self.device)
            self.uninitialized = True
        self.pm = wrap(module, mesh)
        # (loss, stop) rides in DDP's last gradient bucket; other layouts keep a separate all-reduce
        self.step_stats = StepStats(self.pm.module if isinstance(self.pm.module, DistributedDataParallel) else None)
        if not kept:  # parameters may now be DTensors: the optimizer is built after parallelizing
            self.state = TrainingState(self.pm.model, self._optimizer(), self.cursor, step=0)
        else:
            self.state.model = self.pm.model
        return kept

    def _attach_pipeline(self, mesh: Any, layout: Layout, plan: ParallelConfig) -> bool:
        """Build this rank's pipeline stages from a fresh meta copy of the model (parallel/pipeline.py): no
        state survives a re-mesh, the values come from a restore or the seeded init. Returns False."""
        from elastictrain.parallel.pipeline import build_pipeline

        self.pm = build_pipeline(self._meta_model(), mesh, layout, self.rank, self.task.pipeline,
                                 self.task.parallelize_fn, plan, self.device,
                                 materialize_fn=materialize)
        self.model = self.pm.model
        self.uninitialized = True
        self.step_stats = StepStats(None)  # the word is all-reduced over the world (no DDP bucket to ride in)
        self.state = TrainingState(self.model, self._optimizer(), self.cursor, step=0)
        return False

    def detach(self) -> None:
        """Forget the group's wrapper (the model and its state stay)."""
        if self.pm is not None and self.pm.replicated:
            self.pm = None

    def release_wrappers(self) -> None:
        """Drop what refers to the generation's process groups but keep the (replicated) model and
        optimizer: the DDP wrapper and the step-stats handle (see ``Worker._release_groups``)."""
        if self.replicated:
            self.pm = None
        self.step_stats = StepStats(None)

    def release(self) -> None:
        """Drop this rank's sharded model, optimizer and step-stats handle: every reference this runner
        holds to the generation's mesh and process groups. Keeps the step and the data cursor; the next
        :meth:`attach` builds a fresh model, which a restore step fills. For a survivor whose step a peer broke under
        a sharded layout, after its state was snapshotted (see ``Worker._release_groups``)."""
        self.pm = None
        self.model = None
        self.state.model = None
        self.state.optimizer = None
        self.step_stats = StepStats(None)

    def _set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    # ------------------------------------------------------------------ one step
    def run_step(self, stop_requested: bool) -> tuple[StepRecord, bool]:
        """Run step ``self.step`` on every rank of the group. Returns the record and whether any rank asked
        to stop at this boundary. Raises if a collective fails (a peer died): the step is then discarded
        and ``self.step`` is unchanged unless the optimizer step was already applied everywhere."""
        if self.pm is None or self.layout is None:
            raise RuntimeError("run_step before attach(): the worker has no process group")
        s, t0 = self.step, time.perf_counter()
        number = s + 1
        g, m = self.train.global_batch, self.train.micro_batch
        # the data-parallel ranks: every stage of one pipeline and every tp rank of one group see the same samples
        d = self.layout.dims.dp
        dp_rank = self.layout.coords(self.rank)[1]
        micro = rank_micro_batches(s, dp_rank, d, m, g, self.train.seed, self.dataset_len)
        self._read_ahead(s, micro, dp_rank, d)
        self.faults.fire(rank=self.rank, step=number, point="before_step", generation=self.generation)
        self.pm.module.train()
        hooks = _LoopHooks(self, s, number, micro, dp_rank, d, stop_requested)
        done = self.pm.run_micro_batches(len(micro), self.task.loss_fn, d / g, hooks)
        # Waited for BEFORE the optimizer step: a rank that applies step s knows every rank finished its
        # backward, so "completed steps" always matches the parameters.
        stats = done.word.wait()
        seen: list[int] = []
        if self.audit:  # ids as fed by every first-stage rank of tp coordinate 0: any survivor's record holds
            # the whole step, each sample once
            mine = [int(i) for ids in micro for i in ids] if self.pm.feeds_samples else []
            gathered: list[list[int]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(gathered, mine)
            seen = [i for part in gathered for i in part]
        self._set_phase("idle")
        self._apply_optimizer(s)
        self.step = number
        self.faults.fire(rank=self.rank, step=number, point="after_step", generation=self.generation)
        eval_loss = None
        if self.eval_dataset is not None and number % self.train.eval_every == 0:
            eval_loss = self.evaluate(dp_rank, d)
        record = StepRecord(
            step=number, loss=float(stats[0]) / g, world_size=d, accum=len(micro),
            step_s=time.perf_counter() - t0, compute_s=done.compute_s, finished_at=time.time(), sample_ids=seen,
            pipeline=_pipeline_fields(self.layout, done), mesh=self.mesh, eval_loss=eval_loss,
        )
        return record, bool(stats[1] > 0)

    def evaluate(self, dp_rank: int, d: int) -> float:
        """The mean ``loss_fn`` over ``train.eval_batches`` global batches of the validation split (ids:
        ``eval_sample_ids``), without gradients and in ``eval()`` mode; collective over the group (one
        all-reduce of the loss sum). The same value on every rank and at every world size (to float
        summation order). Needs pp = tp = 1 (the config refuses eval under them)."""
        g, m = self.train.global_batch, self.train.micro_batch
        n = len(self.eval_dataset)
        module = self.pm.module
        module.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self._set_phase("compute")
        with torch.no_grad():
            for j in range(self.train.eval_batches):
                for k in range(g // (d * m)):
                    ids = eval_sample_ids(j, dp_rank, d, m, g, k, n)
                    batch = _to(self.collate([self.eval_dataset[int(i)] for i in ids]), self.device)
                    seeds = torch.zeros(len(ids), dtype=torch.long)
                    total += self.task.loss_fn(module, batch, seeds).double().sum()
        self._set_phase("collective")
        dist.all_reduce(total)
        self._set_phase("idle")
        module.train()
        return float(total) / (g * self.train.eval_batches)

    def close_data(self) -> None:
        """Stop the datasets' read-ahead threads and close their files (a dataset with ``close()``)."""
        for ds in (self.dataset, getattr(self, "eval_dataset", None)):
            close = getattr(ds, "close", None)
            if callable(close):
                close()

    def _read_ahead(self, s: int, micro: list[Any], dp_rank: int, d: int) -> None:
        """A dataset with ``prefetch(ids)`` (a prepared corpus on S3) starts reading this step's and the next
        step's windows of this rank in its own threads: the next step's data loads behind this step."""
        prefetch = getattr(self.dataset, "prefetch", None)
        if prefetch is None:
            return
        nxt = rank_micro_batches(s + 1, dp_rank, d, self.train.micro_batch, self.train.global_batch,
                                 self.train.seed, self.dataset_len)
        prefetch([int(i) for ids in micro + nxt for i in ids])

    def _apply_optimizer(self, s: int) -> None:
        if self.device.type == "cuda":  # checkpoint / snapshot copies still reading the state finish first
            host_copy.before_state_write()
        if self.task.grad_clip:  # DTensor-aware: the norm of sharded gradients is reduced over the mesh
            # CPU: the per-tensor loop (bitwise stable); CUDA: foreach kernels
            foreach = True if self.device.type == "cuda" else False
            optim.clip_grad_norm(self.model.parameters(), self.task.grad_clip, foreach=foreach,
                                 across=self.pm.clip_group)
        mult = self.task.lr_fn(s) if self.task.lr_fn else 1.0
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * mult
        optim.step(self.optimizer)  # elementwise torch.optim optimizers: on the local shards (parallel/optim.py)
        # DDP's gradients are views of its buckets: zeroed in place, not freed (ParallelModel.grads_in_buckets)
        self.optimizer.zero_grad(set_to_none=not self.pm.grads_in_buckets)

    def discard_partial_step(self) -> None:
        """Drop gradients of a step that failed mid-way (no optimizer step was applied)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._set_phase("idle")

    def state_digest(self) -> dict[str, Any] | None:
        """Fingerprint of the whole model for tests: a bitwise hash of the full state by name. Collective
        under a sharded layout; the digest is on rank 0 (None elsewhere)."""
        import hashlib

        full = self.state.full_model_state()
        if self.rank != 0:
            return None
        h = hashlib.sha256()
        for name, t in sorted(full.items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
        return {"step": self.step, "sha256": h.hexdigest()}


class _LoopHooks:
    """The step loop's side of ``ParallelModel.run_micro_batches`` (parallel/parallelize.py ``StepHooks``):
    data, watchdog phases, the global RNG, fault points and the (loss, stop) word of one step."""

    def __init__(self, runner: StepRunner, s: int, number: int, micro: list[Any], dp_rank: int, d: int,
                 stop_requested: bool) -> None:
        self.r, self.s, self.number, self.micro = runner, s, number, micro
        self.dp_rank, self.d, self.stop_requested = dp_rank, d, stop_requested

    def load(self, k: int) -> MicroBatch:
        r, ids = self.r, self.micro[k]
        batch = _to(r.collate([r.dataset[int(i)] for i in ids]), r.device)
        seeds = torch.tensor([sample_seed(r.train.seed, self.s, int(i)) for i in ids], dtype=torch.long)
        return MicroBatch([int(i) for i in ids], batch, seeds)

    def phase(self, name: str) -> None:
        self.r._set_phase(name)

    def seed(self, k: int) -> None:  # global RNG: (seed, step, chunk)
        seed_micro_batch(self.r.train.seed, self.s, k * self.d + self.dp_rank)

    def forwarded(self, k: int) -> None:
        r = self.r
        delay = r.faults.extra_delay(rank=r.rank, step=self.number, generation=r.generation)
        if delay:
            time.sleep(delay)
        if k == 0:
            r.faults.fire(rank=r.rank, step=self.number, point="mid_step", generation=r.generation)

    def last_loss(self, loss: torch.Tensor) -> None:
        self.r.faults.arm_backward(loss, rank=self.r.rank, step=self.number, generation=self.r.generation)

    def send(self, loss_sum: torch.Tensor) -> Any:
        flag = torch.tensor(1.0 if self.stop_requested else 0.0, dtype=torch.float64, device=loss_sum.device)
        return self.r.step_stats.send(torch.stack([loss_sum, flag]))


def _pipeline_fields(layout: Layout, done: MicroStepResult) -> dict[str, Any] | None:
    """A step event's pipeline fields: the schedule's bubble from its own timeline (unit costs, pure:
    parallel/bubble.py) and this rank's measured idle share of ``schedule.step``."""
    if done.schedule is None:
        return None
    timeline = schedule_bubble(done.schedule, layout.dims.pp, done.n_microbatches or 0, done.stages_per_rank or 1)
    return {"pp": layout.dims.pp, "schedule": done.schedule, "n_microbatches": done.n_microbatches,
            "stages_per_rank": done.stages_per_rank, "bubble_timeline": round(timeline, 4),
            "bubble_measured": round(done.idle_share, 4)}


def parallel_of(layout: Layout, base: ParallelConfig) -> ParallelConfig:
    """The ``parallel`` settings a generation runs: ``base`` (the job's: mixed precision, activation
    checkpointing, resharding...) with the layout's own keys taken from ``layout``, the single source for a
    running generation (under ``parallel.plan: auto`` the controller may re-plan it at a resize)."""
    d = layout.dims
    return base.model_copy(update={
        "plan": d.plan, "shard_size": d.dp_shard if d.plan == "hsdp" else base.shard_size, "pp": d.pp, "tp": d.tp,
        "pp_schedule": layout.pp_schedule if d.pp > 1 else base.pp_schedule,
        "stages_per_rank": layout.stages_per_rank if d.pp > 1 else base.stages_per_rank,
        "sequence_parallel": layout.sp if d.tp > 1 else None})


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _default_parallelize(model: torch.nn.Module, mesh: Any, plan: ParallelConfig) -> torch.nn.Module:
    from elastictrain.parallel.parallelize import parallelize

    return parallelize(model, mesh, plan)
