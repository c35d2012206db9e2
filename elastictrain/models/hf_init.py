"""``task.init_from`` on the driver: the built-in Llama's shape from a Hugging Face ``config.json``, checked
against the job's explicit dimensions and against the safetensors headers before any worker starts; and the
``Task.init_weights`` that loads each rank's part on the workers (:func:`elastictrain.models.hf_weights.
load_hf_weights`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from elastictrain.config import ConfigError
from elastictrain.models.hf_llama import check_tensors, llama_kwargs_from_hf

# task.llama keys an explicit value of which must agree with config.json (the size preset is not used)
EXPLICIT_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "rope_theta", "tie_embeddings")


def llama_shape_from_source(task: Any, source: Any = None) -> dict[str, Any]:
    """``LlamaConfig`` keywords for ``task`` (a TaskConfig with ``init_from``): the shape of the model in
    its ``config.json``, positions ``task.model.seq_len``. Raises ConfigError naming both values when an
    explicit ``task.llama`` dimension or ``task.model.vocab_size`` disagrees with config.json, and naming
    the tensor when the safetensors headers miss one or hold another shape. Reads config.json and the
    headers only (``source``: an already read :class:`~elastictrain.models.hf_weights.HFSource`)."""
    from elastictrain.models.hf_weights import read_source
    from elastictrain.models.llama import LlamaConfig

    uri = task.init_from
    src = source or read_source(uri, dict(task.init_from_storage_options))
    shape = llama_kwargs_from_hf(src.config, where=f"task.init_from={uri}: config.json")
    for key in EXPLICIT_KEYS:
        mine = getattr(task.llama, key, None)
        if mine is not None and mine != shape[key]:
            raise ConfigError(f"task.llama.{key}={mine} disagrees with the config.json of task.init_from={uri} "
                              f"({key}={shape[key]}); remove task.llama.{key} (the shape comes from config.json)")
    vocab = task.model.vocab_size
    if vocab is not None and vocab != shape["vocab_size"]:
        raise ConfigError(f"task.model.vocab_size={vocab} disagrees with the config.json of task.init_from={uri} "
                          f"(vocab_size={shape['vocab_size']}); remove task.model.vocab_size")
    if shape["vocab_size"] < task.data_vocab:
        raise ConfigError(f"task.init_from={uri}: vocab_size={shape['vocab_size']} is smaller than the data's "
                          f"vocabulary ({task.data_vocab} for task.data.source={task.data.source!r})")
    if task.model.seq_len > shape["max_seq_len"]:
        raise ConfigError(f"task.model.seq_len={task.model.seq_len} exceeds max_position_embeddings="
                          f"{shape['max_seq_len']} of task.init_from={uri}; lower task.model.seq_len")
    shape["max_seq_len"] = task.model.seq_len  # the rotary tables cover what is trained (values do not depend on it)
    try:
        cfg = LlamaConfig(**shape)
    except ValueError as e:
        raise ConfigError(f"task.init_from={uri}: config.json describes no built-in Llama: {e}") from None
    check_tensors(src.shapes(), cfg, uri)
    return shape


@dataclass(frozen=True)
class HFInit:
    """``Task.init_weights`` for ``task.init_from``: each rank loads the slices it holds."""

    uri: str
    tied: bool
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False)

    def __call__(self, model: Any) -> None:
        from elastictrain.models.hf_weights import load_hf_weights

        load_hf_weights(model, self.uri, self.storage_options, self.tied)


def from_source(task: Any, config: Any) -> Any:
    """The built-in Llama ``task`` (a Task) of ``config`` with ``task.init_from``: its model the shape of the
    source's config.json, its ``init_weights`` the source's weights. Raises ConfigError (see
    :func:`llama_shape_from_source`), also when that shape does not fit the job's pipeline or tensor-parallel
    split."""
    shape = llama_shape_from_source(config.task)
    try:
        config._builtin_model_splits(shape, shape["vocab_size"])
    except ValueError as e:
        raise ConfigError(f"task.init_from={config.task.init_from} (the shape of its config.json): {e}") from None
    model_fn = type(task.model_fn)(tuple(sorted(shape.items())))
    init = HFInit(config.task.init_from, bool(shape["tie_embeddings"]), dict(config.task.init_from_storage_options))
    return dataclasses.replace(task, model_fn=model_fn, init_weights=init)
