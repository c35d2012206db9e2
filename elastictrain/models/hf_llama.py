"""Hugging Face Llama <-> the built-in Llama: the one table of tensor names, and config.json <-> LlamaConfig.

Pure functions (no torch, no I/O): the loader (``models/hf_weights.py``), the driver's header check and
``ckpt export --format hf`` all ask this module. Our names are ``elastictrain.models.llama``'s (torchtitan's);
Hugging Face's are ``transformers``' ``LlamaForCausalLM``'s. The rotary embedding uses Hugging Face's
half-split convention, so q/k projections map with no permutation.
"""

from __future__ import annotations

import re
from typing import Any

from elastictrain.config import ConfigError

# (Hugging Face name, our name); "{i}" is a layer index. The one place the two namings meet.
NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
)

# tensors some Hugging Face files carry that are not weights (recomputed by both models): skipped
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_OURS = [(_compile(hf), ours) for hf, ours in NAME_TABLE]
_TO_HF = [(_compile(ours), hf) for hf, ours in NAME_TABLE]


def _translate(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    return None


def ours_from_hf(name: str) -> str | None:
    """Our parameter name for a Hugging Face tensor name; None when the table has no row for it."""
    return _translate(name, _TO_OURS)


def hf_from_ours(name: str) -> str | None:
    """The Hugging Face tensor name of one of our parameter names; None when the table has no row for it."""
    return _translate(name, _TO_HF)


def is_ignored_hf(name: str) -> bool:
    """A tensor a Hugging Face file may hold that is no weight (old files' rotary ``inv_freq``)."""
    return bool(_IGNORED_HF.fullmatch(name))


# ------------------------------------------------------------------------------------------- config.json
def _rope_fields(hf: dict[str, Any], where: str) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, Llama 3.1 rope scaling or None) from transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported by task.kind=llama (default or llama3); "
                          "use a Llama 3 checkpoint or convert its rotary scaling")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in merged]
    if missing:
        raise ConfigError(f"{where}: rope_type llama3 lacks {missing}; the file is incomplete")
    return float(theta), {k: float(merged[k]) if k != "original_max_position_embeddings" else int(merged[k])
                          for k in keys}


def llama_kwargs_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``LlamaConfig`` keyword arguments from a Hugging Face Llama ``config.json`` (as a dict). Raises
    ConfigError naming the field for what the built-in Llama cannot represent (biases, another activation,
    a ``head_dim`` other than hidden_size / num_attention_heads, another rope type)."""
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"{where}: model_type={model_type!r}; task.init_from reads Llama checkpoints "
                          "(model_type llama)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true; the built-in Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}; the built-in Llama uses silu (SwiGLU)")
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        out = {
            "dim": dim, "n_layers": int(hf["num_hidden_layers"]), "n_heads": heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or heads), "vocab_size": int(hf["vocab_size"]),
            "ffn_hidden": int(hf["intermediate_size"]), "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise ConfigError(f"{where}: no {e.args[0]!r}; a Llama config.json names it") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise ConfigError(f"{where}: head_dim={head_dim} but hidden_size/num_attention_heads={dim // heads}; "
                          "the built-in Llama derives head_dim from them")
    out["rope_theta"], out["rope_scaling"] = _rope_fields(hf, where)
    return out


def hf_config_from(cfg: Any) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (dict, transformers 5 layout: ``rope_parameters``) for a LlamaConfig."""
    rope: dict[str, Any] = {"rope_theta": float(cfg.rope_theta), "rope_type": "default"}
    if cfg.rope_scaling:
        rope = {**dict(cfg.rope_scaling), "rope_theta": float(cfg.rope_theta), "rope_type": "llama3"}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.dim // cfg.n_heads,
        "intermediate_size": cfg.ffn_hidden, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": bool(cfg.tie_embeddings),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_parameters": rope,
        "torch_dtype": "float32",
    }


def expected_hf_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face file of this Llama must hold, by Hugging Face name, with its shape
    (``lm_head.weight`` only when the embeddings are untied)."""
    hd = cfg.dim // cfg.n_heads
    ours: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        ours.update({
            p + "attention_norm.weight": (cfg.dim,), p + "ffn_norm.weight": (cfg.dim,),
            p + "attention.wq.weight": (cfg.n_heads * hd, cfg.dim),
            p + "attention.wk.weight": (cfg.n_kv_heads * hd, cfg.dim),
            p + "attention.wv.weight": (cfg.n_kv_heads * hd, cfg.dim),
            p + "attention.wo.weight": (cfg.dim, cfg.n_heads * hd),
            p + "feed_forward.w1.weight": (cfg.ffn_hidden, cfg.dim),
            p + "feed_forward.w3.weight": (cfg.ffn_hidden, cfg.dim),
            p + "feed_forward.w2.weight": (cfg.dim, cfg.ffn_hidden),
        })
    if not cfg.tie_embeddings:
        ours["output.weight"] = (cfg.vocab_size, cfg.dim)
    return {hf_from_ours(k): v for k, v in ours.items()}  # type: ignore[misc]


def check_tensors(found: dict[str, tuple[int, ...]], cfg: Any, source: str) -> None:
    """Raise ConfigError naming the first tensor that is missing from ``found`` (Hugging Face name ->
    shape, as the safetensors headers say), has another shape than the model built from ``cfg`` expects,
    or that the name table does not know. ``lm_head.weight`` in a tied model's file is allowed (unused)."""
    expected = expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in found:
            raise ConfigError(f"task.init_from={source}: tensor {name} (our {ours_from_hf(name)}) is missing "
                              "from the safetensors files; point task.init_from at the whole checkpoint")
        if tuple(found[name]) != tuple(shape):
            raise ConfigError(f"task.init_from={source}: tensor {name} has shape {list(found[name])} but the "
                              f"model built from its config.json expects {list(shape)}; the weights and "
                              "config.json disagree")
    unknown = [n for n in found if n not in expected and not is_ignored_hf(n) and n != "lm_head.weight"]
    if unknown:
        raise ConfigError(f"task.init_from={source}: tensor {unknown[0]} is not a weight of this Llama "
                          f"({len(unknown)} such); is it a Llama checkpoint with this config.json?")
