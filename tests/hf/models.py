"""Tiny random ``transformers`` models of every supported architecture, built from configs (no
downloads), with non-trivial norms and GDN decay parameters so a misplaced tensor shows in the
logits. Shared by the single-process and multi-rank tests."""

from __future__ import annotations

import torch

VOCAB = 50
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2,
           linear_num_value_heads=4)
HYBRID_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
KINDS = ("dense", "tied", "moe", "next", "next-moe", "qwen3.5")


def use_torch_gdn() -> None:
    """transformers binds FLA's Triton kernels for Qwen3-Next/3.5 when fla is installed; on CPU
    use the plain-torch functions they wrap (idempotent; call in every process that runs them)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    for mod in (modeling_qwen3_next, modeling_qwen3_5):
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            f = getattr(mod, fn)
            setattr(mod, fn, getattr(f, "__wrapped__", f))


def hf_config(kind: str):
    from transformers import Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig

    base = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                max_position_embeddings=64)
    if kind in ("dense", "tied"):
        return Qwen3Config(**base, hidden_size=32, intermediate_size=48, num_hidden_layers=4, rope_theta=10000.0,
                           tie_word_embeddings=kind == "tied")
    if kind == "moe":
        return Qwen3MoeConfig(**base, hidden_size=32, intermediate_size=48, num_hidden_layers=4, rope_theta=10000.0,
                              num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2, norm_topk_prob=True)
    hybrid = dict(base, hidden_size=24, intermediate_size=20, num_hidden_layers=4, layer_types=HYBRID_TYPES,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, **GDN)
    if kind == "qwen3.5":
        return Qwen3_5TextConfig(**hybrid)
    if kind == "next":
        return Qwen3NextConfig(**hybrid, num_experts=0, mlp_only_layers=list(range(4)))
    if kind == "next-moe":
        return Qwen3NextConfig(**hybrid, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                               num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1)
    raise ValueError(kind)


def hf_model(kind: str, *, seed: int = 0):
    """The random fp32 model of ``kind`` in eval mode (eager experts: exact on CPU)."""
    from transformers import AutoModelForCausalLM

    if kind in ("next", "next-moe", "qwen3.5"):
        use_torch_gdn()
    torch.manual_seed(seed)
    cfg = hf_config(kind)
    cfg._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if kind in ("dense", "tied", "moe") else 0.0))
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def load_transformers(path, kind: str):
    """The saved folder loaded by ``transformers`` (``from_pretrained``) and its loading report."""
    from transformers import AutoModelForCausalLM

    if kind in ("next", "next-moe", "qwen3.5"):
        use_torch_gdn()
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32,
                                                       experts_implementation="eager")
    return model.eval(), info
