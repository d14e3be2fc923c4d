"""Whole-model state dicts between a Megatron-Core GPT (local or TE spec, TP = 1, all stages)
and a HF Qwen3 causal LM, so one set of weights can be served by an inference server teacher
and loaded into a Megatron teacher (the GPU lane compares their log-probs).

The names and layouts (grouped ``linear_qkv``, ``linear_fc1 = [gate; up]``, TE-fused norm
names) are :mod:`mcore_distill.hf`'s Qwen3 mapping table; this module only walks a state dict
through it. For checkpoints on disk, any TP/PP/EP layout and the other architectures, use
:mod:`mcore_distill.hf` directly (``megatron_model_from_hf``, ``save_hf_checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_distill.hf.layouts import Dims
from mcore_distill.hf.mapping import QWEN3

__all__ = ["QwenShape", "hf_qwen3_config", "megatron_to_hf_qwen3", "hf_qwen3_to_megatron"]


@dataclass(frozen=True, slots=True)
class QwenShape:
    """The shape facts the mapping needs (widths and vocabulary are read from the tensors)."""

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


def _dims(shape: QwenShape, embedding: torch.Tensor, fc1: torch.Tensor) -> Dims:
    return Dims(L=shape.num_layers, H=embedding.shape[1], Q=shape.num_attention_heads, G=shape.num_query_groups,
                D=shape.head_dim, F=fc1.shape[0] // 2, V=embedding.shape[0], tied=shape.tie_embeddings)


def megatron_to_hf_qwen3(state: dict[str, torch.Tensor], shape: QwenShape) -> dict[str, torch.Tensor]:
    """HF Qwen3 state dict from a full (TP = 1, all stages) Megatron GPT state dict. With tied
    embeddings ``lm_head.weight`` is the embedding (``Qwen3ForCausalLM.load_state_dict`` wants it)."""
    d = _dims(shape, state["embedding.word_embeddings.weight"], state["decoder.layers.0.mlp.linear_fc1.weight"])
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("_extra_state"):
            continue
        m = QWEN3.resolve(name, d)
        if m.save:
            out.update(zip(m.hf, m.layout.to_hf(t, d, names=m.hf)))
    if shape.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def hf_qwen3_to_megatron(hf: dict[str, torch.Tensor], shape: QwenShape, *, te_spec: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Full Megatron GPT state dict (local spec, or TE spec with fused norms) from HF Qwen3."""
    d = _dims(shape, hf["model.embed_tokens.weight"], torch.empty(2 * hf["model.layers.0.mlp.gate_proj.weight"].shape[0]))
    fused = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    out = {}
    for name, m in QWEN3.entries(d):
        if te_spec:
            for local, te in fused.items():
                name = name.replace(local, te) if name.endswith(local) else name
        out[name] = m.layout.from_hf([hf[n] for n in m.hf], d)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
