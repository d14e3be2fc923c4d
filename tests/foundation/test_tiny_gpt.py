"""The tiny Qwen3-style Megatron GPT builder: shapes, Qwen3 traits, MoE, tied embeddings, errors."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all


def _forward(model, batch=2, seq=8, vocab=128):
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model(tokens, torch.arange(seq).expand(batch, seq), None)


def test_dense_qwen3_traits(cpu_megatron):
    cfg = TinyGPTConfig()
    model = build_tiny_gpt(cfg)
    names = dict(model.named_parameters())
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names  # qk-norm
    assert not any(n.endswith(".bias") for n in names)  # no linear biases
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv = names["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((cfg.num_attention_heads + 2 * cfg.num_query_groups) * head_dim, cfg.hidden_size)  # GQA
    assert names["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 2 * cfg.ffn_hidden_size  # SwiGLU
    assert type(model.decoder.final_layernorm).__name__ in ("RMSNorm", "WrappedTorchNorm")
    logits = _forward(model)
    assert logits.shape == (2, 8, cfg.vocab_size) and torch.isfinite(logits).all()


def test_deterministic_under_seed(cpu_megatron):
    seed_all(3)
    a = torch.cat([p.reshape(-1) for p in build_tiny_gpt(TinyGPTConfig()).parameters()])
    seed_all(3)
    b = torch.cat([p.reshape(-1) for p in build_tiny_gpt(TinyGPTConfig()).parameters()])
    assert torch.equal(a, b)


def test_tied_embeddings_and_moe(cpu_megatron):
    tied = build_tiny_gpt(TinyGPTConfig(tie_embeddings=True))
    assert not any(n.startswith("output_layer") for n, _ in tied.named_parameters())
    moe = build_tiny_gpt(TinyGPTConfig(num_moe_experts=4, moe_router_topk=2))
    names = [n for n, _ in moe.named_parameters()]
    assert any("experts" in n for n in names) and any("router" in n for n in names)
    logits = _forward(moe)
    logits.float().sum().backward()
    assert all(p.grad is not None for n, p in moe.named_parameters() if "experts" in n)


def test_recompute_matches_plain(cpu_megatron):
    seed_all(5)
    plain = build_tiny_gpt(TinyGPTConfig())
    seed_all(5)
    recompute = build_tiny_gpt(TinyGPTConfig(recompute=True))
    out_a, out_b = _forward(plain), _forward(recompute)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    out_a.sum().backward()
    out_b.sum().backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), recompute.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_attention_heads": 4, "num_query_groups": 3}, "num_query_groups"), ({"vocab_size": 0}, "vocab_size")],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TinyGPTConfig(**kwargs)
