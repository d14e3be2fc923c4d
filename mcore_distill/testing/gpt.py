"""A tiny Qwen3-style Megatron-Core ``GPTModel`` built from a config, for tests and demos.

Qwen3 traits: RMSNorm, SwiGLU MLP, grouped-query attention, RoPE, qk-norm, no linear biases,
optional tied embeddings, optional MoE (``allgather`` token dispatcher, which runs on CPU).
Uses the local (non-TransformerEngine) layer spec, so it builds and runs on CPU with
:func:`mcore_distill.cpu_compat.enable`, and on GPU unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TinyGPTConfig", "build_tiny_gpt", "transformer_config"]


@dataclass(kw_only=True)
class TinyGPTConfig:
    """Shape and parallelism of the tiny model (a Hydra structured config)."""

    vocab_size: int = 128
    """Vocabulary size (padded to a multiple of ``tensor_model_parallel_size`` by the caller)."""
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """GQA groups; must divide ``num_attention_heads``."""
    kv_channels: int | None = None
    """Head dim; ``hidden_size // num_attention_heads`` when None."""
    ffn_hidden_size: int = 128
    max_sequence_length: int = 64
    rotary_base: int = 10000
    qk_layernorm: bool = True
    tie_embeddings: bool = False
    num_moe_experts: int | None = None
    """None for a dense MLP; otherwise the number of experts (router top-k below)."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    params_dtype: torch.dtype = torch.float32
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    """Full activation recomputation of every layer (``recompute_granularity='full'``)."""
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    extra: dict = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields, passed through as given."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")


def transformer_config(cfg: TinyGPTConfig):
    """The Megatron ``TransformerConfig`` for ``cfg``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=cfg.qk_layernorm,
        layernorm_epsilon=1e-6,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        params_dtype=cfg.params_dtype,
        bf16=cfg.params_dtype == torch.bfloat16,
        pipeline_dtype=cfg.params_dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        init_method_std=0.02,
    )
    if cfg.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.num_moe_experts:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
    kwargs.update(cfg.extra)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(cfg: TinyGPTConfig, *, pre_process: bool | None = None, post_process: bool | None = None,
                   pg_collection=None):
    """Build the Megatron ``GPTModel`` for this pipeline stage.

    Model-parallel state must be initialized (``parallel_state.initialize_model_parallel``)
    and the RNG tracker seeded (:func:`mcore_distill.testing.seed_all`) before calling.
    ``pre_process``/``post_process`` default to this rank's first/last pipeline stage.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
    )
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    model = GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        **kwargs,
    )
    if cfg.params_dtype == torch.float64:
        model.to(torch.float64)  # the torch-norm fallback creates its weights in fp32
    return model
