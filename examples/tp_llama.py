"""Tensor parallelism for a model elastictrain did not write: a small Hugging Face Llama (built from a config,
no weights downloaded) with a tensor-parallel plan applied in ``Task.parallelize_fn``. Used as::

    task:
      kind: python
      entry: "examples.tp_llama:make_task"
      args: {hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2}
    parallel: {tp: 2, sequence_parallel: false}

The plan is torchtitan's Llama shape on Hugging Face's module names (the same split as the ``colwise`` /
``rowwise`` entries of ``LlamaConfig.base_model_tp_plan``, written with torch's own styles): in every layer
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` column-wise, ``o_proj`` and ``down_proj``
row-wise; ``embed_tokens`` vocabulary-parallel; ``lm_head`` column-wise with its logits left sharded on the
vocabulary, so that the per-sample cross-entropy runs under ``loss_parallel`` and the full logits are never
gathered. Hugging Face's attention reshapes with ``-1`` heads, so each rank runs its ``heads / tp`` query
and ``kv_heads / tp`` key/value heads unchanged: both must divide by ``tp`` (checked here, a config error
at the CLI). The decoder layer adds its residuals on plain tensors, so this plan keeps activations whole
between layers: no sequence parallel (``parallel.sequence_parallel: false``; asking for it is refused).
After the plan, :func:`elastictrain.parallel.parallelize.parallelize_dp` lays out the data-parallel axes
(ddp: gradients averaged over the data-parallel group; fsdp/hsdp: FSDP2 + TP), as for the built-in GPT.
``transformers`` is an optional extra: ``pip install 'elastictrain[hf]'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from elastictrain import Task
from examples.hf_causal_lm import AdamW, ByteWindows, HFModel, Schedule, per_sample_loss


def llama_tp_plan(model: nn.Module) -> dict[str, Any]:
    """A ``parallelize_module`` plan for a ``LlamaForCausalLM``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for name in ("q_proj", "k_proj", "v_proj"):
        plan[f"model.layers.*.self_attn.{name}"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    for name in ("gate_proj", "up_proj"):
        plan[f"model.layers.*.mlp.{name}"] = ColwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return plan


@dataclass(frozen=True)
class ParallelizeLlama:
    """``Task.parallelize_fn``: the Llama plan on the mesh's ``tp`` axis, then the data-parallel layout."""

    def __call__(self, model: nn.Module, mesh: Any, parallel: Any) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        from elastictrain.parallel.parallelize import parallelize_dp
        from elastictrain.parallel.tensor import TensorParallelError, tp_submesh

        tp_mesh = tp_submesh(mesh)
        if tp_mesh is not None:
            if parallel.sequence_parallel:
                raise TensorParallelError("examples.tp_llama's plan has no sequence parallel: set "
                                          "parallel.sequence_parallel: false")
            # src_data_rank=None: each rank splits its own copy (every rank built the same seeded model);
            # torch's default scatters from rank 0, which hangs a recovery where a survivor rebuilds on meta.
            parallelize_module(model, tp_mesh, llama_tp_plan(model), src_data_rank=None)
        return parallelize_dp(model, mesh, parallel)


@dataclass(frozen=True)
class _Defaults:
    model: dict[str, Any] = field(default_factory=lambda: {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_implementation": "eager"})


def make_task(seq_len: int = 32, lr: float = 3e-3, warmup_steps: int = 10, total_steps: int = 100,
              source: str = "builtin:pydoc", grad_clip: float | None = 1.0, tp: int = 2, **model: Any) -> Task:
    """A small Llama as a tensor-parallel task; ``model`` keywords override its config. ``tp``: the degree
    the job runs at (its heads, key/value heads and MLP width must divide by it). Raises ImportError when
    ``transformers`` is not installed and ValueError for a size ``tp`` does not divide (both config errors
    at the CLI, exit 2)."""
    import transformers  # noqa: F401 - fail here, on the driver, not later inside every worker

    cfg = {**_Defaults().model, **model}
    sizes = {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(f"examples.tp_llama: tp={tp} does not divide {bad}; pick sizes that divide by tp")
    return Task(model_fn=HFModel("llama", cfg, seq_len), loss_fn=per_sample_loss, optimizer_fn=AdamW(lr),
                dataset_fn=ByteWindows(source, seq_len), lr_fn=Schedule(warmup_steps, total_steps),
                grad_clip=grad_clip, name="hf_llama_tp", parallelize_fn=ParallelizeLlama())
