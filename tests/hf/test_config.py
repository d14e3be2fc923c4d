"""Reading HF ``config.json`` (transformers 4.x and 5.x spellings) into the Megatron config,
writing it back, and RoPE scaling checked against transformers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore_distill.hf import (
    ConfigMismatchError,
    UnsupportedConfigError,
    hf_arch,
    hf_config_dict,
    pad_vocab_size,
    transformer_config_from_hf,
)

from .models import KINDS, VOCAB, hf_config, hf_logits, hf_model

# Qwen3-0.6B's published config.json (transformers 4.51 spelling), shapes only
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_0_6b_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    cfg = transformer_config_from_hf(tmp_path)
    c = cfg.config
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.ffn_hidden_size) == (28, 1024, 16, 8, 128, 3072)
    assert c.qk_layernorm and c.gated_linear_unit and c.normalization == "RMSNorm" and not c.add_bias_linear
    assert c.params_dtype == torch.bfloat16 and c.bf16 and c.num_moe_experts is None
    assert cfg.padded_vocab_size == 151936 and cfg.layer_pattern is None
    assert cfg.gpt_kwargs["rotary_base"] == 1e6 and cfg.gpt_kwargs["share_embeddings_and_output_weights"]
    assert cfg.gpt_kwargs["max_sequence_length"] == 40960 and cfg.gpt_kwargs["seq_len_interpolation_factor"] is None
    fp32 = transformer_config_from_hf(tmp_path, params_dtype=torch.float32, sequence_parallel=False)
    assert fp32.config.params_dtype == torch.float32 and not fp32.config.bf16
    with pytest.raises(ConfigMismatchError, match=r"\['num_layers'\] are fixed by config.json"):
        transformer_config_from_hf(tmp_path, num_layers=2)
    with pytest.raises(UnsupportedConfigError, match=r"\['num_layerz'\] are not TransformerConfig fields"):
        transformer_config_from_hf(tmp_path, num_layerz=2)


def test_megatron_vocab_padding():
    assert pad_vocab_size(151936) == 151936
    assert pad_vocab_size(151936, tp=2) == 152064  # multiple of 128·2
    assert pad_vocab_size(50, divisible_by=128, tp=4) == 512


def test_moe_and_hybrid_fields(tmp_path):
    hf_config("next-moe").save_pretrained(tmp_path)
    cfg = transformer_config_from_hf(tmp_path)
    c = cfg.config
    assert (c.num_moe_experts, c.moe_ffn_hidden_size, c.moe_router_topk) == (4, 8, 2)
    assert not c.moe_router_pre_softmax  # norm_topk_prob=True: softmax over the top-k
    assert c.moe_shared_expert_intermediate_size == 12 and c.moe_shared_expert_gate
    assert c.experimental_attention_variant == "gated_delta_net" and c.attention_output_gate
    assert c.linear_attention_freq == [1, 1, 0, 1] and cfg.layer_pattern == "GGAG"
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (2, 4, 6, 5, 4)
    assert cfg.gpt_kwargs["rotary_percent"] == 0.25 and not c.layernorm_zero_centered_gamma


@pytest.mark.parametrize("kind", KINDS)
def test_written_config_reads_back_and_loads_in_transformers(kind):
    from transformers import AutoConfig

    arch = hf_arch(hf_config(kind).to_dict())
    written = hf_config_dict(arch, dtype=torch.bfloat16)
    assert hf_arch(written) == dataclasses.replace(arch, dtype="bfloat16")
    theirs = AutoConfig.for_model(**{k: v for k, v in written.items() if k != "model_type"}, model_type=arch.model_type)
    ours = hf_config(kind)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                "tie_word_embeddings", "num_experts", "moe_intermediate_size", "layer_types", "linear_num_value_heads"):
        assert getattr(theirs, key, None) == getattr(ours, key, None), key
    assert theirs.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"]
    assert theirs.rope_parameters.get("partial_rotary_factor") == ours.rope_parameters.get("partial_rotary_factor")


def test_transformers_4x_spellings():
    """Older configs: rope_theta / rope_scaling / partial_rotary_factor at the top level,
    ``full_attention_interval`` instead of ``layer_types``, ``torch_dtype``."""
    new = hf_arch(hf_config("next-moe").to_dict())
    old = {k: v for k, v in hf_config("next-moe").to_dict().items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=0.25, full_attention_interval=3,
               num_hidden_layers=6, torch_dtype="float32")
    arch = hf_arch(old)
    assert arch.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert dataclasses.replace(arch, num_layers=4, layer_types=new.layer_types, dtype=None) == new


def test_unsupported_fields_are_named():
    base = hf_config("moe").to_dict()
    for edit, match in [({"mlp_only_layers": [1]}, "mlp_only_layers/decoder_sparse_step"),
                        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
                         r"rope_scaling\.rope_type='llama3'"),
                        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
                        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
                        ({"attention_bias": True}, "attention_bias=True"),
                        ({"layer_types": ["sliding_attention"] * 4}, "layer_types=")]:
        with pytest.raises(UnsupportedConfigError, match=match):
            hf_arch({**base, **edit})
    assert hf_arch({**base, "mystery": 1}, ignore_fields=("mystery",)).num_experts == 4
    hybrid = hf_config("qwen3.5").to_dict()
    with pytest.raises(UnsupportedConfigError, match="must list 4 of"):
        hf_arch({**hybrid, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(UnsupportedConfigError, match=r"model_type='qwen3_5_moe_text'"):
        hf_arch({**hybrid, "model_type": "qwen3_5_moe_text"})


@pytest.mark.timeout(120)
def test_linear_rope_scaling_matches_transformers(cpu_megatron, tmp_path):
    """``rope_type="linear"`` becomes Megatron's ``seq_len_interpolation_factor``: same logits."""
    from mcore_distill.hf import megatron_model_from_hf

    hf = hf_model("dense")
    hf.config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    hf.load_state_dict(hf_model("dense").state_dict())
    hf.save_pretrained(tmp_path)
    assert hf_arch(tmp_path).rope_linear_factor == 4.0
    model = megatron_model_from_hf(tmp_path)[0].eval()
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens, torch.arange(40)[None], None)[..., :VOCAB]
    ref = hf_logits(hf, tokens)
    plain = hf_logits(hf_model("dense"), tokens)
    assert (ours - ref).abs().max().item() <= 1e-5 < (plain - ref).abs().max().item()
