"""What a user brings: a model factory, a per-sample loss, an optimizer factory and a dataset.

A :class:`Task` is shipped to every worker (Ray pickles it), so its callables must be importable or
picklable. The framework owns the step loop; the task only says what one forward pass means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.config import JobConfig

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Task:
    """A training task.

    - ``model_fn()`` builds the module (called once per worker, after the seed is set, so every worker
      builds identical initial parameters).
    - ``loss_fn(model, batch, sample_seeds)`` returns the loss of EACH sample, shape ``[B]``. ``sample_seeds``
      (``LongTensor[B]``) is derived from (seed, step, sample id): use it for any randomness (dropout) so a
      sample's math does not depend on which worker processes it.
    - ``optimizer_fn(params)`` builds the optimizer.
    - ``dataset_fn()`` returns a map-style dataset (``len`` and ``__getitem__(int) -> dict of tensors``);
      every worker must build the same dataset. ``collate_fn(samples)`` (optional; default: stack each key)
      makes a micro-batch of them. A dataset with ``prefetch(batches)`` (a prepared corpus; ``batches``: the
      scheduled micro-batches' id tuples, to start reading) has the next step's
      micro-batches read and collated in a background thread while a step computes
      (:mod:`elastictrain.data.prefetch`): its ``__getitem__`` and ``collate_fn`` must then be thread-safe
      pure functions of their inputs (no global RNG).
    - ``lr_fn(step)`` returns the learning-rate multiplier for a 0-based step (a pure function of step, so the
      schedule continues exactly after a resize or a resume). Default: constant 1.
    - ``parallelize_fn(model, mesh, parallel)`` applies the layout for one membership generation and returns the
      module to train: ``mesh`` is the generation's DeviceMesh (axes ``dp_replicate`` and/or ``dp_shard``,
      and ``tp`` innermost under ``parallel.tp > 1``; under ``parallel.pp > 1`` it is called once per stage
      module with the stage's submesh: every axis but ``pp``),
      ``parallel`` the ``ParallelConfig`` (the job's ``parallel`` section). Called on a freshly built model
      whenever the layout is sharded (FSDP2 changes modules in place); the optimizer is built afterwards from the returned parameters. Default
      (None): :func:`elastictrain.parallel.parallelize.parallelize` -- float8, activation checkpointing and
      compile of each repeated block as asked (:mod:`elastictrain.parallel.speed`), then DDP, or ``fully_shard`` on each repeated block (the children of a ``ModuleList`` of one class)
      and then the root; under ``tp > 1`` first the model's ``tp_plan(sequence_parallel)`` (a
      ``parallelize_module`` plan) on the ``tp`` axis. Return a DDP module, an FSDP2 module, or a plain one;
      the step loop adapts. A tensor-parallel ``parallelize_fn`` applies its plan and then
      :func:`elastictrain.parallel.parallelize.parallelize_dp` (``examples/tp_llama.py``); its head's logits
      may stay vocabulary-sharded: the step runs under ``loss_parallel``. Pass ``src_data_rank=None`` to
      ``parallelize_module`` (each rank splits its own seeded copy): torch's default scatter from rank 0 hangs
      a recovery in which a survivor rebuilds its model on meta tensors.
      Under ``parallel.pp > 1`` it is applied to each pipeline stage module, on the mesh of that stage's
      data-parallel ranks.
    - ``eval_dataset_fn()`` (optional) returns the held-out dataset that ``train.eval_every`` scores with
      ``loss_fn`` (no gradients, ``model.eval()``); the built-in task's is a prepared corpus's validation split.
    - ``pipeline`` (:class:`PipelineHooks`) says how the model splits into pipeline stages
      (``parallel.pp > 1``); without it a pp job is refused when its stages are built. The built-in GPT's
      (:data:`GPT_PIPELINE`) is the documented example.
    - ``init_weights(model)`` (optional) gives the step-0 values in place of the seeded build (e.g.
      ``task.init_from``'s pretrained weights): ``model`` is this rank's parallelized, materialized model
      (whole, DTensor shards, or a pipeline stage set holding a subset of the names); fill what it holds,
      reading only that, with no collective. Called at a fresh start (step 0), never at a resume or a
      recovery past step 0 (that state comes from a checkpoint or a peer).
    """

    model_fn: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Batch, torch.Tensor], torch.Tensor]
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    dataset_fn: Callable[[], Any]
    lr_fn: Callable[[int], float] | None = None
    collate_fn: Callable[[list[Batch]], Batch] | None = None
    grad_clip: float | None = None
    name: str = "task"
    parallelize_fn: Callable[[torch.nn.Module, Any, Any], torch.nn.Module] | None = None
    pipeline: PipelineHooks | None = None
    init_weights: Callable[[torch.nn.Module], None] | None = None
    eval_dataset_fn: Callable[[], Any] | None = None


@dataclass(frozen=True)
class PipelineHooks:
    """How a model runs as a pipeline (``parallel.pp > 1``; see elastictrain/parallel/pipeline.py).

    - ``stage_fn(model, stage, n_stages)`` returns the module of virtual stage ``stage`` of ``n_stages``.
      ``model`` is a private copy of the whole model (meta parameters: values are loaded later by name), so
      the stage may take its modules from it. The stage's parameters must keep the whole model's fully
      qualified names (keep the attribute names; hold a slice of a ``ModuleList`` as an ``nn.ModuleDict``
      keyed by the original indices): checkpoints and recovery snapshots are keyed by those names, so a
      state saved under one pp loads under any other layout. Every parameter of the model must be owned by
      exactly one stage; a tied tensor (an output head that is the token embedding) may have its uses on
      different stages: each stage holding a use keeps a copy, one tensor by name, with its gradient summed
      over those stages (elastictrain/parallel/tied.py; not when one rank holds two such stages, zbv).
    - The stage is called as ``stage(*x, seeds=seeds)``: ``x`` is ``inputs_fn(batch)`` on the first stage
      and the previous stage's output(s) elsewhere; ``seeds`` (int64 ``[B]``, the per-sample seeds
      ``loss_fn`` gets) reach every stage, so dropout masks depend on (seed, step, sample id, position) and
      never on where the stage boundaries are. A stage's output is a tensor or a tuple of tensors (what the
      next stage takes). The global RNG is reseeded once per step under pp (the schedule, not the loop,
      orders the micro-batches' forwards): a stage that draws from it (a plain ``nn.Dropout``) does not
      reproduce a non-pipelined run's numbers; draw from ``seeds`` instead.
    - ``inputs_fn(batch)``: the tuple of tensors the first stage takes from a collated micro-batch.
    - ``loss_fn(output, batch)``: the per-sample losses (shape ``[B]``) from the last stage's output and the
      micro-batch, as ``Task.loss_fn`` would return them for the whole model.
    - Context parallelism (``parallel.cp > 1``): the stages are also called with ``positions=`` (int64
      ``[b, t]``, one identical row of this rank's global positions per sample:
      :func:`elastictrain.parallel.context.stage_positions` turns it into ``[t]``) and need the model hook of
      :func:`elastictrain.parallel.context.context_parallel_refusal`; ``loss_fn`` is called as
      ``loss_fn(output, batch, cp_group=group)`` (``batch``: this rank's positions of each sample) and
      returns :func:`elastictrain.parallel.context.cp_sample_loss`'s whole-sample losses. A ``loss_fn``
      without the keyword is refused under cp (:func:`elastictrain.parallel.context.pipeline_cp_refusal`).
    """

    stage_fn: Callable[[torch.nn.Module, int, int], torch.nn.Module]
    inputs_fn: Callable[[Batch], tuple[torch.Tensor, ...]]
    loss_fn: Callable[[torch.Tensor, Batch], torch.Tensor]


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------- built-in task
# Module-level callables (not lambdas) so the task pickles by reference and builds the same on every worker.


@dataclass(frozen=True)
class _GPTModel:
    cfg: Any
    vocab_size: int | None = None  # resolved with the data by builtin_task; None = the config's, else bytes

    def __call__(self) -> torch.nn.Module:
        from elastictrain.models.gpt import GPT, GPTConfig

        m = self.cfg
        moe = m.moe.to_moe() if getattr(m, "moe", None) is not None else None
        return GPT(GPTConfig(vocab_size=self.vocab_size or m.vocab_size or 256, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                             d_model=m.d_model, dropout=m.dropout, moe=moe))


@dataclass(frozen=True)
class _LlamaModel:
    """The built-in Llama of ``task.llama`` (its size and overrides), ``task.model.seq_len`` positions and the
    task's vocabulary. The step-0 values come from ``Llama.init_module`` by (seed, module name) on any
    layout, meta builds included (elastictrain/parallel/init.py), unless ``task.init_from`` supplies them."""

    shape: tuple[tuple[str, Any], ...]  # LlamaConfig keywords (a tuple: frozen and hashable)

    @classmethod
    def of(cls, task: Any, vocab: int | None = None) -> _LlamaModel:
        """``vocab``: the vocabulary resolved with the data (a prepared corpus's manifest); None = the config's."""
        shape = task.llama.shape()
        shape.update(vocab_size=vocab if vocab is not None else task.vocab_size, max_seq_len=task.model.seq_len)
        if task.model.moe is not None:
            shape["moe"] = task.model.moe.to_moe()
        return cls(tuple(sorted(shape.items())))

    @property
    def config(self) -> Any:
        from elastictrain.models.llama import LlamaConfig

        return LlamaConfig(**dict(self.shape))

    def __call__(self) -> torch.nn.Module:
        from elastictrain.models.llama import Llama

        return Llama(self.config)


def _gpt_loss(model: torch.nn.Module, batch: Batch, sample_seeds: torch.Tensor, *,
              compiled: bool = False) -> torch.Tensor:
    """Each sample's mean next-token cross-entropy, plus in training mode (not in evaluation) the sum over the
    model's mixture-of-experts layers of that sample's load-balancing loss (a function of the sample alone,
    elastictrain/models/moe.py), so the per-sample loss contract holds with MoE. Under context parallelism
    (``batch["positions"]``: this rank's part of each sample) the whole sample's loss summed over the cp
    ranks (:func:`elastictrain.parallel.context.cp_sample_loss`; the MoE layers sum their load-balance
    statistics over the cp group themselves, so their aux term is the sample's there too). ``compiled``: the
    cross-entropy of plain logits through :func:`elastictrain.parallel.speed.compiled_per_sample_loss`
    (``parallel.compile``; tensor-parallel logits, DTensors under ``loss_parallel``, stay eager)."""
    from torch.distributed.tensor import DTensor

    from elastictrain.models.moe import moe_aux_loss
    from elastictrain.parallel.context import cp_group_of, cp_sample_loss

    logits = model(batch["input"], sample_seeds=sample_seeds, positions=batch.get("positions"))
    group = cp_group_of(model) if "positions" in batch else None
    loss = _cross_entropy(logits, compiled)(logits, batch["target"]) if group is None else cp_sample_loss(
        logits, batch["target"], group)
    aux = moe_aux_loss(model) if model.training else None
    if aux is not None and isinstance(loss, DTensor):  # tensor parallel: the aux loss is replicated over tp
        loss = loss.to_local()
    return loss if aux is None else loss + aux.to(loss.dtype)


def _gpt_loss_compiled(model: torch.nn.Module, batch: Batch, sample_seeds: torch.Tensor) -> torch.Tensor:
    """:func:`_gpt_loss` with its cross-entropy compiled: the built-in task's ``loss_fn`` under ``parallel.compile``."""
    return _gpt_loss(model, batch, sample_seeds, compiled=True)


def _cross_entropy(logits: torch.Tensor, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from elastictrain.models.gpt import per_sample_loss

    if not compiled or isinstance(logits, DTensor):
        return per_sample_loss
    from elastictrain.parallel.speed import compiled_per_sample_loss

    return compiled_per_sample_loss()


@dataclass(frozen=True)
class GPTStages:
    """The built-in GPT's ``PipelineHooks.stage_fn``: embeddings on the first stage, ``ln_f`` and the head on
    the last, the blocks balanced (``splits``: the first block of stages 1.., for a manual split)."""

    splits: tuple[int, ...] | None = None

    def __call__(self, model: torch.nn.Module, stage: int, n_stages: int) -> torch.nn.Module:
        from elastictrain.models.gpt import GPTStage
        from elastictrain.parallel.stages import block_ranges

        blocks = block_ranges(len(model.blocks), n_stages, self.splits)[stage]
        return GPTStage(model, blocks, first=stage == 0, last=stage == n_stages - 1)


def _gpt_inputs(batch: Batch) -> tuple[torch.Tensor, ...]:
    return (batch["input"],)


def _gpt_stage_loss(logits: torch.Tensor, batch: Batch, *, cp_group: Any = None,
                    compiled: bool = False) -> torch.Tensor:
    """The last stage's per-sample losses; under context parallelism (``cp_group`` set: ``logits`` and the
    targets are this rank's positions) the whole sample's, summed over the cp ranks. ``compiled``: as
    :func:`_gpt_loss`'s."""
    if cp_group is None:
        return _cross_entropy(logits, compiled)(logits, batch["target"])
    from elastictrain.parallel.context import cp_sample_loss

    return cp_sample_loss(logits, batch["target"], cp_group)


GPT_PIPELINE = PipelineHooks(stage_fn=GPTStages(), inputs_fn=_gpt_inputs, loss_fn=_gpt_stage_loss)
"""The built-in GPT as a pipeline: the example of :class:`PipelineHooks`."""


@dataclass(frozen=True)
class LlamaStages:
    """The built-in Llama's ``PipelineHooks.stage_fn``: the embedding on the first stage, the final norm and
    the head on the last, the layers balanced (``splits``: the first layer of stages 1.., a manual split)."""

    splits: tuple[int, ...] | None = None

    def __call__(self, model: torch.nn.Module, stage: int, n_stages: int) -> torch.nn.Module:
        from elastictrain.models.llama import LlamaStage
        from elastictrain.parallel.stages import block_ranges

        layers = block_ranges(len(model.layers), n_stages, self.splits)[stage]
        return LlamaStage(model, layers, first=stage == 0, last=stage == n_stages - 1)


LLAMA_PIPELINE = PipelineHooks(stage_fn=LlamaStages(), inputs_fn=_gpt_inputs, loss_fn=_gpt_stage_loss)
"""The built-in Llama as a pipeline (the same inputs and per-sample loss as the GPT's)."""


@dataclass(frozen=True)
class _AdamW:
    cfg: Any

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW over ``params``: the per-tensor loop on CPU (bitwise the same at any world size and
        layout), the fused kernel on CUDA (one launch per step instead of several per parameter)."""
        o = self.cfg
        params = list(params)
        on_cuda = bool(params) and all(p.is_cuda for p in params)
        kind = {"fused": True} if on_cuda else {"foreach": False}
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay, **kind)


@dataclass(frozen=True)
class _Corpus:
    source: str
    column: str
    storage_options: dict
    seq_len: int
    prepared: bool = False  # a corpus of `elastictrain data prepare`: windows read by range
    split: str = "train"

    def __call__(self) -> Any:
        from elastictrain.data.datasets import TokenWindows, load_text_tokens

        if self.prepared:
            from elastictrain.data.windows import PreparedWindows

            return PreparedWindows(self.source, self.seq_len, self.split, self.storage_options)
        tokens = load_text_tokens(self.source, column=self.column, storage_options=self.storage_options)
        return TokenWindows(tokens, self.seq_len)


@dataclass(frozen=True)
class _Schedule:
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.warmup, self.total)


def data_vocab_size(config: JobConfig) -> tuple[int, bool]:
    """``(the vocabulary of task.data, whether it is a prepared corpus)``: the prepared manifest's
    ``vocab_size`` (one small read), else 256 (byte tokens). Raises ConfigError for an unreadable manifest."""
    from elastictrain.config import ConfigError
    from elastictrain.data.shards import PreparedDataError, is_prepared, read_manifest

    d = config.task.data
    if not is_prepared(d.source, dict(d.storage_options)):
        return 256, False
    try:
        return read_manifest(d.source, dict(d.storage_options)).vocab_size, True
    except PreparedDataError as e:
        raise ConfigError(f"task.data.source={d.source!r}: {e}") from None


def model_vocab_size(config: JobConfig) -> tuple[int, bool]:
    """The built-in model's vocabulary: ``task.model.vocab_size``, or the data's when None. Raises ConfigError
    when it is set smaller than the data's (ids past the embedding would crash the first step)."""
    from elastictrain.config import ConfigError

    data_vocab, prepared = data_vocab_size(config)
    asked = getattr(config.task.model, "vocab_size", None)
    if asked is None:
        return data_vocab, prepared
    if asked < data_vocab:
        raise ConfigError(f"task.model.vocab_size={asked} is smaller than the data's vocabulary {data_vocab} "
                          f"(task.data.source={config.task.data.source!r}); set task.model.vocab_size >= "
                          f"{data_vocab} or leave it unset (null: the data's)")
    return asked, prepared


def builtin_task(config: JobConfig) -> Task:
    """The task named by ``config.task``: ``tiny_gpt`` (a small GPT) or ``llama`` (Llama 3 of ``task.llama``, or
    of ``task.init_from``'s config.json and weights: ConfigError here, on the driver, for a source that does not
    fit), on the corpus of ``task.data`` (byte tokens, or a prepared corpus's tokens: the model's vocabulary is
    then the manifest's unless task.model.vocab_size sets it; ConfigError when it is smaller) with AdamW and a
    warm-up + cosine schedule."""
    t = config.task
    llama = t.kind == "llama"
    _check_moe_layout(config)
    vocab, prepared = model_vocab_size(config)
    evaluate = None
    if config.train.eval_every:
        evaluate = _Corpus(t.data.source, t.data.column, dict(t.data.storage_options), t.model.seq_len, prepared,
                           split="validation")
        _check_validation_split(config, prepared)
    task = Task(
        model_fn=_LlamaModel.of(t, vocab) if llama else _GPTModel(t.model, vocab),
        loss_fn=_gpt_loss_compiled if config.parallel.compile else _gpt_loss,
        optimizer_fn=_AdamW(t.optimizer),
        dataset_fn=_Corpus(t.data.source, t.data.column, dict(t.data.storage_options), t.model.seq_len, prepared),
        lr_fn=_Schedule(t.optimizer.warmup_steps, config.train.steps),
        grad_clip=t.optimizer.grad_clip,
        name=t.kind,
        pipeline=_pipeline_hooks(LLAMA_PIPELINE if llama else GPT_PIPELINE, config.parallel.compile),
        eval_dataset_fn=evaluate,
    )
    if llama and t.init_from is not None:  # shape and step-0 weights of a Hugging Face model (read here, once)
        from elastictrain.models.hf_init import from_source

        task = from_source(task, config)
    return task


def _gpt_stage_loss_compiled(logits: torch.Tensor, batch: Batch, *, cp_group: Any = None) -> torch.Tensor:
    """:func:`_gpt_stage_loss` with its cross-entropy compiled (``parallel.compile``)."""
    return _gpt_stage_loss(logits, batch, cp_group=cp_group, compiled=True)


def _pipeline_hooks(hooks: PipelineHooks, compiled: bool) -> PipelineHooks:
    import dataclasses

    return dataclasses.replace(hooks, loss_fn=_gpt_stage_loss_compiled) if compiled else hooks


def _check_moe_layout(config: JobConfig) -> None:
    """``task.model.moe`` runs with data, expert and pipeline parallelism (each stage's load-balancing losses
    join its backward and the step's loss: parallel/expert_pipeline.py), and with tensor parallelism when the
    expert group borrows the tp ranks (ep x tp: ``parallel.ep`` a multiple of ``parallel.tp``;
    elastictrain/parallel/expert_tp.py): under tp with ``ep = 1`` every tp rank would hold every expert and
    route the same tokens, so tp > 1 with ep = 1 is a ConfigError naming the fix; so are ``parallel.compile``
    and ``task.init_from`` (dense Hugging Face weights). (ep with pp, cp and tp at once, 5D included:
    parallel.layout.ep_rule.)"""
    from elastictrain.config import ConfigError

    p, t = config.parallel, config.task
    if t.model.moe is None:
        return
    if p.tp > 1 and p.ep == 1:
        raise ConfigError(f"task.model.moe is set with parallel.tp={p.tp} and parallel.ep=1: the experts are not "
                          f"split over tp; set parallel.ep to a multiple of parallel.tp={p.tp} (the expert group "
                          "borrows the tp ranks), or parallel.tp=1, or remove task.model.moe")
    if p.compile:  # the routing reads split sizes on the host (.tolist()): no fullgraph block
        raise ConfigError("task.model.moe is set with parallel.compile=true: the MoE routing reads its split sizes "
                          "on the host, which a fullgraph compile of the block refuses; set parallel.compile=false "
                          "or remove task.model.moe")
    if t.init_from is not None:
        raise ConfigError(f"task.model.moe is set with task.init_from={t.init_from!r}: Hugging Face Llama weights "
                          "have dense feed-forwards; remove task.model.moe or task.init_from")


def _check_validation_split(config: JobConfig, prepared: bool) -> None:
    """``train.eval_every`` needs a validation split of at least one window: a ConfigError otherwise."""
    from elastictrain.config import ConfigError
    from elastictrain.data.shards import read_manifest

    d = config.task.data
    have = read_manifest(d.source, dict(d.storage_options)).tokens("validation") if prepared else 0
    if have < config.task.model.seq_len + 1:
        raise ConfigError(
            f"train.eval_every={config.train.eval_every} needs a validation split of at least one window "
            f"({config.task.model.seq_len + 1} tokens) but task.data.source={d.source!r} has "
            + (f"{have} validation tokens" if prepared else "none (not a prepared corpus)")
            + "; prepare it with --val-fraction or --val-source, or set train.eval_every=0")
