"""``mopd.hf_weights`` walks whole state dicts through mcore_distill.hf's Qwen3 table: Megatron →
HF → Megatron is the identity (local and TE norm names, tied and untied)."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
from mopd.hf_weights import QwenShape, hf_qwen3_to_megatron, megatron_to_hf_qwen3


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_round_trip(cpu_megatron, tied):
    seed_all(0)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                         num_query_groups=2, ffn_hidden_size=48, tie_embeddings=tied))
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    shape = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=8, tie_embeddings=tied)
    hf = megatron_to_hf_qwen3(state, shape)
    assert ("lm_head.weight" in hf) and hf["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    back = hf_qwen3_to_megatron(hf, shape)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    te = hf_qwen3_to_megatron(hf, shape, te_spec=True)
    assert torch.equal(te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                       state["decoder.layers.0.input_layernorm.weight"])
    assert "decoder.layers.0.input_layernorm.weight" not in te
    assert megatron_to_hf_qwen3(te, shape).keys() == hf.keys()
