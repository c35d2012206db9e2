"""The one typed job config, loaded and validated once at the edge.

Every section is a frozen pydantic model with ``extra="forbid"``; each component receives only its own
slice. :func:`load_config` turns YAML plus ``--set dotted.key=value`` overrides into a :class:`JobConfig`
or raises :class:`ConfigError` with one readable message per problem (field, value, rule, fix).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A job config that cannot run. The message names the field, the value, the rule and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The vocabulary of the byte-level corpora (builtin:pydoc, Parquet text): one token per byte.
BYTE_VOCAB = 256


class MoESection(_Section):
    """``task.model.moe``: the built-in GPT's / Llama's mixture-of-experts feed-forward
    (elastictrain/models/moe.py): ``experts`` per MoE layer, ``top_k`` per token, every ``every``-th block."""

    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    every: int = Field(1, ge=1)
    aux_coef: float = Field(0.01, ge=0, description="weight of the per-sample load-balancing loss (0: off)")

    @model_validator(mode="after")
    def _k_fits(self) -> MoESection:
        if self.top_k > self.experts:
            raise ValueError(f"task.model.moe.top_k={self.top_k} exceeds task.model.moe.experts={self.experts} "
                             f"(each token picks top_k distinct experts); set top_k to at most {self.experts}")
        return self

    def to_moe(self) -> Any:
        """The model's :class:`elastictrain.models.moe.MoEConfig`."""
        from elastictrain.models.moe import MoEConfig  # imports torch: not on the --help path

        return MoEConfig(**self.model_dump())


class ModelConfig(_Section):
    """Built-in GPT size (``seq_len`` and ``vocab_size`` are the built-in Llama's too). Ignored by user tasks
    that bring their own module."""

    seq_len: int = Field(64, ge=2)
    vocab_size: int | None = Field(None, ge=1, description="None = the data's vocabulary: 256 for the byte "
                                                           "corpora; larger leaves unused rows")
    n_layer: int = Field(2, ge=1)
    n_head: int = Field(2, ge=1)
    d_model: int = Field(64, ge=8)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    moe: MoESection | None = Field(None, description="a mixture-of-experts feed-forward (GPT and Llama); None: dense")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick a head count that divides d_model"
            )
        return self


class LlamaTaskConfig(_Section):
    """The built-in Llama 3 (``task.kind: llama``): a named size of ``LLAMA_PRESETS`` plus overrides. The
    sequence length is ``task.model.seq_len``, the vocabulary ``task.model.vocab_size`` (None: the data's)."""

    size: str = Field("debug", description="debug | 1b | 8b | 70b | 405b (elastictrain.models.llama.LLAMA_PRESETS)")
    dim: int | None = Field(None, ge=2)
    n_layers: int | None = Field(None, ge=1)
    n_heads: int | None = Field(None, ge=1)
    n_kv_heads: int | None = Field(None, ge=1)
    ffn_hidden: int | None = Field(None, ge=1)
    rope_theta: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None

    def shape(self) -> dict[str, Any]:
        """The size's ``LlamaConfig`` keywords with the overrides applied (vocabulary and sequence length as
        the preset has them). Raises ValueError for an unknown size, naming the known ones."""
        from elastictrain.models.llama import LLAMA_PRESETS  # imports torch: not on the --help path

        if self.size not in LLAMA_PRESETS:
            raise ValueError(f"task.llama.size={self.size!r} is not a Llama size; set it to one of "
                             f"{sorted(LLAMA_PRESETS)} (and override dim, n_layers... for another shape)")
        shape = dict(LLAMA_PRESETS[self.size])
        shape.update(self.model_dump(exclude={"size"}, exclude_none=True))
        return shape

    def check(self) -> None:
        """The shape's rules, each error naming the fields, their values (``size`` or override) and the fix."""
        s = self.shape()

        def name(key: str) -> str:
            how = "set" if getattr(self, key) is not None else f"from size {self.size}"
            return f"task.llama.{key}={s[key]} ({how})"

        if s["dim"] % s["n_heads"]:
            raise ValueError(f"{name('dim')} is not divisible by {name('n_heads')}; set task.llama.dim to a "
                             "multiple of n_heads or task.llama.n_heads to a divisor of dim")
        if (s["dim"] // s["n_heads"]) % 2:
            raise ValueError(f"the head size dim / n_heads = {s['dim'] // s['n_heads']} ({name('dim')}, "
                             f"{name('n_heads')}) must be even (rotary embeddings turn pairs); change dim or n_heads")
        if s["n_heads"] % s["n_kv_heads"]:
            raise ValueError(f"{name('n_heads')} is not divisible by {name('n_kv_heads')} (grouped-query "
                             "attention: each kv head serves n_heads / n_kv_heads query heads); set "
                             "task.llama.n_kv_heads to a divisor of n_heads")


class DataConfig(_Section):
    """Where samples come from: ``builtin:pydoc``, a Parquet path / URL (local, s3://...; byte tokens), or a
    corpus prepared by ``elastictrain data prepare`` (a directory / URL holding ``manifest.json``)."""

    source: str = "builtin:pydoc"
    column: str = "text"
    storage_options: dict[str, Any] = Field(default_factory=dict)


class OptimizerConfig(_Section):
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)


class TaskConfig(_Section):
    """What to train: ``tiny_gpt`` or ``llama`` (built in) or ``python`` (``entry`` names a function returning
    a Task).

    User tasks passed to :class:`elastictrain.Trainer` replace it. With ``kind: python`` the ``model``,
    ``data`` and ``optimizer`` sections are not used; ``args`` goes to the entry function as keywords.
    """

    kind: Literal["tiny_gpt", "llama", "python"] = "tiny_gpt"
    entry: str | None = Field(None, description='"package.module:function" returning a Task (kind: python)')
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the entry function")
    model: ModelConfig = ModelConfig()
    llama: LlamaTaskConfig = LlamaTaskConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    init_from: str | None = Field(None, description="task.kind=llama: a Hugging Face model directory (local, "
                                  "Lustre or s3://...: config.json + safetensors) whose weights start the run; "
                                  "the model's shape comes from its config.json")
    init_from_storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for "
                                                      "task.init_from (e.g. an S3 endpoint)")

    @model_validator(mode="after")
    def _init_from_needs_llama(self) -> TaskConfig:
        if self.init_from is not None and self.kind != "llama":
            raise ValueError(f"task.init_from={self.init_from!r} loads Hugging Face Llama weights: it needs "
                             f"task.kind=llama (task.kind={self.kind!r}); set task.kind: llama or remove init_from")
        return self

    @property
    def data_vocab(self) -> int:
        """The vocabulary of ``task.data``: the byte corpora's 256."""
        return BYTE_VOCAB

    @property
    def vocab_size(self) -> int:
        """The built-in model's vocabulary: ``task.model.vocab_size``, else the data's."""
        return self.model.vocab_size or self.data_vocab

    @model_validator(mode="after")
    def _builtin_shape(self) -> TaskConfig:
        if self.kind == "python":
            return self
        if self.model.vocab_size is not None and self.model.vocab_size < self.data_vocab:
            raise ValueError(f"task.model.vocab_size={self.model.vocab_size} is smaller than the data's vocabulary "
                             f"({self.data_vocab} for task.data.source={self.data.source!r}): token ids would "
                             f"overflow the embedding; set task.model.vocab_size >= {self.data_vocab} or leave it null")
        if self.kind == "llama":
            self.llama.check()
        return self

    @model_validator(mode="after")
    def _entry_matches_kind(self) -> TaskConfig:
        import re

        if self.kind == "python":
            if not self.entry or not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.entry):
                raise ValueError(
                    f"task.entry={self.entry!r}: task.kind=python needs task.entry as \"package.module:function\" "
                    "(a function returning an elastictrain.Task), e.g. \"examples.hf_causal_lm:make_task\"")
        elif self.entry is not None or self.args:
            raise ValueError(f"task.entry/task.args are only used with task.kind=python (task.kind={self.kind!r}); "
                             "set task.kind: python or remove them")
        return self


class ProfileConfig(_Section):
    """``train.profile``: Chrome traces (``torch.profiler``) of the named steps on the named ranks."""

    steps: list[int] = Field(description="1-based step numbers to trace, e.g. [3, 10]")
    ranks: list[int] = Field(default_factory=lambda: [0], description="ranks that trace (default [0])")
    memory: bool = Field(False, description="also record memory: a CUDA memory snapshot on GPU, the "
                                            "profiler's profile_memory on CPU")

    @model_validator(mode="after")
    def _positive(self) -> ProfileConfig:
        bad = [v for v in (*self.steps, *self.ranks) if v < 0] + [s for s in self.steps if s == 0]
        if bad or not self.steps:
            raise ValueError(f"steps must be a non-empty list of step numbers >= 1 and ranks >= 0 "
                             f"(got steps={self.steps}, ranks={self.ranks}); e.g. {{steps: [3], ranks: [0]}}")
        return self


class TrainConfig(_Section):
    steps: int = Field(50, ge=1)
    seed: int = Field(0, ge=0)
    global_batch: int = Field(16, ge=1, description="samples per optimizer step, constant for the whole run")
    micro_batch: int = Field(4, ge=1, description="samples per forward/backward on one worker")
    log_every: int = Field(1, ge=1, description="steps between progress lines on the console")
    audit_samples: bool = Field(False, description="record every step's sample ids in its step event")
    save_final_model: bool = Field(True, description="the workers write the trained weights (sharded, DCP) to "
                                                    "RUN_DIR/final_model/ (or it is the final checkpoint)")
    profile: ProfileConfig | None = Field(None, description="torch.profiler traces of named steps and ranks "
                                                            "into RUN_DIR/profiles/ (null: none)")
    eval_every: int = Field(0, ge=0, description="steps between held-out evaluations (validation split); 0 = none")
    eval_batches: int = Field(1, ge=1, description="global batches of validation windows per evaluation")
    read_ahead_steps: int = Field(2, ge=0, le=16, description="steps whose batches a worker reads ahead of the "
                                  "one it trains (a dataset that reads by range: a prepared corpus); memory: "
                                  "that many more steps' batches of the rank")

    @model_validator(mode="after")
    def _micro_fits(self) -> TrainConfig:
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"train.global_batch={self.global_batch} is not a multiple of train.micro_batch="
                f"{self.micro_batch}; set micro_batch to a divisor of global_batch"
            )
        return self


class WorkersConfig(_Section):
    min: int = Field(1, ge=1)
    max: int = Field(2, ge=1)
    spares: int = Field(0, ge=0, description="pre-started standby workers that replace a failed one at once")
    standby: bool = Field(True, description="from the run's start, keep one worker process started ahead "
                                            "(imports done, model built, no resources) for the next replacement "
                                            "(CPU workers; see docs/config.md)")
    reuse: bool = Field(False, description="keep a cleanly finished run's worker processes for the next run of "
                                           "this driver process (CPU workers; see docs/config.md)")
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _min_le_max(self) -> WorkersConfig:
        if self.min > self.max:
            raise ValueError(f"workers.min={self.min} exceeds workers.max={self.max}; set min <= max")
        if self.reuse and self.use_gpu:
            raise ValueError("workers.reuse=true with workers.use_gpu=true: only CPU worker processes are reused "
                             "(a GPU process's device state is not given back between runs); set workers.reuse "
                             "to false")
        return self


class ParallelConfig(_Section):
    """The parallel layout; resolved per world size by :mod:`elastictrain.parallel.layout`."""

    plan: Literal["ddp", "fsdp", "hsdp", "auto"] = Field("ddp", description="auto: the planner picks the "
                                                         "layout at start (elastictrain plan)")
    calibration: str | None = Field(None, description="JSON of measured figures (elastictrain plan --calibrate) "
                                                      "that elastictrain plan and plan: auto price with")
    model_shape: str | None = Field(None, description="the model's shape for the planner when task.kind=python, "
                                                      "e.g. layers=12,hidden=768,heads=12,seq_len=1024,vocab=50257")
    reshard_after_forward: bool = Field(True, description="fsdp/hsdp: free gathered params after forward "
                                                          "(ZeRO-3); false keeps them to backward (ZeRO-2)")
    shard_size: int | None = Field(None, ge=1, description="hsdp shard group size; null = GPUs per node, "
                                                           "or 2 without GPUs")
    mixed_precision: Literal["none", "bf16"] = Field("none", description="bf16: bf16 compute, fp32 master "
                                                                        "state and gradient reduction (fsdp/"
                                                                        "hsdp: FSDP2's policy; ddp: autocast)")
    activation_checkpointing: bool | Literal["full", "selective"] = Field(
        False, description="true / full: recompute each repeated block in backward; selective: keep the "
                           "matmul and attention outputs, recompute the rest (op-level)")
    compile: bool = Field(False, description="torch.compile each repeated block (fullgraph) after activation "
                                             "checkpointing and before FSDP")
    float8: bool = Field(False, description="float8 (torchao, rowwise) matmuls in the large linears; CUDA "
                                            "GPUs of compute capability >= 8.9 with torchao installed")
    meta_init: bool = Field(False, description="fsdp/hsdp, pp > 1, tp > 1 or ep > 1: build the model on the meta "
                                               "device, split it, then give each rank's part its initial "
                                               "values (no rank holds the whole model)")
    pp: int = Field(1, ge=1, description="pipeline stages' ranks: the world is pp x the data-parallel size; "
                                         "parallel.plan lays out the data-parallel ranks of each stage")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"] = Field(
        "1f1b", description="torch.distributed.pipelining schedule (pp > 1)")
    stages_per_rank: int | None = Field(None, ge=1, description="virtual stages per pp rank; null = what the "
                                                               "schedule needs (1, or 2 for the looped ones)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks (innermost mesh axis): the world is pp x the "
                                         "data-parallel size x tp; the model's heads must divide by tp")
    sequence_parallel: bool | None = Field(None, description="tp > 1: shard norm and dropout regions on the "
                                                             "sequence; null = on when tp > 1")
    cp: int = Field(1, ge=1, description="context-parallel ranks (mesh axis between dp_shard and tp): each "
                                         "sample's sequence is split over them; the world is pp x dp x cp x tp")
    ep: int = Field(1, ge=1, description="expert-parallel ranks: groups of ep expert ranks (data-parallel x cp "
                                         "x tp ranks) that share tokens and split the experts; must divide "
                                         "a stage's dp x cp x tp (hsdp: shard_size x cp x tp) and, under tp, be a "
                                         "multiple of tp; composes with pp, cp and tp at once")

    @model_validator(mode="after")
    def _ep_composes(self) -> ParallelConfig:
        if self.ep == 1:
            return self
        from elastictrain.parallel.layout import ep_rule  # imports torch: not on the --help path

        why = ep_rule(self.cp, self.tp, self.ep, self.plan, self.pp)
        if why:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards the sequence "
                             "over the tensor-parallel ranks); set parallel.tp or leave sequence_parallel unset")
        return self

    @model_validator(mode="after")
    def _stages_fit_schedule(self) -> ParallelConfig:
        if self.stages_per_rank is None:  # every schedule name is valid then (the Literal checked it)
            return self
        from elastictrain.parallel.layout import stages_rule  # imports torch: not on the --help path

        why = stages_rule(self.pp_schedule, self.stages_per_rank)
        if why:
            raise ValueError(why)
        return self

    @property
    def ac_mode(self) -> Literal["none", "full", "selective"]:
        """``activation_checkpointing`` as one name: true is ``full``, false ``none``."""
        ac = self.activation_checkpointing
        return "selective" if ac == "selective" else "full" if ac else "none"

    @model_validator(mode="after")
    def _float8_without_tp(self) -> ParallelConfig:
        if self.float8 and self.tp > 1:
            raise ValueError(f"parallel.float8=true with parallel.tp={self.tp}: float8 linears need torchao's "
                             "float8 tensor-parallel styles, which this layout does not apply; set parallel.tp=1 "
                             "or parallel.float8=false")
        return self

    @model_validator(mode="after")
    def _meta_init_needs_sharding(self) -> ParallelConfig:
        if self.meta_init and self.plan == "ddp" and self.pp == 1 and self.tp == 1 and self.ep == 1:
            raise ValueError("parallel.meta_init=true needs a layout where no rank holds the whole model "
                             "(plain DDP holds it on every rank); set parallel.plan=fsdp (or hsdp), "
                             "parallel.pp > 1, parallel.tp > 1 or parallel.ep > 1, or parallel.meta_init=false")
        return self


class CheckpointConfig(_Section):
    uri: str | None = Field(None, description="local/Lustre path or s3://bucket/prefix; null disables")
    every_steps: int = Field(0, ge=0, description="0 disables periodic checkpoints")
    keep_last: int = Field(3, ge=1)
    keep_every: int = Field(0, ge=0, description="also keep every M-th step; 0 disables")
    resume: str = Field("auto", description="auto | never | an explicit checkpoint URI")
    max_in_flight: int = Field(1, ge=1)
    when_busy: Literal["skip", "wait"] = "skip"
    storage_options: dict[str, Any] = Field(default_factory=dict)
    on_preempt: bool = Field(True, description="write a just-in-time checkpoint when preempted")
    memory_every_steps: int = Field(10, ge=0, description="peer memory tier cadence (steps); 0 disables")
    memory_budget_gib: float | None = Field(None, gt=0, allow_inf_nan=False,
                                            description="bytes each node's peer-tier keeper may hold, in GiB; "
                                                        "null = sized from the job's state and the node's "
                                                        "free memory")
    accept_changes: list[Literal["schedule", "optimizer", "data", "task"]] = Field(
        default_factory=list, description="fingerprint keys a resume may find changed (e.g. [schedule] to extend)")


class RecoveryConfig(_Section):
    mode: Literal["elastic", "strict"] = "elastic"
    max_failures: int = Field(10, ge=0, description="failures allowed within failure_window_s")
    failure_window_s: float = Field(3600.0, gt=0, description="the window of the failure-rate budget")
    max_failures_per_rank: int = Field(3, ge=1, description="failures in a row without progress: a crash loop")
    progress_steps: int = Field(3, ge=1, description="steps after joining that count as progress")
    min_workers_wait_s: float = Field(60.0, gt=0)
    straggler_factor: float = Field(2.0, gt=1.0)
    straggler_window: int = Field(8, ge=2)
    evict_stragglers: bool = False
    max_nonfinite_steps: int = Field(3, ge=1, description="non-finite steps in a row (loss or gradient norm: their "
                                     "updates skipped) after which the run fails")


class TimeoutsConfig(_Section):
    """All timeouts in one place; their ordering is validated."""

    collective_s: float = Field(30.0, gt=0, description="a torch.distributed collective")
    step_watchdog_cap_s: float = Field(60.0, gt=0, description="hang bound cap (bound adapts to step times)")
    watchdog_factor: float = Field(10.0, gt=1.0, description="hang bound = factor x median step time")
    watchdog_floor_s: float = Field(3.0, gt=0)
    poll_s: float = Field(120.0, gt=0, description="a controller->worker call")
    restart_grace_s: float = Field(300.0, gt=0, description="a worker start-up, imports and model build")

    @model_validator(mode="after")
    def _ordered(self) -> TimeoutsConfig:
        chain = [
            ("timeouts.watchdog_floor_s", self.watchdog_floor_s),
            ("timeouts.step_watchdog_cap_s", self.step_watchdog_cap_s),
        ]
        if not self.watchdog_floor_s <= self.step_watchdog_cap_s:
            raise ValueError(_order_message(chain))
        chain = [
            ("timeouts.collective_s", self.collective_s),
            ("timeouts.step_watchdog_cap_s", self.step_watchdog_cap_s),
            ("timeouts.poll_s", self.poll_s),
            ("timeouts.restart_grace_s", self.restart_grace_s),
        ]
        values = [v for _, v in chain]
        if values != sorted(values) or len(set(values)) != len(values):
            raise ValueError(_order_message(chain))
        return self


def _order_message(chain: list[tuple[str, float]]) -> str:
    shown = " < ".join(f"{k}={v:g}" for k, v in chain)
    return f"timeouts must be strictly increasing in this order: {shown}; adjust them so that each is larger"


HOLD_POINTS = ("before_step", "mid_step", "after_step")  # where a ``hold`` fault may sit (FaultConfig)


class FaultConfig(_Section):
    """One injected fault, addressed by (rank, step, point). For tests and chaos drills."""

    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    point: Literal["before_step", "mid_step", "after_step", "backward", "commit", "finish", "join"] = "mid_step"
    kind: Literal["kill", "hang", "raise", "slow", "nan", "abort", "stall", "hold"] = "kill"
    seconds: float = Field(1.0, ge=0, description="for slow: extra seconds per step; for hold: the longest it "
                                                   "holds (a hang lasts until killed)")
    repeat: bool = Field(False, description="fire again whenever that rank reaches that step (crash loops)")
    generation: int | None = Field(0, description="only in this membership generation; null = any")

    @model_validator(mode="after")
    def _hold_points(self) -> FaultConfig:
        # a hold ends when the controller stops the generation at a step boundary: only where a step's stop
        # word is still to come (worker/faults.py)
        if self.kind == "hold" and self.point not in HOLD_POINTS:
            raise ValueError(f"faults: point={self.point!r} with kind='hold': a hold waits for the controller's "
                             f"stop at a step boundary, so it must be one of {', '.join(HOLD_POINTS)}; "
                             "use point: before_step")
        return self


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def zbv_eval_refusal(eval_every: int | None = None) -> str:
    """Why ``train.eval_every`` cannot run under ``parallel.pp_schedule=zbv``, and the fix (one line)."""
    key = "train.eval_every" if eval_every is None else f"train.eval_every={eval_every}"
    return (f"{key} with parallel.pp_schedule=zbv: torch 2.13's ZBV schedule has no "
            "forward-only pass (its V hands the last stage's output straight to its backward: schedule.eval fails "
            "with \"can't steal_bwd_input\"); use pp_schedule gpipe, 1f1b, interleaved_1f1b or zero_bubble, or "
            "set train.eval_every=0")


class JobConfig(_Section):
    name: str = "job"
    run_id: str | None = Field(None, description="stable id for checkpoint resume; defaults to name")
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    workers: WorkersConfig = WorkersConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    faults: list[FaultConfig] = Field(default_factory=list)

    @property
    def stable_id(self) -> str:
        return self.run_id or self.name

    @field_validator("name", "run_id")
    @classmethod
    def _one_path_component(cls, value: str | None) -> str | None:
        # both name a directory under checkpoint.uri (resume reads it, retention deletes in it): "../other"
        # or "a/b" would point them at another run's checkpoints
        if value is not None and not _ID.fullmatch(value):
            raise ValueError("must be 1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit "
                             "(it names a directory under checkpoint.uri); e.g. 'my-run.2'")
        return value

    @model_validator(mode="after")
    def _layout_possible(self) -> JobConfig:
        from elastictrain.parallel.layout import is_valid, spec_from_config, valid_world_sizes

        if self.parallel.plan == "auto":  # the planner picks a layout valid at workers.min/max at start
            self._axes_rules()
            self._speed_rules()
            self._eval_rules()
            self._faults_exist()
            return self
        spec = spec_from_config(self)
        if spec.plan == "hsdp" and self.workers.use_gpu and self.parallel.shard_size is None:
            # shard_size defaults to the GPUs of a node, known only on the cluster: the driver checks it
            # once connected (preflight.check_plan_on_gpus); here only the data rule is checked.
            import dataclasses

            spec = dataclasses.replace(spec, plan="fsdp")  # keeps pp and tp (whole pipelines and TP groups)
        valid = valid_world_sizes(spec, self.workers.max)
        for w in (self.workers.min, self.workers.max):
            ok, why = is_valid(spec, w)
            if not ok:
                raise ValueError(
                    f"workers.min/max: world size {w} is not usable: {why}; valid world sizes up to "
                    f"workers.max={self.workers.max}: {valid or 'none'} (parallel.plan={self.parallel.plan}"
                    + (f", pp={self.parallel.pp}" if self.parallel.pp > 1 else "")
                    + "".join(f", {k}={getattr(self.parallel, k)}" for k in ("cp", "tp", "ep")
                              if getattr(self.parallel, k) > 1) + "); "
                    "change workers.min/max, the batch sizes or parallel.shard_size"
                )
        self._axes_rules()
        self._speed_rules()
        if self.task.kind != "python":
            self._builtin_model_splits()
        self._eval_rules()
        self._faults_exist()
        return self

    def _axes_rules(self) -> None:
        """``parallel.cp`` against the sequence length (head-tail chunks; a mixture-of-experts model runs under
        cp with every plan: its load-balance statistics are summed over cp, models/moe.py); ``parallel.ep``
        against the model's experts (the layout rules of ep: :func:`elastictrain.parallel.layout.ep_rule`)."""
        p = self.parallel
        if p.cp == 1 and p.ep == 1:
            return
        from elastictrain.parallel.layout import cp_rule

        if p.cp > 1 and self.task.kind != "python":  # a python task's sequence length is its dataset's
            why = cp_rule(p.cp, self.task.model.seq_len)
            if why:
                raise ValueError(why.replace("seq_len=", "task.model.seq_len=", 1))
        if p.ep > 1 and self.task.kind != "python":  # a python task's model is checked at attach
            moe = self.task.model.moe
            if moe is None:
                raise ValueError(f"parallel.ep={p.ep} shards the experts of a mixture-of-experts model, and "
                                 "task.model.moe is unset; set task.model.moe (e.g. {experts: 8, top_k: 2}) or "
                                 "parallel.ep=1")
            if moe.experts % p.ep:
                valid = [d for d in range(1, moe.experts + 1) if moe.experts % d == 0]
                raise ValueError(f"parallel.ep={p.ep} does not divide task.model.moe.experts={moe.experts}; "
                                 f"valid parallel.ep values for it: {valid}")

    def _builtin_model_splits(self, llama: dict[str, Any] | None = None, vocab: int | None = None) -> None:
        """The built-in model fills the pipeline stages and divides over the tensor-parallel ranks. ``llama``
        and ``vocab``: the Llama's shape where only the driver knows it (``task.init_from``: its config.json,
        read by ``models/hf_init.py``, which calls this again with it)."""
        p, m, t = self.parallel, self.task.model, self.task
        if t.kind == "llama" and llama is None:
            if t.init_from is not None:  # the shape is the source's: checked once it is read
                return
            llama = t.llama.shape()
        layers, layers_key = (llama["n_layers"], "task.llama.n_layers") if llama else (m.n_layer, "task.model.n_layer")
        if p.pp > 1:
            from elastictrain.parallel.layout import default_stages_per_rank

            stages = p.pp * (p.stages_per_rank or default_stages_per_rank(p.pp_schedule))
            if layers < stages:
                raise ValueError(
                    f"{layers_key}={layers} blocks cannot fill {stages} pipeline stages (parallel.pp="
                    f"{p.pp} x {stages // p.pp} per rank for {p.pp_schedule}); raise {layers_key.split('.')[-1]} to >= {stages} "
                    "or lower parallel.pp / stages_per_rank")
            if llama and llama.get("tie_embeddings") and p.pp_schedule == "zbv":  # parallel/tied.py
                raise ValueError("task.llama.tie_embeddings=true cannot run under parallel.pp_schedule=zbv: it puts "
                                 "the first and the last stage (the embedding and the tied head) on one rank; "
                                 "set parallel.pp_schedule to 1f1b or interleaved_1f1b, or tie_embeddings=false")
        if p.tp > 1:
            from elastictrain.parallel.layout import tp_rule

            vocab_key = "the vocabulary (task.model.vocab_size" + (")" if m.vocab_size else ": the data's)")
            if vocab is None and m.vocab_size is None and (vocab := _prepared_vocab(t.data)) is not None:
                vocab_key = f"the vocabulary of the prepared corpus's manifest (task.data.source={t.data.source!r})"
            if llama:
                sizes = {"task.llama.n_heads": llama["n_heads"], "task.llama.n_kv_heads": llama["n_kv_heads"],
                         "task.llama.ffn_hidden": llama["ffn_hidden"], vocab_key: vocab or t.vocab_size}
                fix = "change parallel.tp, the sizes in task.llama or task.model.vocab_size"
            else:
                sizes = {"task.model.n_head": m.n_head, "the MLP hidden size 4 x task.model.d_model": 4 * m.d_model,
                         vocab_key: vocab or t.vocab_size}
                fix = "change parallel.tp or task.model.n_head"
            if "manifest" in vocab_key and vocab % p.tp:  # a padded vocabulary still holds every id
                fix += f", or pad it: task.model.vocab_size={-(-vocab // p.tp) * p.tp} (a multiple of parallel.tp)"
            why = tp_rule(p.tp, sizes)
            if why:
                raise ValueError(f"{why}; {fix}")

    def _speed_rules(self) -> None:
        p = self.parallel
        if p.compile and self.task.kind == "tiny_gpt" and self.task.model.dropout > 0:
            # SampleDropout draws each row's mask from its own torch.Generator seeded on the host (a .tolist()
            # and a Python loop): a graph break that fullgraph=True refuses. The masks must stay a function of
            # (seed, step, sample id) whatever the layout, so they are not traded for in-graph random numbers.
            raise ValueError(f"parallel.compile=true with task.model.dropout={self.task.model.dropout}: the GPT's "
                             "per-sample dropout draws its masks on the host (a graph break under fullgraph "
                             "compile); set task.model.dropout=0 or parallel.compile=false")
        if p.float8 and not self.workers.use_gpu:
            raise ValueError("parallel.float8=true needs CUDA GPUs of compute capability >= 8.9 (H100, L40S, "
                             "RTX 4090 ...) and workers.use_gpu=false runs on CPU; set workers.use_gpu=true or "
                             "parallel.float8=false")

    def _eval_rules(self) -> None:
        if self.train.eval_every and self.parallel.pp > 1 and self.parallel.pp_schedule == "zbv":
            raise ValueError(zbv_eval_refusal(self.train.eval_every))

    def _faults_exist(self) -> None:
        for f in self.faults:
            if f.rank >= self.workers.max:
                raise ValueError(f"faults: rank {f.rank} does not exist with workers.max={self.workers.max}")


# ---------------------------------------------------------------------------------------------- loading


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, dotted + "."))
    return keys


def _format_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        known = _all_keys(JobConfig)
        hint = difflib.get_close_matches(loc, known, n=1, cutoff=0.6)
        if not hint:
            last = loc.rsplit(".", 1)[-1]
            hint = [k for k in known if k.rsplit(".", 1)[-1] == last][:1] or difflib.get_close_matches(
                last, [k.rsplit(".", 1)[-1] for k in known], n=1
            )
        tip = f"; did you mean '{hint[0]}'?" if hint else ""
        return f"unknown key '{loc}'{tip} (see docs/config.md for every key)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("value_error", "assertion_error") and not err["loc"]:
        return msg
    return f"{loc}: {msg} (got {err.get('input')!r})"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value, e.g. --set train.steps=100")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML{_yaml_problem(e)}; quote it or fix "
                          "it, e.g. --set train.steps=100") from None
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(parts)}: '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def _prepared_vocab(data: DataConfig) -> int | None:
    """The vocabulary in the manifest of a corpus prepared by ``elastictrain data prepare`` at
    ``task.data.source`` (one small read), None for any other source. An unreadable manifest is also None
    here: the run's start names it (``task.data_vocab_size``)."""
    from elastictrain.data.shards import PreparedDataError, is_prepared, read_manifest

    options = dict(data.storage_options)
    if not is_prepared(data.source, options):
        return None
    try:
        return read_manifest(data.source, options).vocab_size
    except PreparedDataError:
        return None


def build_config(data: dict[str, Any], overrides: list[str] = (), source: str = "<config>") -> JobConfig:
    """Validate a mapping (plus overrides) into a :class:`JobConfig`; raise :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    data = dict(data)
    for text in overrides:
        _apply_override(data, *parse_override(text))
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> JobConfig:
    """Read YAML at ``path``, apply ``--set`` overrides, validate. Raises :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (pass a YAML job file, e.g. jobs/tiny_gpt.yaml)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML{_yaml_problem(e)}") from None
    if data is None:  # nothing but blanks or comments: a wrong file, not "train the default job"
        raise ConfigError(f"{p}: the job file is empty; write the job's sections into it (e.g. copy "
                          "jobs/tiny_gpt.yaml), or write '{}' to run every default")
    return build_config(data, overrides, source=str(p))


def _yaml_problem(e: yaml.YAMLError) -> str:
    """`` at line L, column C: problem`` on one line (PyYAML's own text spans several)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"
