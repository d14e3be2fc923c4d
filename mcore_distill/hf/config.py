"""Reading and writing HF ``config.json`` for the supported architectures, and the Megatron
``TransformerConfig`` that reproduces it.

:func:`read_hf_config` loads the JSON; :func:`hf_arch` validates it into an :class:`HFArch`
(every field we cannot reproduce raises :class:`~mcore_distill.hf.errors.UnsupportedConfigError`
naming it); :func:`transformer_config_from_hf` turns that into Megatron's config plus the
``GPTModel`` arguments and the padded vocabulary; :func:`hf_config_dict` writes an
:class:`HFArch` back as ``config.json``; :func:`arch_from_megatron` reads one from a Megatron
model (for saving a model that did not come from HF).

Supported (``model_type``): ``qwen3`` (``Qwen3ForCausalLM``), ``qwen3_moe``
(``Qwen3MoeForCausalLM``), ``qwen3_next`` (``Qwen3NextForCausalLM``: Gated DeltaNet + gated
attention, dense MLP or routed experts with a gated shared expert in every layer) and
``qwen3_5_text`` (``Qwen3_5ForCausalLM``, dense MLP). RoPE: ``default`` and ``linear`` scaling.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_distill.hf.errors import (
    CheckpointFileError,
    ConfigMismatchError,
    UnsupportedConfigError,
    VocabSizeError,
)

__all__ = [
    "HFArch",
    "MegatronHFConfig",
    "read_hf_config",
    "hf_arch",
    "pad_vocab_size",
    "transformer_config_from_hf",
    "hf_config_dict",
    "arch_from_megatron",
    "check_model_matches",
]

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# keys that never change the computation (bookkeeping, tokens, generation defaults)
_IGNORED = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "torchscript", "use_bfloat16",
    "tie_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "prefix",
    "finetuning_task", "task_specific_params", "pruned_heads", "tf_legacy_loss", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "_attn_implementation",
    "attn_implementation", "output_router_logits",
})
_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "attention_dropout",
    "router_aux_loss_coef",
})
_MOE = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"})
_GDN = frozenset({"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads", "layer_types", "partial_rotary_factor"})
_KNOWN = {
    "qwen3": _COMMON | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3_moe": _COMMON | _MOE | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3_next": _COMMON | _MOE | _GDN | {"shared_expert_intermediate_size", "full_attention_interval"},
    "qwen3_5_text": _COMMON | _GDN,
}


@dataclass(frozen=True, kw_only=True)
class HFArch:
    """A validated HF model description (field names shared with :class:`colocate.HFModelSpec`,
    so one mapping table serves both)."""

    model_type: str
    """``qwen3``, ``qwen3_moe``, ``qwen3_next`` or ``qwen3_5_text``."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """KV heads."""
    head_dim: int
    ffn_hidden_size: int
    """Dense MLP intermediate size (``intermediate_size``)."""
    vocab_size: int
    """Rows of the HF embedding (unpadded)."""
    tie_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float | None = None
    """``rope_type="linear"``: positions divided by this factor (None: no scaling)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head that gets RoPE."""
    max_position_embeddings: int = 4096
    attention_dropout: float = 0.0
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    """Renormalize the top-k router probabilities (Megatron: softmax after top-k)."""
    router_aux_loss_coef: float = 0.0
    shared_expert_ffn_hidden_size: int | None = None
    layer_types: tuple[str, ...] | None = None
    """Hybrids: ``linear_attention`` (Gated DeltaNet) / ``full_attention`` per layer."""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    dtype: str | None = None
    """``dtype``/``torch_dtype`` of the checkpoint (``bfloat16``…), None when absent."""
    megatron_zero_centered_gamma: bool = False
    """Set from the Megatron model (``layernorm_zero_centered_gamma``), not from HF."""

    @property
    def gdn_layout(self) -> str:
        return "qwen3_5" if self.model_type == "qwen3_5_text" else "qwen3_next"

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model folder as a dict (:class:`CheckpointFileError` naming the
    file when it is absent or not JSON)."""
    f = Path(path) / "config.json"
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: no config.json (not an HF model folder)") from None
    except (OSError, ValueError) as err:
        raise CheckpointFileError(f"{f}: cannot read config.json: {err}") from None


def _bad(field: str, value: Any, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"config.json {field}={value!r}: {why}")


def _rope(cfg: dict) -> tuple[float, float | None, float]:
    """(theta, linear factor or None, partial rotary factor) from the transformers 4.x keys
    (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``) or 5.x ``rope_parameters``."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type", "default"))
    bad = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
                                "mrope_section", "mrope_interleaved"})
    if kind not in ("default", "linear"):
        raise _bad("rope_scaling.rope_type", kind, "only 'default' and 'linear' RoPE are supported")
    if bad:
        raise _bad("rope_scaling", {k: params[k] for k in bad}, "unsupported RoPE parameters")
    factor = float(params["factor"]) if kind == "linear" else None
    if factor is not None and not factor > 0:
        raise _bad("rope_scaling.factor", factor, "must be > 0")
    if not 0 < float(partial) <= 1:
        raise _bad("partial_rotary_factor", partial, "must be in (0, 1]")
    return float(theta), factor, float(partial)


def _int(cfg: dict, key: str, default: Any = None, *, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UnsupportedConfigError(f"config.json {key}={v!r}: must be an int >= {minimum}")
    return v


def hf_arch(cfg: dict[str, Any] | str | Path, *, ignore_fields: tuple[str, ...] = ()) -> HFArch:
    """Validate an HF config (dict, or a model folder) into an :class:`HFArch`.

    Raises :class:`UnsupportedConfigError` naming the field for an unknown ``model_type`` or
    ``architectures`` entry, any key this reader does not know (``ignore_fields`` lists keys you
    know do not change the computation), and values it cannot reproduce: activations other than
    SiLU, attention biases, sliding windows, RoPE scaling other than ``linear``, MoE layers
    mixed with dense ones, quantized checkpoints."""
    if not isinstance(cfg, dict):
        cfg = read_hf_config(cfg)
    mt = cfg.get("model_type")
    if mt not in _KNOWN:
        raise _bad("model_type", mt, f"supported: {sorted(_KNOWN)}")
    archs = cfg.get("architectures") or [ARCHITECTURES[mt]]
    if list(archs) != [ARCHITECTURES[mt]]:
        raise _bad("architectures", archs, f"expected [{ARCHITECTURES[mt]!r}]")
    if "quantization_config" in cfg:
        raise _bad("quantization_config", cfg["quantization_config"], "quantized checkpoints are not supported")
    unknown = sorted(set(cfg) - _KNOWN[mt] - _IGNORED - set(ignore_fields))
    if unknown:
        raise UnsupportedConfigError(f"config.json fields not supported for model_type={mt!r}: {unknown} (pass "
                                     "ignore_fields=[...] if they do not change the computation)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _bad("hidden_act", cfg["hidden_act"], "only 'silu' (SwiGLU) is supported")
    if cfg.get("attention_bias", False):
        raise _bad("attention_bias", True, "q/k/v/o projection biases are not supported")
    if cfg.get("use_sliding_window", False):
        raise _bad("use_sliding_window", True, "sliding-window attention is not supported")
    L, H, Q = _int(cfg, "num_hidden_layers"), _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    G = _int(cfg, "num_key_value_heads", Q)
    if Q % G:
        raise _bad("num_key_value_heads", G, f"must divide num_attention_heads={Q}")
    theta, factor, partial = _rope(cfg)
    kw: dict[str, Any] = dict(
        model_type=mt, num_layers=L, hidden_size=H, num_attention_heads=Q, num_query_groups=G,
        head_dim=_int(cfg, "head_dim", H // Q), ffn_hidden_size=_int(cfg, "intermediate_size"),
        vocab_size=_int(cfg, "vocab_size"), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_linear_factor=factor,
        partial_rotary_factor=partial, max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)), dtype=cfg.get("dtype", cfg.get("torch_dtype")),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0)
    if mt in ("qwen3", "qwen3_moe"):
        types = cfg.get("layer_types")
        if types is not None and set(types) != {"full_attention"}:
            raise _bad("layer_types", types, "only 'full_attention' layers (no sliding windows)")
    else:
        kw.update(_gdn_fields(cfg, L))
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    if mt in ("qwen3_moe", "qwen3_next") and experts:
        kw.update(_moe_fields(cfg, L, experts))
    elif mt == "qwen3_moe":
        raise _bad("num_experts", experts, "a qwen3_moe model needs experts")
    return HFArch(**kw)


def _moe_fields(cfg: dict, L: int, experts: int) -> dict:
    step, only = cfg.get("decoder_sparse_step", 1), list(cfg.get("mlp_only_layers") or [])
    moe_layers = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    if not moe_layers:
        return {}  # every layer dense
    if len(moe_layers) != L:
        raise _bad("mlp_only_layers/decoder_sparse_step", (only, step),
                   "MoE and dense MLP layers mixed in one model are not supported")
    kw = dict(num_experts=_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts"),
              moe_ffn_hidden_size=_int(cfg, "moe_intermediate_size"),
              num_experts_per_tok=_int(cfg, "num_experts_per_tok"), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if cfg.get("model_type") == "qwen3_next":
        kw["shared_expert_ffn_hidden_size"] = cfg.get("shared_expert_intermediate_size") or None
    if kw["num_experts_per_tok"] > kw["num_experts"]:
        raise _bad("num_experts_per_tok", kw["num_experts_per_tok"], f"exceeds num_experts={kw['num_experts']}")
    return kw


def _gdn_fields(cfg: dict, L: int) -> dict:
    types = cfg.get("layer_types")
    if types is None and "full_attention_interval" in cfg:
        n = _int(cfg, "full_attention_interval")
        types = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or set(types) - {"linear_attention", "full_attention"}:
        raise _bad("layer_types", types, f"must list {L} of 'linear_attention'/'full_attention'")
    kw = dict(layer_types=tuple(types), linear_num_key_heads=_int(cfg, "linear_num_key_heads"),
              linear_num_value_heads=_int(cfg, "linear_num_value_heads"),
              linear_key_head_dim=_int(cfg, "linear_key_head_dim"),
              linear_value_head_dim=_int(cfg, "linear_value_head_dim"),
              linear_conv_kernel_dim=_int(cfg, "linear_conv_kernel_dim"))
    if kw["linear_num_value_heads"] % kw["linear_num_key_heads"]:
        raise _bad("linear_num_value_heads", kw["linear_num_value_heads"],
                   f"must be a multiple of linear_num_key_heads={kw['linear_num_key_heads']}")
    return kw


def pad_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by · tp`` (each TP rank
    holds ``padded / tp`` rows of the embedding and the LM head)."""
    m = divisible_by * tp
    return int(math.ceil(vocab_size / m) * m)


@dataclass
class MegatronHFConfig:
    """What :func:`transformer_config_from_hf` returns: the Megatron config, the ``GPTModel``
    keyword arguments (vocabulary, RoPE, tied embeddings), and the parsed HF description."""

    config: Any
    """``megatron.core.transformer.TransformerConfig``."""
    arch: HFArch
    padded_vocab_size: int
    """Rows of Megatron's embedding: HF ``vocab_size`` padded (:func:`pad_vocab_size`)."""
    gpt_kwargs: dict[str, Any]
    """``vocab_size``, ``max_sequence_length``, ``position_embedding_type``, ``rotary_base``,
    ``rotary_percent``, ``seq_len_interpolation_factor``, ``share_embeddings_and_output_weights``."""

    @property
    def layer_pattern(self) -> str | None:
        """Hybrids: one letter per layer, ``G`` Gated DeltaNet, ``A`` attention (None otherwise)."""
        t = self.arch.layer_types
        return None if t is None else "".join("A" if x == "full_attention" else "G" for x in t)


_SHAPE_FIELDS = frozenset({"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                           "ffn_hidden_size", "num_moe_experts", "moe_ffn_hidden_size", "linear_num_key_heads",
                           "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                           "linear_conv_kernel_dim", "moe_shared_expert_intermediate_size", "normalization",
                           "gated_linear_unit", "qk_layernorm", "attention_output_gate", "add_bias_linear",
                           "add_qkv_bias", "experimental_attention_variant", "linear_attention_freq"})


def _parallel_sizes() -> dict[str, int]:
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return {}
    if not ps.model_parallel_is_initialized():
        return {}
    return dict(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                context_parallel_size=ps.get_context_parallel_world_size(),
                virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size())


def transformer_config_from_hf(path: str | Path | dict, *, make_vocab_size_divisible_by: int = 128,
                               padded_vocab_size: int | None = None, ignore_fields: tuple[str, ...] = (),
                               **overrides: Any) -> MegatronHFConfig:
    """The Megatron ``TransformerConfig`` (and ``GPTModel`` arguments) of the HF model at ``path``.

    Parallel sizes come from Megatron's ``parallel_state`` when it is initialized. ``overrides``
    are ``TransformerConfig`` fields (``params_dtype``, ``sequence_parallel``, recomputation,
    ``moe_token_dispatcher_type``, …); fields that the checkpoint fixes (layer count, widths, heads,
    experts, GDN sizes) cannot be overridden. Defaults: parameters in the checkpoint's dtype,
    fusions that need Transformer Engine / Apex off, ``allgather`` MoE dispatch (runs on CPU and GPU).

    The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` × TP
    (``padded_vocab_size`` sets it explicitly; :class:`VocabSizeError` if it is smaller than the HF
    vocabulary or not divisible by TP)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = hf_arch(path, ignore_fields=ignore_fields)
    fixed = sorted(set(overrides) & _SHAPE_FIELDS)
    if fixed:
        raise ConfigMismatchError(f"transformer_config_from_hf: {fixed} are fixed by config.json and cannot be "
                                  "overridden")
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise UnsupportedConfigError(f"transformer_config_from_hf: {bad} are not TransformerConfig fields")
    sizes = {k: v for k, v in _parallel_sizes().items() if v is not None}
    dtype = overrides.get("params_dtype") or _DTYPES.get(arch.dtype or "float32", torch.float32)
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
        attention_dropout=arch.attention_dropout, hidden_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, **sizes)
    if arch.num_experts:
        kw.update(num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                  moe_router_topk=arch.num_experts_per_tok, moe_router_pre_softmax=not arch.norm_topk_prob,
                  moe_router_score_function="softmax", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                  moe_router_load_balancing_type="aux_loss" if arch.router_aux_loss_coef else "none",
                  moe_aux_loss_coeff=arch.router_aux_loss_coef)
        if arch.shared_expert_ffn_hidden_size:
            kw.update(moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=True)
    if arch.is_hybrid:
        kw.update(experimental_attention_variant="gated_delta_net", attention_output_gate=True,
                  linear_attention_freq=[int(t == "linear_attention") for t in arch.layer_types],
                  linear_num_key_heads=arch.linear_num_key_heads, linear_num_value_heads=arch.linear_num_value_heads,
                  linear_key_head_dim=arch.linear_key_head_dim, linear_value_head_dim=arch.linear_value_head_dim,
                  linear_conv_kernel_dim=arch.linear_conv_kernel_dim)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    tp = config.tensor_model_parallel_size
    if padded_vocab_size is None:
        padded = pad_vocab_size(arch.vocab_size, divisible_by=make_vocab_size_divisible_by, tp=tp)
    elif padded_vocab_size < arch.vocab_size or padded_vocab_size % tp:
        raise VocabSizeError(f"padded_vocab_size={padded_vocab_size} must be >= config.json vocab_size="
                             f"{arch.vocab_size} and divisible by tensor_model_parallel_size={tp}")
    else:
        padded = padded_vocab_size
    gpt = dict(vocab_size=padded, max_sequence_length=arch.max_position_embeddings, position_embedding_type="rope",
               rotary_base=arch.rope_theta, rotary_percent=arch.partial_rotary_factor,
               seq_len_interpolation_factor=arch.rope_linear_factor,
               share_embeddings_and_output_weights=arch.tie_embeddings)
    return MegatronHFConfig(config=config, arch=arch, padded_vocab_size=padded, gpt_kwargs=gpt)


def hf_config_dict(arch: HFArch, *, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """``config.json`` for ``arch`` (transformers ≥ 5 ``rope_parameters`` and the 4.x keys)."""
    dt = dtype if isinstance(dtype, str) or dtype is None else str(dtype).removeprefix("torch.")
    rope: dict[str, Any] = {"rope_type": "linear" if arch.rope_linear_factor else "default", "rope_theta": arch.rope_theta}
    if arch.rope_linear_factor:
        rope["factor"] = arch.rope_linear_factor
    if arch.is_hybrid:
        rope["partial_rotary_factor"] = arch.partial_rotary_factor
    out: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[arch.model_type]], model_type=arch.model_type, vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_query_groups,
        head_dim=arch.head_dim, hidden_act="silu", rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_embeddings,
        attention_bias=False, attention_dropout=arch.attention_dropout, rope_parameters=rope,
        rope_theta=arch.rope_theta,
        rope_scaling=None if not arch.rope_linear_factor else {"rope_type": "linear", "factor": arch.rope_linear_factor})
    if dt is not None:
        out["dtype"] = out["torch_dtype"] = dt
    if arch.model_type in ("qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    if arch.num_experts:
        out.update(num_experts=arch.num_experts, moe_intermediate_size=arch.moe_ffn_hidden_size,
                   num_experts_per_tok=arch.num_experts_per_tok, norm_topk_prob=arch.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=bool(arch.router_aux_loss_coef),
                   router_aux_loss_coef=arch.router_aux_loss_coef)
        if arch.shared_expert_ffn_hidden_size:
            out["shared_expert_intermediate_size"] = arch.shared_expert_ffn_hidden_size
    elif arch.model_type == "qwen3_next":
        out.update(num_experts=0, mlp_only_layers=list(range(arch.num_layers)))
    if arch.is_hybrid:
        out.update(layer_types=list(arch.layer_types), partial_rotary_factor=arch.partial_rotary_factor,
                   linear_num_key_heads=arch.linear_num_key_heads, linear_num_value_heads=arch.linear_num_value_heads,
                   linear_key_head_dim=arch.linear_key_head_dim, linear_value_head_dim=arch.linear_value_head_dim,
                   linear_conv_kernel_dim=arch.linear_conv_kernel_dim)
    return out


def _model_facts(model: Any) -> tuple[Any, dict[str, Any]]:
    c = model.config
    return c, dict(vocab_size=int(model.vocab_size), tied=bool(model.share_embeddings_and_output_weights),
                   rotary_base=float(getattr(model, "rotary_base", 10000)),
                   rotary_percent=float(getattr(model, "rotary_percent", 1.0)),
                   interp=getattr(getattr(model, "rotary_pos_emb", None), "seq_len_interpolation_factor", None),
                   max_seq=int(getattr(model, "max_sequence_length", 4096)))


def _layer_types(c: Any) -> tuple[str, ...] | None:
    if getattr(c, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    freq = c.linear_attention_freq
    pattern = freq if isinstance(freq, list) else [0 if (i + 1) % freq == 0 else 1 for i in range(c.num_layers)]
    return tuple("linear_attention" if p else "full_attention" for p in pattern)


def arch_from_megatron(model: Any, *, model_type: str | None = None, vocab_size: int | None = None) -> HFArch:
    """The :class:`HFArch` of an (unwrapped) Megatron ``GPTModel`` built without an HF source:
    ``model_type`` defaults to ``qwen3``/``qwen3_moe``, or ``qwen3_next`` for a Gated DeltaNet
    hybrid (``experimental_attention_variant="gated_delta_net"`` and ``linear_attention_freq``
    set in its config); ``vocab_size`` (the HF rows to keep) defaults to the model's."""
    c, f = _model_facts(model)
    types = _layer_types(c)
    if model_type is None:
        model_type = "qwen3_next" if types else "qwen3_moe" if c.num_moe_experts else "qwen3"
    if model_type not in ARCHITECTURES:
        raise _bad("model_type", model_type, f"supported: {sorted(ARCHITECTURES)}")
    if (types is not None) != (model_type in ("qwen3_next", "qwen3_5_text")):
        raise ConfigMismatchError(f"model_type={model_type!r} does not fit the Megatron model (Gated DeltaNet "
                                  f"layers: {types is not None}; hybrids need experimental_attention_variant="
                                  "'gated_delta_net' and linear_attention_freq in the TransformerConfig)")
    kw: dict[str, Any] = dict(
        model_type=model_type, num_layers=c.num_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups or c.num_attention_heads,
        head_dim=c.kv_channels, ffn_hidden_size=c.ffn_hidden_size, vocab_size=vocab_size or f["vocab_size"],
        tie_embeddings=f["tied"], rms_norm_eps=float(c.layernorm_epsilon), rope_theta=f["rotary_base"],
        rope_linear_factor=f["interp"], partial_rotary_factor=f["rotary_percent"], max_position_embeddings=f["max_seq"],
        attention_dropout=float(c.attention_dropout), megatron_zero_centered_gamma=bool(c.layernorm_zero_centered_gamma))
    if c.num_moe_experts:
        kw.update(num_experts=c.num_moe_experts, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
                  num_experts_per_tok=c.moe_router_topk, norm_topk_prob=not c.moe_router_pre_softmax,
                  router_aux_loss_coef=float(c.moe_aux_loss_coeff or 0.0)
                  if c.moe_router_load_balancing_type != "none" else 0.0,
                  shared_expert_ffn_hidden_size=c.moe_shared_expert_intermediate_size)
    if types is not None:
        kw.update(layer_types=types, linear_num_key_heads=c.linear_num_key_heads,
                  linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                  linear_value_head_dim=c.linear_value_head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim)
    return HFArch(**kw)


def check_model_matches(model: Any, arch: HFArch, *, strict: bool = True) -> None:
    """Raise :class:`ConfigMismatchError` (:class:`VocabSizeError` for the vocabulary) naming
    every field where an (unwrapped) Megatron ``GPTModel`` differs from ``arch``: shapes always,
    and with ``strict`` also RoPE, norm epsilon and router settings (which change the outputs
    but not the tensors)."""
    c, f = _model_facts(model)
    if f["vocab_size"] < arch.vocab_size:
        raise VocabSizeError(f"config.json vocab_size={arch.vocab_size} does not fit the Megatron embedding "
                             f"(vocab_size={f['vocab_size']} rows)")
    pairs = [("num_layers", c.num_layers, arch.num_layers), ("hidden_size", c.hidden_size, arch.hidden_size),
             ("num_attention_heads", c.num_attention_heads, arch.num_attention_heads),
             ("num_query_groups", c.num_query_groups or c.num_attention_heads, arch.num_query_groups),
             ("kv_channels", c.kv_channels, arch.head_dim), ("num_moe_experts", c.num_moe_experts, arch.num_experts),
             ("share_embeddings_and_output_weights", f["tied"], arch.tie_embeddings),
             ("qk_layernorm", c.qk_layernorm, True), ("gated_linear_unit", c.gated_linear_unit, True),
             ("normalization", c.normalization, "RMSNorm"), ("add_bias_linear", c.add_bias_linear, False),
             ("add_qkv_bias", c.add_qkv_bias, False), ("attention_output_gate", c.attention_output_gate, arch.is_hybrid)]
    if arch.num_experts:
        pairs += [("moe_ffn_hidden_size", c.moe_ffn_hidden_size, arch.moe_ffn_hidden_size),
                  ("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size,
                   arch.shared_expert_ffn_hidden_size)]
    else:
        pairs.append(("ffn_hidden_size", c.ffn_hidden_size, arch.ffn_hidden_size))
    if arch.is_hybrid:
        pairs += [(n, getattr(c, n), getattr(arch, n)) for n in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")]
        if _layer_types(c) is not None:
            pairs.append(("linear_attention_freq", _layer_types(c), arch.layer_types))
    if strict:
        pairs += [("rotary_base", f["rotary_base"], arch.rope_theta),
                  ("rotary_percent", f["rotary_percent"], arch.partial_rotary_factor),
                  ("seq_len_interpolation_factor", f["interp"], arch.rope_linear_factor),
                  ("layernorm_epsilon", c.layernorm_epsilon, arch.rms_norm_eps)]
        if arch.num_experts:
            pairs += [("moe_router_topk", c.moe_router_topk, arch.num_experts_per_tok),
                      ("moe_router_pre_softmax", c.moe_router_pre_softmax, not arch.norm_topk_prob)]
    bad = [f"{n}: model={a!r}, config.json={b!r}" for n, a, b in pairs if a != b]
    if bad:
        raise ConfigMismatchError("the Megatron model does not match config.json: " + "; ".join(bad))
