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
import math
import threading
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
from elastictrain.data.prefetch import BatchPrefetcher
from elastictrain.models.gpt import sample_seeds
from elastictrain.parallel.init import init_by_name, inits_by_name
from elastictrain.parallel.materialize import has_meta_params, load_seeded_init, materialize, params_on_meta
from elastictrain.parallel import optim
from elastictrain.parallel.bubble import schedule_bubble
from elastictrain.models.moe import moe_layers
from elastictrain.parallel.expert_wiring import ExpertParallel, TokenTally, attach_expert_parallel
from elastictrain.parallel.context_wiring import shard_batch
from elastictrain.parallel.context_wiring import wire_model as wire_context_parallel
from elastictrain.parallel.mesh import build_mesh
from elastictrain.parallel.parallelize import MicroBatch, MicroStepResult, ParallelModel, _has_dtensor, wrap
from elastictrain.parallel.layout import Layout
from elastictrain.parallel.precision import autocast, autocast_dtype
from elastictrain.parallel.train_state import TrainingState
from elastictrain.task import Task
from elastictrain.worker import memory_peak
from elastictrain.worker.errors import framework_collective
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
    tokens: int = 0  # tokens of the whole global batch (0: unknown sample length)
    flops_per_token: float | None = None  # the model's training FLOPs per token (elastictrain/flops.py)
    peak_flops: float | None = None  # this rank's device's peak FLOP/s (None on CPU or an unknown GPU)
    devices: int = 1  # ranks the step ran on (the whole world: pp x dp x tp)
    compile_s: float | None = None  # parallel.compile: the generation's first step, compiling included
    eval_loss: float | None = None  # mean validation loss after this step (train.eval_every)
    memory: dict[str, float] | None = None  # this rank's peak memory over the step, MiB (worker/memory_peak.py)
    skipped: str | None = None  # the step's update was skipped: why (non-finite loss or gradient norm)
    tokens_per_expert: dict[str, list[int]] | None = None  # MoE: token slots per expert per layer, all data ranks


class StepAborted(dist.DistError):
    """This generation's group was aborted (``StepRunner.abort``) before the step committed: its collectives
    may not have completed, so the step is discarded. A communication failure by its type (a
    ``torch.distributed.DistError``, worker/errors.py), like the error NCCL raises on an aborted
    communicator."""


def _default_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class StepRunner:
    """Model, optimizer and data of one worker, and the code that runs one step on the current group.

    Per generation :meth:`attach` builds the mesh, applies the layout and (for a sharded layout, or a
    change of layout) builds a fresh model and optimizer; the state then comes from a restore step
    (:attr:`state`'s ``load_from`` over any DCP reader, or a replicated peer's broadcast)."""

    def __init__(self, task: Task, train: TrainConfig, faults: FaultInjector, audit: bool = False,
                 parallel: ParallelConfig | None = None, device: torch.device | None = None,
                 stop: threading.Event | None = None) -> None:
        self.task = task
        self.train = train
        self.parallel = parallel or ParallelConfig()
        self.device = device or torch.device("cpu")
        self.faults = faults
        self.audit = audit
        self.dataset = task.dataset_fn()
        self.dataset_len = len(self.dataset)
        self.collate = task.collate_fn or _default_collate
        # a dataset that reads by range (``prefetch``: a prepared corpus) gets its next step's batches assembled
        # in a thread behind this step (data/prefetch.py); an in-memory one is read in the step, as it costs little
        # a prepared corpus reads a whole micro-batch into one array when the collate is the default one
        fast = getattr(self.dataset, "batch", None) if task.collate_fn is None else None
        self.batches = (BatchPrefetcher(self.dataset, self.collate, batch=fast)
                        if hasattr(self.dataset, "prefetch") else None)
        self.eval_dataset = task.eval_dataset_fn() if (train.eval_every and task.eval_dataset_fn) else None
        self.cursor = CursorState(0, train.global_batch, train.seed, max(1, self.dataset_len))
        self._meta_template: torch.nn.Module | None = None
        if self.parallel.plan != "ddp" or self.parallel.pp > 1 or self.parallel.tp > 1 or self.parallel.ep > 1:
            # a sharded layout's rebuilds copy it
            self._meta_template = self._build_meta_model()
        # parallel.meta_init: no rank holds the whole model; values come at the first sync or restore
        self.model = self._meta_model() if self.parallel.meta_init else self._fresh_model()
        # parameters hold no step-0 values yet: set by attach for a meta build, and for a whole (seeded)
        # build when the step-0 values come from the task's init_weights (the sync loads them)
        self.uninitialized = task.init_weights is not None
        self.pm: ParallelModel | None = None
        self.ep: ExpertParallel | None = None  # parallel.ep > 1: this generation's expert-parallel wiring
        self.moe = False  # the model has MoE layers (set by attach)
        self.layout: Layout | None = None
        self.mesh: str | None = None  # what attach built: the plan applied and the mesh's axes
        self.state = TrainingState(self.model, self._optimizer(), self.cursor)
        self.step_stats = StepStats(None)
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.phase = "idle"  # idle | data | compute | collective: tells a hung rank from its waiting peers
        self.phase_since = time.time()
        # set by abort() (the controller's abort_group, from another thread) for the generation it names:
        # no step of an aborted generation commits (``_commit_gate``)
        self.aborted = threading.Event()
        # the host's request to stop the generation at the next step boundary (``Worker.request_stop``; the
        # caller of run_step reads it too): a ``hold`` fault waits for it
        self.stop = stop if stop is not None else threading.Event()
        faults.bind(abort=lambda: self.abort(self.generation), stall=self._stall, hold=self._hold)
        self._speed_setup()

    def _speed_setup(self) -> None:
        """float8's and compile's checks (a clear error at set-up), the MFU inputs, the step profiler."""
        from elastictrain.flops import device_peak_flops, model_flops_per_token
        from elastictrain.parallel.speed import SpeedSetupError, compile_unavailable, float8_unavailable
        from elastictrain.worker.profile import StepProfiler

        if self.parallel.float8 and (why := float8_unavailable(self.device)):
            raise SpeedSetupError(why)
        if self.parallel.compile and (why := compile_unavailable(self.device)):
            raise SpeedSetupError(why)
        seq_len = _sample_length(self.dataset) if self.dataset_len else None
        self.tokens_per_step = self.train.global_batch * seq_len if seq_len else 0
        self.flops_per_token = model_flops_per_token(self.model, seq_len) if seq_len else None
        self.peak_flops = device_peak_flops(self.device)
        self.profiler = StepProfiler(self.train.profile, self.device)
        self._compile_pending = False  # the next step is a generation's first under parallel.compile

    def _fresh_model(self) -> torch.nn.Module:
        model = self._seeded_model()
        if inits_by_name(model):  # the values every layout starts from (parallel/init.py)
            init_by_name(model, model, self.train.seed)
        return model.to(self.device)

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
        ``task.init_from``), each rank fills what it holds from that source (no collective). A model that
        initialises itself by module name (parallel/init.py): each rank fills its own parameters, one module
        at a time, no collective and never the whole model. Otherwise rank 0 builds the model once and
        broadcasts it (collective over the default group); pipeline stages hold disjoint keys, so there every
        rank builds the seeded model on the CPU and keeps its stages' values (no collective)."""
        if self.task.init_weights is not None:
            self.task.init_weights(self.model)
        elif inits_by_name(root := (self._meta_template if self._meta_template is not None
                                    else self._build_meta_model())):
            init_by_name(self.model, root, self.train.seed)
        elif self.layout is not None and self.layout.dims.pp > 1:
            from elastictrain.parallel.pipeline import load_stage_seeded_init

            load_stage_seeded_init(self.model, self._seeded_model)
        else:
            load_seeded_init(self.model, self._seeded_model, self.rank)
        self.uninitialized = False

    def compile_ahead(self) -> bool:
        """``parallel.compile``'s work done before this runner trains (a standby's set-up ahead, no group yet):
        :func:`elastictrain.parallel.speed.compile_ahead` on this model with the job's first micro-batch
        shape (the first ``train.micro_batch`` samples, on this device). A layout that keeps this model
        (ddp: :meth:`attach` keeps a pristine whole model; fsdp without meta_init shards it in place) trains
        the blocks compiled here; one that rebuilds it (tp, pp, meta_init) compiles its own, which torch's
        caches may serve. Returns whether it ran (False: compile off, float8, a meta model, or no data)."""
        from elastictrain.parallel.speed import compile_ahead

        if not self.parallel.compile or self.pm is not None or self.step != 0 or self.model is None or not self.dataset_len:
            return False  # (before reading any sample: a standby without compile reads none)
        ids = list(range(min(self.train.micro_batch, self.dataset_len)))
        batch = _to(self.collate([self.dataset[i] for i in ids]), self.device)
        return compile_ahead(self.model, self.parallel, self.task.loss_fn, batch, sample_seeds(self.train.seed, 0, ids))

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
        """Every rank holds the whole state (:attr:`MeshDims.holds_whole_state`, or not attached): a peer's
        broadcast can restore it."""
        return self.layout is None or self.layout.dims.holds_whole_state

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
        if self.batches is not None:  # another group, maybe another step: its first step schedules its own
            self.batches.reset()
        self.aborted.clear()  # a new generation's group: an abort of an earlier one is not about it
        self.ep, self.moe = None, False  # (set again below for this generation's layout)
        mesh = build_mesh(layout.dims, self.device)
        plan = parallel_of(layout, self.parallel)
        self.mesh = f"{plan.plan}: " + " x ".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape))
        self._compile_pending = plan.compile  # compiled lazily: in this generation's first step
        if layout.dims.pp > 1:
            return self._attach_pipeline(mesh, layout, plan)
        whole = layout.dims.holds_whole_state  # each rank holds the whole model (no tp, no FSDP)
        kept = self.model is not None and self.replicated and whole
        pristine = (self.model is not None and self.pm is None and self.step == 0
                    and not isinstance(self.model, FSDPModule))
        if not kept and not pristine:  # fully_shard changed the module in place (or release() dropped it)
            # a sharded rebuild (expert-parallel ones included) is always filled by a restore (or
            # init_from_seed): built on meta, no values needed here
            self.model = self._fresh_model() if whole else self._meta_model()
            self.uninitialized = whole and self.task.init_weights is not None
        # experts sharded over the ep mesh and hidden from DDP, before parallelize_fn wraps the model
        self.ep = attach_expert_parallel(self.model, layout.dims, self.device)
        if self.ep is not None and not self.ep.fsdp and has_meta_params(self.model):
            # ddp x ep: DDP takes no meta tensors; the dense part gets memory whole, the experts only the
            # ep slice this rank holds (no rank ever holds the others' experts)
            materialize(self.model, self.device)
            self.uninitialized = True
        module = (self.task.parallelize_fn or _default_parallelize)(self.model, mesh, plan)
        if has_meta_params(module):  # this rank's shards get memory now; values at restore or sync
            materialize(module, self.device)
            self.uninitialized = True
        self.pm = wrap(module, mesh)
        self.pm.autocast_dtype = autocast_dtype(plan.mixed_precision, self.pm.model)  # bf16 without FSDP
        self.moe = bool(moe_layers(self.pm.model))  # token counts per expert go into the step events
        wire_context_parallel(self.pm, mesh, layout.dims, rank)  # cp group on the hooks; who counts (cp 0)
        if whole and (isinstance(module, FSDPModule) or _has_dtensor(module)):
            raise RuntimeError(f"layout {layout.reason!r} holds the whole state on every rank, but the "
                               "parallelize_fn returned sharded parameters (DTensors): under parallel.plan=ddp "
                               "it must keep plain parameters; use parallel.plan=fsdp or hsdp to shard")
        # (loss, stop) rides in DDP's last gradient bucket; other layouts keep a separate all-reduce
        self.step_stats = StepStats(self.pm.module if isinstance(self.pm.module, DistributedDataParallel) else None)
        if not kept:  # parameters may now be DTensors: the optimizer is built after parallelizing
            self.state = TrainingState(self.pm.model, self._optimizer(), self.cursor, step=0)
        else:
            self.state.model = self.pm.model
        return kept

    def _attach_pipeline(self, mesh: Any, layout: Layout, parallel: ParallelConfig) -> bool:
        """Build this rank's pipeline stages from a fresh meta copy of the model (parallel/pipeline.py): no
        state survives a re-mesh, the values come from a restore or the seeded init. Returns False."""
        from elastictrain.parallel.expert_pipeline import stage_expert_parallel
        from elastictrain.parallel.pipeline import build_pipeline

        self.ep = stage_expert_parallel(layout.dims, self.device)  # ep x pp: each stage's experts over its dp ranks
        self.pm = build_pipeline(self._meta_model(), mesh, layout, self.rank, self.task.pipeline,
                                 self.task.parallelize_fn, parallel, self.device,
                                 materialize_fn=materialize, ep_mesh=None if self.ep is None else self.ep.mesh)
        self.moe = self.pm.token_tally is not None  # token counts per expert go into the step events
        self.model = self.pm.model
        self.uninitialized = True
        self.step_stats = StepStats(None)  # the word is all-reduced over the world (no DDP bucket to ride in)
        self.state = TrainingState(self.model, self._optimizer(), self.cursor, step=0)
        return False

    def detach(self) -> None:
        """Forget the group's wrapper (the model and its state stay)."""
        if self.replicated:
            self.pm = None

    def release_wrappers(self) -> None:
        """Drop what refers to the generation's process groups but keep the (replicated) model and
        optimizer: the DDP wrapper and the step-stats handle (see ``Worker._release_groups``)."""
        if self.replicated:
            self.pm = None
        self.ep = None  # (holds the generation's ep mesh; a sharded model is rebuilt at the next attach)
        self.step_stats = StepStats(None)

    def release(self) -> None:
        """Drop this rank's sharded model, optimizer and step-stats handle: every reference this runner
        holds to the generation's mesh and process groups. Keeps the step and the data cursor; the next
        :meth:`attach` builds a fresh model, which a restore step fills. For a survivor whose step a peer broke under
        a sharded layout, after its state was snapshotted (see ``Worker._release_groups``)."""
        self.pm = None
        self.ep = None
        self.model = None
        self.state.model = None
        self.state.optimizer = None
        self.step_stats = StepStats(None)

    def _set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    # ------------------------------------------------------------------ one step
    def run_step(self, stop_requested: bool) -> tuple[StepRecord, bool]:
        """Run step ``self.step`` on every rank of the group. Returns the record and whether any rank asked
        to stop at this boundary. Raises if a collective fails (a peer died) or the group was aborted before
        the step committed (:class:`StepAborted`): the step is then discarded, nothing of the state was
        written and ``self.step`` is unchanged (only an ``after_step`` fault raises after the commit)."""
        if self.pm is None or self.layout is None:
            raise RuntimeError("run_step before attach(): the worker has no process group")
        s, t0 = self.step, time.perf_counter()
        number = s + 1
        g, m = self.train.global_batch, self.train.micro_batch
        # the data-parallel ranks: every stage of one pipeline and every tp rank of one group see the same samples
        d = self.layout.dims.dp
        dp_rank = self.layout.dims.dp_rank(self.rank)
        micro = rank_micro_batches(s, dp_rank, d, m, g, self.train.seed, self.dataset_len)
        self._read_ahead(s, micro, dp_rank, d)
        # a hold here ended by the stop makes this step the generation's last (its word carries the stop)
        if self.faults.fire(rank=self.rank, step=number, point="before_step", generation=self.generation):
            stop_requested = True
        if not self.pm.module.training:  # (evaluation leaves it in eval mode; train() walks every module)
            self.pm.module.train()
        hooks = _LoopHooks(self, s, number, micro, dp_rank, d, stop_requested)
        with self.profiler.around(self.rank, number):
            done, stats = self._forward_backward(micro, hooks, d / g)
            skipped = self._finish_step(s, number, micro, stats, hooks.loss_sum)
        eval_loss = None
        if self.eval_dataset is not None and number % self.train.eval_every == 0:
            eval_loss = self.evaluate(dp_rank, d)
        step_s = time.perf_counter() - t0
        compile_s, self._compile_pending = (step_s if self._compile_pending else None), False
        record = StepRecord(
            step=number, loss=float(stats[0]) / g, world_size=d, accum=len(micro),
            step_s=step_s, compute_s=done.compute_s, finished_at=time.time(),
            sample_ids=self._seen, pipeline=_pipeline_fields(self.layout, done), mesh=self.mesh,
            memory=memory_peak.read_and_reset(self.device), skipped=skipped,
            tokens_per_expert=hooks.tokens_per_expert,
            tokens=self.tokens_per_step, flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
            devices=self.layout.dims.world_size, compile_s=compile_s, eval_loss=eval_loss,
        )
        return record, bool(stats[1] > 0)

    def _forward_backward(self, micro: list[Any], hooks: _LoopHooks, scale: float) -> tuple[MicroStepResult, Any]:
        done = self.pm.run_micro_batches(len(micro), self.task.loss_fn, scale, hooks)
        # Waited for BEFORE the optimizer step: a rank that applies step s knows every rank finished its
        # backward, so "completed steps" always matches the parameters.
        with framework_collective():
            word = done.word.wait()
            if self.ep is not None:  # experts (ddp): summed over their replicas and scaled, before the clip
                self.ep.reduce_grads(self.pm.model)
            if self.moe and (self.layout.dims.tp == 1 or self.ep is not None):
                tp = self.layout.dims.tp  # ep x tp: each tp rank holds its tp group's whole counts
                hooks.tokens_per_expert = (hooks.tally.total(dist.group.WORLD, tp) if self.pm.token_tally is None
                                           else self.pm.token_tally.total(dist.group.WORLD, self.device, tp))
        return done, word

    def _finish_step(self, s: int, number: int, micro: list[Any], stats: Any,
                     local_loss: torch.Tensor | None) -> str | None:
        """The audit, the commit and the optimizer; returns why the update was skipped, or None."""
        seen: list[int] = []
        if self.audit:  # ids as fed by every first-stage rank of tp coordinate 0: any survivor's record holds
            # the whole step, each sample once
            mine = [int(i) for ids in micro for i in ids] if self.pm.feeds_samples else []
            gathered: list[list[int]] = [[] for _ in range(self.world_size)]
            with framework_collective():
                dist.all_gather_object(gathered, mine)
            seen = [i for part in gathered for i in part]
        self._seen = seen
        # still "collective": under NCCL the wait above returned at once and the device sync in the commit gate
        # is where this rank waits for its peers (detect.find_hangs must see a waiting rank, not an idle one)
        self.faults.fire(rank=self.rank, step=number, point="commit", generation=self.generation)
        with framework_collective():  # the clip's norm and a sharded optimizer reduce over the mesh
            skipped = self._apply_optimizer(s, stats, local_loss)
        self._set_phase("idle")
        self.step = number
        self.faults.fire(rank=self.rank, step=number, point="after_step", generation=self.generation)
        return skipped

    def evaluate(self, dp_rank: int, d: int) -> float:
        """The mean ``loss_fn`` over ``train.eval_batches`` global batches of the validation split (ids:
        ``eval_sample_ids``), without gradients and in ``eval()`` mode; collective over the group (the
        layout's forward, then one all-reduce of the loss sum). The same value on every rank and at every
        world size and layout (to float summation order). The parallelized model runs the forward
        (:meth:`~elastictrain.parallel.parallelize.ParallelModel.eval_loss_sum`): every tp rank together
        under ``loss_parallel``, a pipeline's stages in a forward-only pass of its schedule, each cp rank its
        positions; one rank of each data-parallel rank's tp/cp group counts the per-sample losses. A
        pipeline's last stage applies ``Task.pipeline.loss_fn`` (the task's ``loss_fn`` is not used there)."""
        g, m = self.train.global_batch, self.train.micro_batch
        n = len(self.eval_dataset)
        module = self.pm.module
        module.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        # a prepared split with the default collate reads a micro-batch's (adjacent) windows in one read
        read = getattr(self.eval_dataset, "batch", None) if self.task.collate_fn is None else None
        with torch.no_grad():
            for j in range(self.train.eval_batches):
                mbs = []
                for k in range(g // (d * m)):
                    ids = eval_sample_ids(j, dp_rank, d, m, g, k, n)
                    self._set_phase("data")  # storage, not compute (the watchdog names a stall here)
                    host = read(ids) if read else self.collate([self.eval_dataset[int(i)] for i in ids])
                    batch = shard_batch(_to(host, self.device), self.layout.dims, self.rank)
                    mbs.append(MicroBatch([int(i) for i in ids], batch, torch.zeros(len(ids), dtype=torch.long)))
                self._set_phase("compute")
                total += self.pm.eval_loss_sum(mbs, self.task.loss_fn)  # (collective under tp, cp, pp, fsdp)
        self._set_phase("collective")
        dist.all_reduce(total)
        self._set_phase("idle")
        module.train()
        return float(total) / (g * self.train.eval_batches)

    def close_data(self) -> None:
        """Stop the batch read-ahead and the datasets' read-ahead threads, and close their files (a dataset with
        ``close()``)."""
        if self.batches is not None:
            self.batches.close()
        for ds in (self.dataset, getattr(self, "eval_dataset", None)):
            close = getattr(ds, "close", None)
            if callable(close):
                close()

    def _read_ahead(self, s: int, micro: list[Any], dp_rank: int, d: int) -> None:
        """With a batch read-ahead (a dataset with ``prefetch(batches)``: a prepared corpus), schedule this step's
        micro-batches of this rank and those of the next ``train.read_ahead_steps`` steps (none past
        ``train.steps``), in step order: they are read (the dataset's ranged reads in its own threads) and
        stacked in the read-ahead's thread while this step computes, so a slow read has that many steps to
        land. What is held is bounded by those steps' batches (the read-ahead drops any not scheduled again)."""
        if self.batches is None:
            return
        ahead = list(micro)
        for t in range(s + 1, min(s + 1 + self.train.read_ahead_steps, self.train.steps)):
            ahead += rank_micro_batches(t, dp_rank, d, self.train.micro_batch, self.train.global_batch,
                                        self.train.seed, self.dataset_len)
        self.batches.schedule(ahead)

    def _apply_optimizer(self, s: int, word: torch.Tensor, local_loss: torch.Tensor | None) -> str | None:
        """Commit step ``s``: clip, check, then the optimizer. Nothing of the training state is written
        before :meth:`_commit_gate` says every collective of the step completed on this generation's
        group. A non-finite reduced loss or gradient norm (the same numbers on every rank, so the same
        decision everywhere) skips the update: gradients dropped, the step still counts. Returns why the
        update was skipped, or None."""
        if self.device.type == "cuda":  # checkpoint / snapshot copies still reading the state finish first
            host_copy.before_state_write()
        loss_ok = math.isfinite(float(word[0]))  # the reduced word: identical on every rank
        norm = None
        if self.task.grad_clip and loss_ok:  # DTensor-aware: the norm of sharded gradients is reduced over the mesh
            # CPU: the per-tensor loop (bitwise stable); CUDA: foreach kernels
            foreach = True if self.device.type == "cuda" else False
            norm = optim.clip_grad_norm(self.model.parameters(), self.task.grad_clip, foreach=foreach,
                                        across=self.pm.clip_group, uncounted=self.pm.clip_uncounted)
        self._commit_gate()
        skipped = None
        if not loss_ok:
            skipped = f"non-finite loss ({self._nonfinite_ranks(local_loss)})"
        elif norm is not None and not math.isfinite(float(norm)):
            skipped = "non-finite gradient norm (of the reduced gradients: no single rank to name)"
        if skipped is None:
            mult = self.task.lr_fn(s) if self.task.lr_fn else 1.0
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * mult
            optim.step(self.optimizer)  # elementwise torch.optim optimizers: on the local shards (parallel/optim.py)
        # DDP's gradients are views of its buckets: zeroed in place, not freed (ParallelModel.grads_in_buckets)
        self.optimizer.zero_grad(set_to_none=not self.pm.grads_in_buckets)
        return skipped

    def _commit_gate(self) -> None:
        """Raise :class:`StepAborted` unless every collective of the step is known to have completed on this
        generation's group. On CUDA a collective's ``wait`` does not block the host: the device sync here
        does (an aborted communicator's kernels exit early, leaving partial reductions behind), then the
        abort flag (``abort``) and the NCCL backend's own error state are checked. Under gloo the waits
        blocked already; the flag is checked all the same."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.aborted.is_set():
            raise StepAborted(f"generation {self.generation}'s group was aborted before step {self.step + 1} "
                              "committed: the step is discarded")
        error = _backend_error(self.device)
        if error is not None:
            raise StepAborted(f"the NCCL communicator reports {error} before step {self.step + 1} committed: "
                              "the step is discarded (aborted)")

    def _nonfinite_ranks(self, local_loss: torch.Tensor | None) -> str:
        """Which ranks' own loss was non-finite: the lowest of them by one more all-reduce (MIN), made only
        on a skipped step, by every rank alike (they all took the same decision)."""
        bad = local_loss is not None and not bool(torch.isfinite(local_loss))
        mine = torch.tensor([float(self.rank if bad else self.world_size), 1.0 if bad else 0.0],
                            dtype=torch.float64, device=local_loss.device if local_loss is not None else self.device)
        lowest = mine[:1].clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        count = mine[1:].clone()
        dist.all_reduce(count)
        n, first = int(count.item()), int(lowest.item())
        if n == 0:
            return "no rank's own loss was: the reduction made it"
        return f"rank {first}" + (f" and {n - 1} other rank(s)" if n > 1 else "")

    def abort(self, generation: int | None = None) -> bool:
        """Mark generation ``generation``'s group aborted (None: the current one): its step in flight, if not
        committed yet, is discarded. Thread-safe; ignored for another generation. Returns whether marked."""
        if generation is not None and generation != self.generation:
            return False
        self.aborted.set()
        return True

    def _stall(self) -> None:
        """The ``stall`` fault: wait in phase "collective" until the group is aborted, then fail like an
        aborted collective (see worker/faults.py)."""
        self._set_phase("collective")
        self.aborted.wait()
        raise StepAborted(f"generation {self.generation}'s group was aborted while rank {self.rank} waited in a "
                          "stalled collective")

    def _hold(self, seconds: float) -> bool:
        """The ``hold`` fault (worker/faults.py): wait until the stop is asked (:attr:`stop`) or this
        generation's group is aborted, at most ``seconds``, in phase "compute" (a slow step to the watchdog);
        both flags are set from other threads and looked at every 50 ms. Returns whether the stop was asked."""
        before = self.phase
        self._set_phase("compute")
        deadline = time.monotonic() + seconds
        while not (self.stop.is_set() or self.aborted.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.stop.wait(min(left, 0.05))
        self._set_phase(before)
        return self.stop.is_set()

    def discard_partial_step(self) -> None:
        """Drop gradients of a step that failed mid-way (no optimizer step was applied)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._set_phase("idle")

    def digest_part(self) -> dict[str, list[Any]]:
        """This rank's part of the whole model's fingerprint (parallel/digest.py): hashes of the elements
        it holds, each replicated copy counted once. No collective; the driver combines the parts."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from elastictrain.parallel.digest import local_part

        coord = {} if self.layout is None else self.layout.dims.coord(self.rank)
        along = {"dp": self.layout is None or self.layout.dims.dp_rank(self.rank) == 0,
                 "tp": coord.get("tp", 0) == 0, "cp": coord.get("cp", 0) == 0}
        if self.layout is not None and self.layout.dims.ep > 1:  # experts: replicated over the ep groups only
            along["edp"] = self.layout.dims.edp_coord(self.rank) == 0
        skip = getattr(self.state.model, "uncounted_names", frozenset())  # a tied copy (parallel/tied.py)
        state = {k: v for k, v in get_model_state_dict(self.state.model).items() if k not in skip}
        return local_part(state, plain_primary=all(along.values()), primary_along=along)


class _LoopHooks:
    """The step loop's side of ``ParallelModel.run_micro_batches`` (parallel/parallelize.py ``StepHooks``):
    data, watchdog phases, the global RNG, fault points and the (loss, stop) word of one step."""

    def __init__(self, runner: StepRunner, s: int, number: int, micro: list[Any], dp_rank: int, d: int,
                 stop_requested: bool) -> None:
        self.r, self.s, self.number, self.micro = runner, s, number, micro
        self.dp_rank, self.d, self.stop_requested = dp_rank, d, stop_requested
        self.loss_sum: torch.Tensor | None = None
        self.tally = TokenTally()  # MoE token counts of each micro-batch's forward
        self.tokens_per_expert: dict[str, list[int]] | None = None

    def load(self, k: int) -> MicroBatch:
        r, ids = self.r, self.micro[k]
        r._set_phase("data")  # waiting on storage is not computing: the watchdog names it, never replaces it
        if r.batches is not None:  # assembled behind the previous step (the same batch a read here gives)
            batch = r.batches.take(ids)
            r._set_phase("compute")
        else:
            samples = [r.dataset[int(i)] for i in ids]
            r._set_phase("compute")
            batch = r.collate(samples)
        batch = _to(batch, r.device)
        batch = shard_batch(batch, r.layout.dims, r.rank)  # cp: this rank's positions (seeds unchanged)
        seeds = sample_seeds(r.train.seed, self.s, ids)
        return MicroBatch([int(i) for i in ids], batch, seeds)

    def phase(self, name: str) -> None:
        self.r._set_phase(name)

    def seed(self, k: int) -> None:  # global RNG: (seed, step, chunk)
        seed_micro_batch(self.r.train.seed, self.s, k * self.d + self.dp_rank)

    def forwarded(self, k: int) -> None:
        r = self.r
        if r.moe and r.pm.token_tally is None:  # (a pipeline's stages count inside its schedule)
            self.tally.add(r.pm.model)
        delay = r.faults.extra_delay(rank=r.rank, step=self.number, generation=r.generation)
        if delay:
            time.sleep(delay)
        if k == 0 and r.faults.fire(rank=r.rank, step=self.number, point="mid_step", generation=r.generation):
            self.stop_requested = True  # a hold ended by the stop: sent in this step's word (``send``)

    def last_loss(self, loss: torch.Tensor) -> None:
        r = self.r
        r.faults.arm_backward(loss, rank=r.rank, step=self.number, generation=r.generation)
        if r.faults.nan_at(rank=r.rank, step=self.number, generation=r.generation):
            loss.register_hook(lambda grad: grad * float("nan"))  # this rank's gradients non-finite too

    def send(self, loss_sum: torch.Tensor) -> Any:
        r = self.r
        if r.faults.nan_at(rank=r.rank, step=self.number, generation=r.generation):
            loss_sum = loss_sum + float("nan")
        self.loss_sum = loss_sum  # this rank's own: which rank was non-finite, on a skipped step
        flag = torch.tensor(1.0 if self.stop_requested else 0.0, dtype=torch.float64, device=loss_sum.device)
        return r.step_stats.send(torch.stack([loss_sum, flag]))


def _backend_error(device: torch.device) -> str | None:
    """The NCCL backend's error state of the default group (``Backend.get_error``), or None when it reports
    none, is not NCCL, or torch does not tell."""
    if device.type != "cuda" or not dist.is_initialized():
        return None
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        error = backend.get_error()
        from torch._C._distributed_c10d import ErrorType
    except Exception:  # noqa: BLE001 - no such backend or method in this torch: nothing to read
        return None
    return None if error == ErrorType.SUCCESS else str(error)


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
        "cp": d.cp, "ep": d.ep,
        "pp_schedule": layout.pp_schedule if d.pp > 1 else base.pp_schedule,
        "stages_per_rank": layout.stages_per_rank if d.pp > 1 else base.stages_per_rank,
        "sequence_parallel": layout.sp if d.tp > 1 else None})


def _sample_length(dataset: Any) -> int | None:
    """Tokens of one sample (its ``input`` / ``input_ids`` tensor's length), or None if it has neither."""
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed here: no token count
        return None
    for key in ("input", "input_ids"):
        value = sample.get(key) if isinstance(sample, dict) else None
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[-1])
    return None


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _default_parallelize(model: torch.nn.Module, mesh: Any, parallel: ParallelConfig) -> torch.nn.Module:
    from elastictrain.parallel.parallelize import parallelize

    return parallelize(model, mesh, parallel)
