"""Qwen3-Next / Qwen3.5 hybrid conversion (Gated DeltaNet + gated full attention).

Layouts are checked against transformers' own Qwen3-Next / Qwen3.5 code (its ``fix_query_key_value_ordering``
and gated ``q_proj`` split are the oracle), TP shard merging against Megatron's per-rank section
layout, and the whole converter by a logits round trip: a tiny hybrid Megatron GPT (harts'
local-module hybrid stack, ``attention_output_gate``, partial RoPE) → convert → strict
``load_state_dict`` into ``Qwen3NextForCausalLM`` and ``Qwen3_5ForCausalLM`` → logits equal."""

from __future__ import annotations

import pytest
import torch

from colocate.convert import (
    ConversionError,
    ParamMismatchError,
    Qwen3HybridSpec,
    check_params,
    gdn_in_proj_to_hf,
    gdn_tp_sections,
    hf_gated_q_proj,
    hf_param_specs,
    megatron_to_hf,
    merge_tp_sections,
    split_qkv_gated,
)
from colocate.errors import ConfigError

from ._hybrid_ranks import build_hybrid

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _hf_config(spec: Qwen3HybridSpec):
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.head_dim, hidden_act="silu",
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_embeddings, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.partial_rotary_factor},
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim, linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim, linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads, layer_types=list(spec.layer_types),
        max_position_embeddings=128)
    if spec.gdn_layout == "qwen3_5":
        return Qwen3_5TextConfig(**common)
    return Qwen3NextConfig(**common, num_experts=0, mlp_only_layers=list(range(spec.num_layers)))


def _spec(**kw):
    base = dict(arch="qwen3", num_layers=3, hidden_size=24, num_attention_heads=4, num_query_groups=2, head_dim=8,
                ffn_hidden_size=20, vocab_size=40, layer_types=["linear_attention", "linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
                linear_conv_kernel_dim=4, rope_theta=10000.0)
    base.update(kw)
    return Qwen3HybridSpec(**base)


@pytest.mark.parametrize("nk,nv,dk,dv,H", [(2, 4, 6, 5, 7), (3, 3, 4, 9, 5), (1, 4, 3, 2, 11)], ids=str)
def test_gdn_in_proj_layout_matches_hf_ordering(nk, nv, dk, dv, H):
    """Project with Megatron's in_proj and split Megatron's way; project with the converted HF
    weights and split with HF's own fix_query_key_value_ordering: q, k, v, z, β, α equal."""
    spec = _spec(hidden_size=H, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                 linear_value_head_dim=dv)
    layer = qwen3_next.Qwen3NextGatedDeltaNet(_hf_config(spec), 0).double()
    w = torch.randn(2 * nk * dk + 2 * nv * dv + 2 * nv, H, dtype=torch.float64)
    x = torch.eye(H, dtype=torch.float64)[None]  # one-hot rows: products are exact, so equality is bitwise
    qkvz, ba = gdn_in_proj_to_hf(w, num_key_heads=nk, num_value_heads=nv, key_head_dim=dk, value_head_dim=dv)
    theirs = layer.fix_query_key_value_ordering(x @ qkvz.T, x @ ba.T)
    q, k, v, z, b, a = torch.split(x @ w.T, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], dim=-1)
    ours = (q.reshape(1, H, nk, dk), k.reshape(1, H, nk, dk), v.reshape(1, H, nv, dv), z.reshape(1, H, nv, dv), b, a)
    for name, o, t in zip("qkvzba", ours, theirs):
        assert o.shape == t.shape and torch.equal(o, t), name
    with pytest.raises(ConversionError, match="expected 2·Nk·Dk"):
        gdn_in_proj_to_hf(w[1:], num_key_heads=nk, num_value_heads=nv, key_head_dim=dk, value_head_dim=dv)


def test_gated_qkv_split_matches_hf_attention_chunking():
    Q, G, D, H = 6, 2, 4, 9
    qkv = torch.randn(G * (2 * Q // G + 2) * D, H, dtype=torch.float64)
    q, gate, k, v = split_qkv_gated(qkv, num_heads=Q, num_groups=G, head_dim=D)
    # Megatron's own split of the projected tensor (attention.get_query_key_value_tensors)
    x = torch.eye(H, dtype=torch.float64)  # one-hot rows: exact products
    mixed = (x @ qkv.T).view(H, G, (2 * Q // G + 2) * D)
    mq, mg, mk, mv = torch.split(mixed, [Q // G * D, Q // G * D, D, D], dim=-1)
    # HF's split of the converted q_proj (Qwen3NextAttention.forward)
    hq, hg = torch.chunk((x @ hf_gated_q_proj(q, gate, num_heads=Q, head_dim=D).T).view(H, Q, 2 * D), 2, dim=-1)
    assert torch.equal(hq.reshape(H, -1), mq.reshape(H, -1)) and torch.equal(hg.reshape(H, -1), mg.reshape(H, -1))
    assert torch.equal(x @ k.T, mk.reshape(H, -1)) and torch.equal(x @ v.T, mv.reshape(H, -1))
    with pytest.raises(ConversionError, match="gated linear_qkv has"):
        split_qkv_gated(qkv[:-1], num_heads=Q, num_groups=G, head_dim=D)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_section_merge_inverts_megatron_sharding(tp):
    spec = _spec(linear_num_key_heads=4, linear_num_value_heads=8)
    full = torch.randn(sum(gdn_tp_sections(spec, 1, which="in_proj")), 3)
    conv = torch.randn(sum(gdn_tp_sections(spec, 1, which="conv1d")), 1, 4)
    for t, which in ((full, "in_proj"), (conv, "conv1d")):
        # Megatron rank r holds section i's r-th slice of each section, stacked (in_proj_split_sections)
        secs = torch.split(t, gdn_tp_sections(spec, 1, which=which), dim=0)
        shards = [torch.cat([s.chunk(tp, dim=0)[r] for s in secs], dim=0) for r in range(tp)]
        merged = merge_tp_sections(shards, gdn_tp_sections(spec, tp, which=which))
        assert torch.equal(merged, t)
        assert not torch.equal(torch.cat(shards, dim=0), t)  # plain column concat would be wrong
    with pytest.raises(ConversionError, match="shard rows"):
        merge_tp_sections([full[:-1]], gdn_tp_sections(spec, 1, which="in_proj"))


def test_spec_validation_and_layer_type_checks():
    with pytest.raises(ConfigError, match="layer_types must list 3"):
        _spec(layer_types=["full_attention"])
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads"):
        _spec(linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        _spec(partial_rotary_factor=0.0)
    with pytest.raises(ConfigError, match="gdn_layout must be"):
        _spec(gdn_layout="qwen4")
    spec = _spec()
    with pytest.raises(ConversionError, match=r"a linear_attention parameter, but layer_types\[2\]"):
        megatron_to_hf("decoder.layers.2.self_attention.A_log", torch.zeros(4), spec=spec)
    with pytest.raises(ConversionError, match=r"a full_attention parameter, but layer_types\[0\]"):
        megatron_to_hf("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(24, 32), spec=spec)
    with pytest.raises(ConversionError, match="has no q/k norm"):
        megatron_to_hf("decoder.layers.0.self_attention.q_layernorm.weight", torch.zeros(8), spec=spec)
    with pytest.raises(ConversionError, match="no HF Qwen3-Next mapping"):
        megatron_to_hf("decoder.layers.0.self_attention.mystery", torch.zeros(1), spec=spec)
    # zero-centered Megatron norms: decoder norms pass through, the GDN gated norm gets +1
    zc = _spec(megatron_zero_centered_gamma=True)
    w = torch.randn(5)
    assert torch.equal(megatron_to_hf("decoder.layers.0.self_attention.out_norm.weight", w, spec=zc)[0][1], w + 1)
    assert torch.equal(megatron_to_hf("decoder.layers.0.input_layernorm.weight", w, spec=zc)[0][1], w)
    assert torch.equal(megatron_to_hf("decoder.layers.0.input_layernorm.weight", w, spec=spec)[0][1], w - 1)


@pytest.mark.timeout(180)
def test_hybrid_megatron_to_hf_logits_roundtrip(cpu_megatron, monkeypatch):
    """Tiny hybrid (G G A G: GDN, GDN, gated attention, GDN), fp32 → HF ``Qwen3NextForCausalLM``
    and ``Qwen3_5ForCausalLM``, each loaded strictly (every HF parameter set, none left over):
    logits equal Megatron's.

    Tolerance 1e-5 (fp32; measured ~6e-8): both sides compute the same math, but the GDN
    recurrence differs in summation order (Megatron's CPU path is token-by-token, transformers'
    torch fallback the chunked form with a triangular solve), so bitwise equality is not expected."""
    from mcore_distill.testing import seed_all

    # transformers binds FLA's Triton kernels at import when fla is installed; on CPU use the
    # plain-torch functions those wrappers were built from (restored after the test).
    for mod in (qwen3_next, qwen3_5):
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            f = getattr(mod, fn)
            monkeypatch.setattr(mod, fn, getattr(f, "__wrapped__", f))
    seed_all(3)
    pattern, vocab = "GGAG", 40
    model = build_hybrid(pattern, vocab=vocab)
    with torch.no_grad():  # make norms, gates and decay parameters non-trivial
        g = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    tokens = torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        mg = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    assert mg.abs().max().item() > 0.1, "logits trivially small: the comparison would not discriminate"
    types = ["full_attention" if c == "A" else "linear_attention" for c in pattern]
    for layout, cls, proj in (("qwen3_next", qwen3_next.Qwen3NextForCausalLM, "in_proj_qkvz"),
                              ("qwen3_5", qwen3_5.Qwen3_5ForCausalLM, "in_proj_qkv")):
        spec = _spec(num_layers=len(pattern), layer_types=types, vocab_size=vocab, gdn_layout=layout)
        expected = hf_param_specs(spec, dtype=torch.float32)
        hf_weights = {}
        for name, p in model.named_parameters():
            for n, t in megatron_to_hf(name, p.detach(), spec=spec):
                assert n not in hf_weights, n
                hf_weights[n] = t
        check_params({n: (tuple(t.shape), t.dtype) for n, t in hf_weights.items()}, expected)
        ref = cls(_hf_config(spec)).float().eval()
        assert {n: tuple(t.shape) for n, t in ref.state_dict().items()} == {n: s for n, (s, _) in expected.items()}
        ref.load_state_dict(hf_weights, strict=True)
        with torch.no_grad():
            hf = ref(input_ids=tokens).logits
        assert mg.shape == hf.shape
        err = (mg - hf).abs().max().item()
        print(f"{layout} round trip: max |megatron − hf| = {err:.3e}, max |logit| = {mg.abs().max().item():.3f}")
        assert err <= 1e-5, f"{layout}: max |megatron − hf| = {err:.3e}"
        # a wrong layout must show: swap the halves of one GDN input projection, the logits move
        bad = dict(hf_weights)
        w = bad[f"model.layers.0.linear_attn.{proj}.weight"]
        bad[f"model.layers.0.linear_attn.{proj}.weight"] = torch.cat([w[w.shape[0] // 2:], w[:w.shape[0] // 2]])
        ref.load_state_dict(bad, strict=True)
        with torch.no_grad():
            assert (ref(input_ids=tokens).logits - mg).abs().max().item() > 1e-3, layout
    with pytest.raises(ParamMismatchError, match="in_proj_z"):
        check_params({n: v for n, v in expected.items() if "in_proj_z" not in n}, expected)


def test_moe_hybrid_names_and_shapes_match_hf_model():
    """MoE hybrid (routed experts + gated shared expert): every non-expert HF name and shape equals
    the transformers model's; per-expert checkpoint tensors stack to its fused expert tensors."""
    from transformers import Qwen3NextConfig

    spec = _spec(arch="qwen3_moe", num_experts=4, moe_ffn_hidden_size=6, shared_expert_ffn_hidden_size=10)
    cfg = Qwen3NextConfig(**{**_hf_config(spec).to_dict(), "num_experts": 4, "moe_intermediate_size": 6,
                             "shared_expert_intermediate_size": 10, "mlp_only_layers": [], "decoder_sparse_step": 1,
                             "num_experts_per_tok": 2})
    sd = {n: tuple(t.shape) for n, t in qwen3_next.Qwen3NextForCausalLM(cfg).state_dict().items()}
    ours = {n: s for n, (s, _) in hf_param_specs(spec, dtype=torch.float32).items()}
    plain = {n: s for n, s in ours.items() if ".mlp.experts." not in n}
    assert plain == {n: s for n, s in sd.items() if ".mlp.experts." not in n}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = (4, ours[p + "0.gate_proj.weight"][0] + ours[p + "0.up_proj.weight"][0], 24)
        assert sd[p + "gate_up_proj"] == gate_up and sd[p + "down_proj"] == (4, *ours[p + "0.down_proj.weight"])
    fc1 = torch.randn(20, 24)
    out = dict(megatron_to_hf("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", fc1, spec=spec))
    assert torch.equal(out["model.layers.1.mlp.shared_expert.gate_proj.weight"], fc1[:10])
    assert torch.equal(out["model.layers.1.mlp.shared_expert.up_proj.weight"], fc1[10:])
    gw = torch.randn(1, 24)
    assert megatron_to_hf("decoder.layers.1.mlp.shared_experts.gate_weight", gw, spec=spec)[0][0] == \
        "model.layers.1.mlp.shared_expert_gate.weight"
    r = megatron_to_hf("decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight", torch.zeros(24, 6), spec=spec)
    assert r[0][0] == "model.layers.2.mlp.experts.3.down_proj.weight"


def test_hybrid_spec_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(_spec()), OmegaConf.from_dotlist(["gdn_layout=qwen3_5"]))
    spec = OmegaConf.to_object(cfg)
    assert isinstance(spec, Qwen3HybridSpec) and spec.gdn_layout == "qwen3_5" and spec.layer_types[2] == "full_attention"
    with pytest.raises(ConfigError, match="gdn_layout must be"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(_spec()), {"gdn_layout": "mamba"}))
