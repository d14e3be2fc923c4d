"""Converter: layouts against plain-loop references, bad input, and the Megatron → HF → logits
round trip at TP=2 (dense, MoE + tied embeddings) and EP=2 on gloo."""

from __future__ import annotations

import pytest
import torch

from colocate import HFModelSpec
from colocate.convert import (
    ConversionError,
    ParamMismatchError,
    check_params,
    globalize_name,
    hf_param_specs,
    megatron_to_hf,
    merge_qkv,
    merge_tp_shards,
    split_qkv,
)
from colocate.errors import ConfigError
from colocate.reference import reference_merge_glu, reference_split_qkv
from mcore_distill.testing import run_ranks

from ._hybrid_ranks import dense_moe_and_hybrid


@pytest.mark.parametrize("Q,G,D,H", [(6, 2, 5, 7), (8, 8, 3, 4), (12, 3, 4, 9), (4, 1, 16, 3)],
                         ids=lambda v: str(v))
def test_split_qkv_matches_loop_reference(Q, G, D, H):
    qkv = torch.randn(G * (Q // G + 2) * D, H, dtype=torch.float64)
    got = split_qkv(qkv, num_heads=Q, num_groups=G, head_dim=D)
    want = reference_split_qkv(qkv, num_heads=Q, num_groups=G, head_dim=D)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(merge_qkv(*got, num_heads=Q, num_groups=G, head_dim=D), qkv)
    bias = torch.randn(qkv.shape[0], dtype=torch.float64)
    for g, w in zip(split_qkv(bias, num_heads=Q, num_groups=G, head_dim=D),
                    reference_split_qkv(bias, num_heads=Q, num_groups=G, head_dim=D)):
        assert torch.equal(g, w)


def test_split_qkv_is_not_equal_thirds():
    Q, G, D = 6, 2, 4
    qkv = torch.arange(G * (Q // G + 2) * D, dtype=torch.float64)[:, None]
    q, k, v = split_qkv(qkv, num_heads=Q, num_groups=G, head_dim=D)
    assert (q.shape[0], k.shape[0], v.shape[0]) == (Q * D, G * D, G * D)
    thirds = qkv.chunk(3)
    assert not torch.equal(q[: thirds[0].shape[0]], thirds[0]) or q.shape != thirds[0].shape
    # group 1's key head starts after group 0's 3 query heads + k + v and group 1's 3 query heads
    assert k[D, 0].item() == (Q // G + 2) * D + (Q // G) * D


def test_merge_tp_shards_glu_and_linear_match_reference():
    shards = [torch.randn(2 * 5, 3, dtype=torch.float64) for _ in range(3)]
    assert torch.equal(merge_tp_shards(shards, kind="glu"), reference_merge_glu(shards))
    assert not torch.equal(merge_tp_shards(shards, kind="glu"), torch.cat(shards))
    assert torch.equal(merge_tp_shards(shards, kind="col"), torch.cat(shards, 0))
    assert torch.equal(merge_tp_shards(shards, kind="row"), torch.cat(shards, 1))
    with pytest.raises(ConversionError, match="unknown kind 'diag'"):
        merge_tp_shards(shards, kind="diag")


def test_globalize_name_layers_and_experts():
    n = "module.module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert globalize_name(n, layer_id=7, expert_offset=8) == "decoder.layers.7.mlp.experts.local_experts.11.linear_fc1.weight"
    assert globalize_name("decoder.layers.0.mlp.experts.linear_fc2.weight2", layer_id=4, expert_offset=4) == \
        "decoder.layers.4.mlp.experts.linear_fc2.weight6"


def _moe_spec(**kw):
    base = dict(arch="qwen3_moe", num_layers=2, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                head_dim=2, ffn_hidden_size=6, vocab_size=16, num_experts=4)
    base.update(kw)
    return HFModelSpec(**base)


def test_megatron_to_hf_rules_router_bias_te_norms_tied():
    spec = _moe_spec(router_dtype="bf16", has_expert_bias=True, tie_embeddings=True)
    r = megatron_to_hf("decoder.layers.1.mlp.router.weight", torch.randn(4, 8), spec=spec)
    assert r[0][0] == "model.layers.1.mlp.gate.weight" and r[0][1].dtype == torch.bfloat16
    b = megatron_to_hf("decoder.layers.1.mlp.router.expert_bias", torch.zeros(4, dtype=torch.bfloat16), spec=spec)
    assert b[0][0] == "model.layers.1.mlp.gate.e_score_correction_bias" and b[0][1].dtype == torch.float32
    assert megatron_to_hf("output_layer.weight", torch.randn(16, 8), spec=spec) == []
    te = megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", torch.ones(8), spec=spec)
    assert te[0][0] == "model.layers.0.input_layernorm.weight"
    te = megatron_to_hf("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", torch.ones(8), spec=spec)
    assert te[0][0] == "model.layers.0.post_attention_layernorm.weight"
    fc1 = torch.randn(12, 8)
    g = megatron_to_hf("decoder.layers.0.mlp.experts.linear_fc1.weight3", fc1, spec=spec)
    assert [n for n, _ in g] == ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(g[0][1], fc1[:6]) and torch.equal(g[1][1], fc1[6:])
    specs = hf_param_specs(spec, dtype=torch.float32)
    assert "lm_head.weight" not in specs and specs["model.layers.0.mlp.gate.weight"][1] == torch.bfloat16


def test_padded_vocab_rows_are_trimmed_for_the_receiver():
    spec = _moe_spec(vocab_size=24, serve_vocab_size=16)
    emb = torch.randn(24, 8)
    (n, t), = megatron_to_hf("embedding.word_embeddings.weight", emb, spec=spec)
    assert n == "model.embed_tokens.weight" and torch.equal(t, emb[:16])
    assert megatron_to_hf("output_layer.weight", emb, spec=spec)[0][1].shape == (16, 8)
    assert hf_param_specs(spec, dtype=torch.float32)["lm_head.weight"][0] == (16, 8)
    with pytest.raises(ConfigError, match="serve_vocab_size=30"):
        _moe_spec(vocab_size=24, serve_vocab_size=30)


def test_megatron_to_hf_bad_names_raise_with_the_name():
    spec = _moe_spec()
    with pytest.raises(ConversionError, match="decoder.layers.0.mlp.mystery.weight"):
        megatron_to_hf("decoder.layers.0.mlp.mystery.weight", torch.zeros(1), spec=spec)
    with pytest.raises(ConversionError, match="expert 9 outside num_experts=4"):
        megatron_to_hf("decoder.layers.0.mlp.experts.local_experts.9.linear_fc2.weight", torch.zeros(8, 6), spec=spec)
    with pytest.raises(ConversionError, match="layer 5 outside num_layers=2"):
        megatron_to_hf("decoder.layers.5.input_layernorm.weight", torch.zeros(8), spec=spec)
    with pytest.raises(ConversionError, match="expected G"):
        split_qkv(torch.zeros(7, 2), num_heads=4, num_groups=2, head_dim=2)


def test_check_params_reports_first_ten_with_both_sides():
    expected = {f"w{i}": ((2, 3), torch.float32) for i in range(15)}
    sent = {f"w{i}": ((3, 2), torch.float32) for i in range(12)} | {"extra": ((1,), torch.bfloat16)}
    with pytest.raises(ParamMismatchError) as ei:
        check_params(sent, expected)
    err = ei.value
    assert err.total == 12 + 1 + 3 and len(err.problems) == 10
    assert "w0: sent (3, 2) torch.float32, receiver expects (2, 3) torch.float32" in str(err)
    check_params({"w0": ((2, 3), torch.float32)}, expected, require_all=False)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_megatron_tp2_ep2_to_hf_logits_and_publish_roundtrip():
    """One spawned 2-rank run: dense TP=2, MoE TP=2 with tied embeddings, MoE EP=2.

    (a) gathered + converted weights loaded into a config-built transformers model give the
    Megatron logits (fp32, ≤1e-5); (b) the same weights published lazily in small buckets into
    the embedded engine arrive bit for bit and its logits equal Megatron's (≤1e-5); (c) a
    Qwen3.5-style hybrid (GDN + gated attention) at TP=2: shards gathered, GDN ``in_proj`` /
    ``conv1d`` merged section by section (``merge_named_tp_shards``), converted, loaded strictly
    into ``Qwen3_5ForCausalLM``, logits ≤1e-5 (same spawned run: multi-rank runs are expensive)."""
    cases = [{"id": "dense-tp2", "tp": 2}, {"id": "moe-tp2-tied", "tp": 2, "experts": 4, "tied": True},
             {"id": "moe-ep2", "tp": 1, "ep": 2, "experts": 4, "extra": {"expert_model_parallel_size": 2}}]
    (conv, pub), hybrid = run_ranks(dense_moe_and_hybrid, 2, cases, timeout=280)[0]
    assert hybrid["max_abs"] <= 1e-5 and hybrid["scale"] > 0.1, hybrid
    for c in conv:
        assert c["max_abs"] <= 1e-5, c
        assert c["ref_scale"] > 0.1, c  # logits are not trivially zero
    names = {c["case"]: c["names"] for c in conv}
    assert "lm_head.weight" not in names["moe-tp2-tied"] and "lm_head.weight" in names["dense-tp2"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names["moe-ep2"]
    for p in pub:
        assert p["bitwise_equal"] and p["version"] == 1 and p["buckets"] > 1, p
        assert p["max_abs"] <= 1e-5, p


def test_configs_are_hydra_structured_configs():
    from omegaconf import OmegaConf

    from colocate import EngineConfig, PublishConfig, WorkerSpec

    cfg = OmegaConf.merge(OmegaConf.structured(PublishConfig),
                          OmegaConf.from_dotlist(["transport=shm", "bucket_bytes=1024", "max_in_flight=1"]))
    pub = OmegaConf.to_object(cfg)
    assert isinstance(pub, PublishConfig) and pub.transport == "shm" and pub.bucket_bytes == 1024
    with pytest.raises(ConfigError, match="max_in_flight must be 1 or 2, got 3"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PublishConfig), {"max_in_flight": 3}))
    assert OmegaConf.to_object(OmegaConf.structured(EngineConfig)).dtype == "float32"
    spec = OmegaConf.to_object(OmegaConf.structured(_moe_spec(router_dtype="bf16")))
    assert spec.router_dtype == "bf16" and spec.moe_ffn_hidden_size == 6
    w = OmegaConf.to_object(OmegaConf.structured(WorkerSpec(role="rollout", command=["x"], devices=[0])))
    assert w.devices == [0]
    with pytest.raises(ConfigError, match="HFModelSpec.arch"):
        _moe_spec(arch="llama")
