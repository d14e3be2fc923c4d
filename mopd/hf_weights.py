"""Name/layout mapping between a Megatron-Core GPT (local or TE spec, TP = 1 full state dict)
and a HF Qwen3 causal LM, so one set of weights can be served by an inference server teacher
and loaded into a Megatron teacher (the GPU lane compares their log-probs).

Layout facts: Megatron's ``linear_qkv`` stacks, per query group g, the group's query heads,
then its key head, then its value head (``[G·(q_per_g + 2)·d, H]``); ``linear_fc1`` is
``cat(gate, up)`` (SwiGLU takes ``silu(first half) * second half``). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QwenShape", "hf_qwen3_config", "megatron_to_hf_qwen3", "hf_qwen3_to_megatron"]


@dataclass(frozen=True, slots=True)
class QwenShape:
    """The shape facts the mapping needs."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    tie_embeddings: bool = False


def hf_qwen3_config(*, vocab_size: int, hidden_size: int, ffn_hidden_size: int, shape: QwenShape,
                    max_position_embeddings: int, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6):
    """A ``transformers.Qwen3Config`` for the Megatron model of these sizes (lazy import)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups, head_dim=shape.head_dim, rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=shape.tie_embeddings,
        rope_theta=rope_theta, attention_bias=False, hidden_act="silu", architectures=["Qwen3ForCausalLM"],
    )


def _split_qkv(w: torch.Tensor, s: QwenShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qpg = s.num_attention_heads // s.num_query_groups
    g = w.reshape(s.num_query_groups, qpg + 2, s.head_dim, -1)
    q = g[:, :qpg].reshape(s.num_attention_heads * s.head_dim, -1)
    k = g[:, qpg].reshape(s.num_query_groups * s.head_dim, -1)
    v = g[:, qpg + 1].reshape(s.num_query_groups * s.head_dim, -1)
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: QwenShape) -> torch.Tensor:
    qpg = s.num_attention_heads // s.num_query_groups
    h = q.shape[-1]
    parts = [q.reshape(s.num_query_groups, qpg, s.head_dim, h), k.reshape(s.num_query_groups, 1, s.head_dim, h),
             v.reshape(s.num_query_groups, 1, s.head_dim, h)]
    return torch.cat(parts, 1).reshape(-1, h)


_LAYER = {  # megatron suffix → hf suffix (1:1 tensors)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE spec
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def megatron_to_hf_qwen3(state: dict[str, torch.Tensor], shape: QwenShape) -> dict[str, torch.Tensor]:
    """HF Qwen3 state dict from a full (TP = 1, all stages) Megatron GPT state dict."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = state["embedding.word_embeddings.weight" if shape.tie_embeddings else "output_layer.weight"]
    for i in range(shape.num_layers):
        pre, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER.items():
            if pre + m in state:
                out[hf + h] = state[pre + m]
        q, k, v = _split_qkv(state[pre + "self_attention.linear_qkv.weight"], shape)
        out[hf + "self_attn.q_proj.weight"], out[hf + "self_attn.k_proj.weight"] = q, k
        out[hf + "self_attn.v_proj.weight"] = v
        gate, up = state[pre + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def hf_qwen3_to_megatron(hf: dict[str, torch.Tensor], shape: QwenShape, *, te_spec: bool = False) -> dict[str, torch.Tensor]:
    """Full Megatron GPT state dict (local spec, or TE spec with fused norms) from HF Qwen3."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not shape.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    skip = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight") if not te_spec else (
        "input_layernorm.weight", "pre_mlp_layernorm.weight")
    for i in range(shape.num_layers):
        pre, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for m, name in _LAYER.items():
            if m not in skip:
                out[pre + m] = hf[h + name]
        out[pre + "self_attention.linear_qkv.weight"] = _join_qkv(
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"], shape)
        out[pre + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
