"""Cross-check the converter against AWEX 0.9.0's Qwen3-MoE Megatron → HF converter where AWEX
is right (GQA QKV split, gate/up split, global expert ids, router dtype, norm names, tied head),
and document where its base class is not (unfused QKV split in equal thirds)."""

from __future__ import annotations

import types

import pytest
import torch

from colocate import HFModelSpec
from colocate.convert import megatron_to_hf, split_qkv

awex_conv = pytest.importorskip("awex.converter.mcore_converter")

Q, G, D, H, F, E = 6, 2, 4, 12, 10, 4


def _tf_config():
    return types.SimpleNamespace(hidden_size=H, num_attention_heads=Q, num_query_groups=G, kv_channels=D,
                                 num_moe_experts=E, moe_router_dtype=None)


def _awex(ep_rank: int, ep_size: int, *, base: bool = False):
    from awex.sharding.rank_info import RankInfo
    from transformers import Qwen3MoeConfig

    rank = RankInfo(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_size=1, dp_rank=0, ep_rank=ep_rank,
                    ep_size=ep_size, ep_tp_rank=0, ep_tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0,
                    world_size=1, global_rank=0, local_rank=0, engine_rank=0, is_infer=False)
    hf = Qwen3MoeConfig(hidden_size=H, num_attention_heads=Q, num_key_value_heads=G, head_dim=D, num_experts=E,
                        num_hidden_layers=2, vocab_size=32)
    if base:
        cls = awex_conv.McoreToHFWeightConverter
    else:
        from awex.models.qwen3_moe import _build_mcore_converter_qwen3_moe

        cls = _build_mcore_converter_qwen3_moe()
    return cls(hf, rank, {"infer_atten_tp_size": 1, "router_dtype": "bf16"}, _tf_config())


def test_gqa_qkv_matches_awex_transform(cpu_megatron):
    qkv = torch.randn(G * (Q // G + 2) * D, H, dtype=torch.float64)
    ours = split_qkv(qkv, num_heads=Q, num_groups=G, head_dim=D)
    theirs = awex_conv.transform_mcore_qkv_weight(qkv, _tf_config())
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    spec = HFModelSpec(arch="qwen3_moe", num_layers=1, hidden_size=H, num_attention_heads=Q, num_query_groups=G,
                       head_dim=D, ffn_hidden_size=F, vocab_size=32, num_experts=E)
    for kind, t in (("weight", qkv), ("bias", qkv[:, 0].clone())):
        name = f"decoder.layers.0.self_attention.linear_qkv.{kind}"
        theirs = dict(_awex(0, 1).convert_param(name, t))
        mine = dict(megatron_to_hf(name, t, spec=spec))
        assert theirs.keys() == mine.keys()
        assert all(torch.equal(theirs[n], mine[n]) for n in mine)


def test_awex_unfused_qkv_is_equal_thirds_and_wrong_for_gqa(cpu_megatron):
    conv = _awex(0, 1, base=True)
    conv._fuse_qkv = lambda name: False
    qkv = torch.randn(G * (Q // G + 2) * D, H)
    theirs = dict(conv.convert_param("decoder.layers.0.self_attention.linear_qkv.weight", qkv))
    q, _, _ = split_qkv(qkv, num_heads=Q, num_groups=G, head_dim=D)
    got_q = next(t for n, t in theirs.items() if n.endswith("q_proj.weight"))
    assert got_q.shape != q.shape  # equal thirds, not GQA groups: we do not use this path


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_mlp_experts_router_norms_match_awex(cpu_megatron, ep_rank):
    ep = 2
    conv = _awex(ep_rank, ep)
    spec = HFModelSpec(arch="qwen3_moe", num_layers=2, hidden_size=H, num_attention_heads=Q, num_query_groups=G,
                       head_dim=D, ffn_hidden_size=F, vocab_size=32, num_experts=E, router_dtype="bf16")
    g = torch.Generator().manual_seed(ep_rank)
    cases = {
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": torch.randn(2 * F, H, generator=g),
        "decoder.layers.1.mlp.experts.linear_fc2.weight0": torch.randn(H, F, generator=g),
        "decoder.layers.1.mlp.router.weight": torch.randn(E, H, generator=g),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.randn(H, generator=g),
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": torch.randn(H, generator=g),
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.randn(H, generator=g),
        "decoder.layers.0.self_attention.q_layernorm.weight": torch.randn(D, generator=g),
        "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(H, Q * D, generator=g),
        "embedding.word_embeddings.weight": torch.randn(32, H, generator=g),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
        "output_layer.weight": torch.randn(32, H, generator=g),
    }
    from colocate.convert import globalize_name

    for name, t in cases.items():
        theirs = dict(conv.convert_param(name, t))
        ours = dict(megatron_to_hf(globalize_name(name, expert_offset=ep_rank * E // ep), t, spec=spec))
        assert theirs.keys() == ours.keys(), (name, sorted(theirs), sorted(ours))
        for n in ours:
            assert ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]), n


@pytest.mark.timeout(120)
def test_awex_megatron_engine_memory_hooks_drive_residency(cpu_megatron):
    """AWEX's writers call release_grad_memory / release|resume_memory_occupation (sometimes with
    a bare string); the wrapped engine maps them onto the trainer residency, idempotently."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import Qwen3Config

    from colocate import Residency
    from colocate.megatron import awex_megatron_engine, megatron_residency_hooks
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(1)
    m = build_tiny_gpt(TinyGPTConfig(num_layers=1))
    ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                 bf16=False, fp16=False), [ddp])
    res = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
    eng = awex_megatron_engine({"comm_backend": "file"}, Qwen3Config(), ddp, residency=res)
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    eng.release_grad_memory()
    eng.release_memory_occupation(tags=["optimizer"])
    eng.release_memory_occupation("weights")  # AWEX's nccl writer passes a string
    assert res.released == {"grads", "optimizer", "weights"}
    eng.release_memory_occupation()  # both again: no-op
    eng.resume_memory_occupation(tags=["weights"])
    assert res.released == {"grads", "optimizer"}
    assert all(torch.equal(p, before[n]) for n, p in ddp.named_parameters())
    eng.resume_memory_occupation()
    with pytest.raises(ValueError, match="'optimizer' or 'weights'"):
        eng.release_memory_occupation(["kv_cache"])


@pytest.mark.parametrize("train_tp", [1, 2])
def test_hybrid_layouts_match_awex_qwen3_5(train_tp):
    """AWEX 0.9.0's Qwen3.5 train-side layout helpers (inference TP = 1) against ours: gated QKV
    (its fused ``qkv_proj`` = our ``q_proj``; ``k_proj``; ``v_proj``), the GDN input (its fused
    SGLang ``qkvz``/``ba`` = our Qwen3.5 ``in_proj_qkv``+``z`` / ``b``+``a``), undoing the
    rank-local TP packing of ``in_proj`` and ``conv1d`` (= our :func:`merge_tp_sections`)."""
    from transformers import Qwen3_5TextConfig

    from colocate.convert import (
        Qwen3HybridSpec,
        gdn_in_proj_split,
        gdn_tp_sections,
        hf_gated_q_proj,
        merge_tp_sections,
        split_qkv_gated,
    )

    layout = pytest.importorskip("awex.models.qwen3_5")._Qwen3_5Layout
    nk, nv, dk, dv = 2, 4, 6, 5
    cfg = Qwen3_5TextConfig(hidden_size=H, num_attention_heads=Q, num_key_value_heads=G, head_dim=D,
                            linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                            linear_value_head_dim=dv, num_hidden_layers=1, layer_types=["linear_attention"])
    spec = Qwen3HybridSpec(arch="qwen3", num_layers=1, hidden_size=H, num_attention_heads=Q, num_query_groups=G,
                           head_dim=D, ffn_hidden_size=F, vocab_size=32, layer_types=["linear_attention"],
                           linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                           linear_value_head_dim=dv, gdn_layout="qwen3_5")
    g = torch.Generator().manual_seed(train_tp)
    qkv = torch.randn(G * (2 * Q // G + 2) * D, H, generator=g, dtype=torch.float64)
    q, gate, k, v = split_qkv_gated(qkv, num_heads=Q, num_groups=G, head_dim=D)
    ours = torch.cat([hf_gated_q_proj(q, gate, num_heads=Q, head_dim=D), k, v])
    assert torch.equal(layout.pack_output_gated_qkv(qkv, cfg, 1), ours)

    full = torch.randn(sum(gdn_tp_sections(spec, 1, which="in_proj")), H, generator=g, dtype=torch.float64)
    conv = torch.randn(sum(gdn_tp_sections(spec, 1, which="conv1d")), 1, 4, generator=g, dtype=torch.float64)
    shard = lambda t, which: [torch.cat([s.chunk(train_tp)[r] for s in torch.split(  # noqa: E731
        t, gdn_tp_sections(spec, 1, which=which))]) for r in range(train_tp)]
    packed_in, packed_conv = torch.cat(shard(full, "in_proj")), torch.cat(shard(conv, "conv1d"))
    merged = merge_tp_sections(shard(full, "in_proj"), gdn_tp_sections(spec, train_tp, which="in_proj"))
    assert torch.equal(torch.cat(layout.split_gdn_input(packed_in, cfg, train_tp)), merged)
    assert torch.equal(merged, full)
    qkv_hf, z, b, a = gdn_in_proj_split(merged, num_key_heads=nk, num_value_heads=nv, key_head_dim=dk,
                                        value_head_dim=dv)
    qkvz, ba = layout.pack_gdn_input(packed_in, cfg, train_tp, 1)
    assert torch.equal(qkvz, torch.cat([qkv_hf, z])) and torch.equal(ba, torch.cat([b, a]))
    assert torch.equal(layout.pack_gdn_conv(packed_conv, cfg, train_tp, 1),
                       merge_tp_sections(shard(conv, "conv1d"), gdn_tp_sections(spec, train_tp, which="conv1d")))
