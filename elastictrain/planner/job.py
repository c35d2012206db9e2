"""A job config in, the planner's inputs and a ``parallel`` section out: the edge between the typed job
config and the pure cost model.

* the model: the built-in GPT's shape from ``task.model``, the built-in Llama's from ``task.llama`` (layers,
  width, heads and kv heads, SwiGLU's width, tied or not; the task's vocabulary and ``task.model.seq_len``):
  their exact parameter counts; a ``kind: python`` task brings its own model, so its shape comes from
  ``--shape`` (:func:`parse_shape`);
* the step: ``train.global_batch`` / ``train.micro_batch`` (the planner keeps the job's micro-batch size:
  the math of a step does not depend on it, its float sums do), AdamW, fp32 or bf16 compute as
  ``parallel.mixed_precision`` says (fp32 state either way: FSDP2's policy on sharded layouts, autocast on
  the others; planner/memory.py prices what each holds);
* the search: every runnable layout (:func:`.search.runnable_axes`), with and without activation
  checkpointing; FSDP's ``reshard_after_forward`` as the job sets it. With ``parallel.meta_init`` only
  layouts where no rank holds the whole model are chosen (:func:`holds_no_whole_model`; the config refuses
  plain ddp there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.planner.inputs import Candidate, Cluster, ModelShape, PlannerInputError, Training
from elastictrain.planner.search import Estimate, evaluate, rank_layouts

_SHAPE_KEYS = {"layers": int, "hidden": int, "heads": int, "seq_len": int, "vocab": int, "ffn_mult": float,
               "params": float}


def parse_shape(text: str) -> ModelShape:
    """``"layers=80,hidden=8192,heads=64,seq_len=4096,vocab=128256"`` (``params=`` and ``ffn_mult=`` too;
    ``params=70e9`` alone prices weights and optimizer state only). Raises :class:`PlannerInputError`."""
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, raw = part.partition("=")
        if key not in _SHAPE_KEYS or not raw:
            raise PlannerInputError(f"--shape {text!r}: {part!r} is not key=value with key one of "
                                    f"{', '.join(_SHAPE_KEYS)}")
        try:
            values[key] = _SHAPE_KEYS[key](float(raw))
        except ValueError:
            raise PlannerInputError(f"--shape {text!r}: {key}={raw!r} is not a number") from None
    if "params" in values and not {"layers", "hidden"} <= values.keys():
        rest = {k: int(v) for k, v in values.items() if k in ("layers", "hidden", "heads", "seq_len", "vocab")}
        return ModelShape.from_params(values["params"], **rest)
    missing = [k for k in ("layers", "hidden", "heads", "seq_len", "vocab") if k not in values]
    if missing:
        raise PlannerInputError(f"--shape {text!r}: missing {', '.join(missing)} (or give params=N alone)")
    if "params" in values:
        values["params"] = int(values["params"])
    return ModelShape(**values)


def model_shape(config: Any, shape: str | None = None) -> ModelShape:
    """The model of the job (``shape``, else ``parallel.model_shape``, overrides). A python task without
    either is an input error."""
    shape = shape or config.parallel.model_shape
    if shape:
        return parse_shape(shape)
    t = config.task
    if t.kind == "python":
        raise PlannerInputError("task.kind=python brings its own model: give its shape with --shape or "
                                "parallel.model_shape, e.g. layers=12,hidden=768,heads=12,seq_len=1024,vocab=50257")
    m = t.model
    if t.kind == "llama":
        if t.init_from is not None:  # the shape of the source's config.json (read from it, with its checks)
            from elastictrain.models.hf_init import llama_shape_from_source

            s = llama_shape_from_source(t)
        else:
            s = {**t.llama.shape(), "vocab_size": t.vocab_size}
        return ModelShape(layers=s["n_layers"], hidden=s["dim"], heads=s["n_heads"], seq_len=m.seq_len,
                          vocab=s["vocab_size"], tied_embeddings=bool(s.get("tie_embeddings")), arch="llama",
                          kv_heads=s["n_kv_heads"], ffn_hidden=s["ffn_hidden"], **_moe(m))
    return ModelShape(layers=m.n_layer, hidden=m.d_model, heads=m.n_head, seq_len=m.seq_len, vocab=t.vocab_size,
                      **_moe(m))


def _moe(m: Any) -> dict[str, int]:
    """The ``task.model.moe`` fields of :class:`ModelShape` (none for a dense model)."""
    moe = getattr(m, "moe", None)
    return {} if moe is None else {"experts": moe.experts, "top_k": moe.top_k, "moe_every": moe.every}


def training(config: Any) -> Training:
    bf16 = config.parallel.mixed_precision == "bf16"
    return Training(config.train.global_batch, config.train.micro_batch,
                    precision="bf16" if bf16 else "fp32", optimizer="adam", activation_bytes=2 if bf16 else 4)


def _sharded_only(config: Any) -> bool:
    return config.parallel.meta_init


def holds_no_whole_model(c: Candidate) -> bool:
    """Whether a ``parallel.meta_init`` job may run ``c``: no data rank holds the whole model (FSDP shards
    it, ep > 1 splits the experts) or there is one data rank (pp / tp split the model)."""
    return c.dp_shard > 1 or c.dp == 1 or c.dims.ep > 1


def job_plan(config: Any, cluster: Cluster, world: int, shape: str | None = None, *,
             runnable_only: bool = True) -> list[Estimate]:
    """Every candidate for the job at ``world`` devices, ranked best first (see the module docstring)."""
    model, train = model_shape(config, shape), training(config)
    ranked = rank_layouts(model, train, cluster, world, runnable_only=runnable_only,
                  reshard_after_forward=config.parallel.reshard_after_forward)
    if _sharded_only(config):
        ranked = [e for e in ranked if holds_no_whole_model(e.candidate)]
    return ranked


def candidate_of(layout: Any, config: Any) -> Candidate:
    """The planner's view of a resolved :class:`~elastictrain.parallel.layout.Layout` (its ``MeshDims`` as
    they are), with the job's settings a layout does not carry (the one Layout -> Candidate converter)."""
    d, p = layout.dims, config.parallel
    return Candidate(d, schedule=layout.pp_schedule if d.pp > 1 else "1f1b",
                     stages_per_rank=layout.stages_per_rank if d.pp > 1 else 1,
                     micro_batch=config.train.micro_batch, activation_checkpointing=p.activation_checkpointing,
                     sequence_parallel=p.sequence_parallel is not False,
                     reshard_after_forward=p.reshard_after_forward)


def configured(config: Any, cluster: Cluster, world: int, shape: str | None = None) -> Estimate | None:
    """The job's own layout at ``world`` priced, or None when it cannot run there (or ``plan: auto``)."""
    from elastictrain.parallel.layout import LayoutError, resolve, spec_from_config

    p = config.parallel
    if p.plan not in ("ddp", "fsdp", "hsdp"):
        return None
    gpus = cluster.devices_per_node if config.workers.use_gpu else None
    try:
        layout = resolve(spec_from_config(config, gpus), world)
    except LayoutError:
        return None
    c = candidate_of(layout, config)
    return evaluate(model_shape(config, shape), training(config), cluster, c)


@dataclass(frozen=True)
class Choice:
    """What ``parallel.plan: auto`` runs: the ``parallel`` settings, the estimate behind them, and why."""

    parallel: dict[str, Any]
    estimate: Estimate
    world: int
    reason: str
    cluster: Cluster | None = None  # what it was priced on: a live re-plan prices on the same (planner/live.py)

    def as_event(self) -> dict[str, Any]:
        e = self.estimate.as_dict()
        return {"layout": self.parallel, "world_size": self.world, "predicted_memory_bytes": e["memory_per_gpu_bytes"],
                "predicted_step_s": e["step_time_s"], "reason": self.reason}


def parallel_settings(e: Estimate, sharded_only: bool = False) -> dict[str, Any]:
    """The ``parallel`` keys that run candidate ``e`` (``plan``, ``shard_size``, ``pp``...)."""
    c = e.candidate
    name = c.layout_name if c.dp > 1 else ("fsdp" if sharded_only else "ddp")
    out: dict[str, Any] = {"plan": name, "shard_size": c.dp_shard if name == "hsdp" else None, "pp": c.pp,
                           "activation_checkpointing": c.activation_checkpointing}
    if c.pp > 1:
        out.update(pp_schedule=c.schedule, stages_per_rank=c.stages_per_rank)
    out["tp"] = c.tp  # always: a job's own tp (and sequence_parallel) must not survive a choice of tp 1
    out["ep"] = c.ep  # (a mixture-of-experts model: the planner prices ep; a dense one's candidates are ep 1)
    out["cp"] = c.cp
    if c.tp == 1:
        out["sequence_parallel"] = None
    return out


def concrete_config(config: Any, settings: dict[str, Any]) -> Any:
    """``config`` with ``parallel`` replaced by ``settings``, validated again as a whole (every rule of a
    fixed layout applies: usable at workers.min and workers.max, blocks for the stages...). Raises
    ``ConfigError``."""
    from elastictrain.config import build_config

    data = config.model_dump(mode="json")
    data["parallel"].update(settings)
    return build_config(data, source="parallel.plan=auto")


def choose(config: Any, cluster: Cluster, worlds: list[int], shape: str | None = None) -> tuple[Any, Choice]:
    """The job with the best fitting layout that runs, at the largest world size in ``worlds`` that has one,
    and the :class:`Choice` behind it. A layout the job's own rules refuse (e.g. not usable at
    ``workers.min``) is skipped for the next. Raises :class:`PlannerInputError` naming the closest miss (or
    the first rule broken) when none is left."""
    from elastictrain.config import ConfigError
    from elastictrain.planner.explain import refusal

    closest: Estimate | None = None
    refused: str | None = None
    for world in sorted(worlds, reverse=True):
        ranked = job_plan(config, cluster, world, shape)
        for best in ranked:
            if not best.fits:
                if closest is None or best.memory.shortfall < closest.memory.shortfall:
                    closest = best
                break
            settings = parallel_settings(best, _sharded_only(config))
            try:
                concrete = concrete_config(config, settings)
            except ConfigError as e:
                refused = refused or f"{best.candidate.describe()}: {e}"
                continue
            why = (f"best of {len(ranked)} layouts at world size {world} that fits and runs: "
                   f"{best.candidate.describe()}, predicted {best.time.total_s:.3g} s per step at "
                   f"{best.memory.total / 2**30:.2f} GiB per device (cluster: {cluster.source})")
            return concrete, Choice(settings, best, world, why, cluster)
    if closest is not None:
        raise PlannerInputError("parallel.plan=auto: no layout fits; closest: " + refusal(closest, cluster))
    raise PlannerInputError(f"parallel.plan=auto: no runnable layout is valid at world sizes {worlds}"
                            + (f" (first refused: {refused})" if refused else "")
                            + "; change train.global_batch/micro_batch or workers.min/max")


def plan_for_run(config: Any, builtin_task: bool = True) -> tuple[Any, Choice]:
    """``parallel.plan: auto`` at the start of a run: the cluster Ray offers (this process is connected),
    with ``parallel.calibration``'s measured figures, planned at the largest world size up to
    ``workers.max`` that it can hold. ``builtin_task``: the job trains a built-in model (``task.kind``)
    (else the shape must be in ``parallel.model_shape``). Raises ``ConfigError`` (exit 2) when nothing fits
    or runs."""
    from elastictrain.config import ConfigError
    from elastictrain.planner import cluster as clusters

    w = config.workers
    if not builtin_task and not config.parallel.model_shape:
        raise ConfigError("parallel.plan=auto with your own model needs its shape: set parallel.model_shape, e.g. "
                          "layers=12,hidden=768,heads=12,seq_len=1024,vocab=50257 (or a fixed parallel.plan)")
    try:
        cl = clusters.from_ray(w.use_gpu, w.cpus_per_worker)
        if config.parallel.calibration:
            cl = clusters.with_calibration(cl, config.parallel.calibration)
        unknown = clusters.unknown_device_refusal(cl)
        if unknown:
            raise ConfigError(unknown)
        top = max(w.min, min(w.max, cl.devices))
        return choose(config, cl, list(range(w.min, top + 1)), config.parallel.model_shape)
    except (PlannerInputError, clusters.ClusterError) as e:
        raise ConfigError(str(e)) from None
