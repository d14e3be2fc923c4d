"""Rank body for the hybrid TP=2 conversion test (module level for spawn) and the tiny hybrid
Megatron builder shared with the single-process tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2,
           linear_num_value_heads=4)


def build_hybrid(pattern: str, *, vocab: int, tp: int = 1):
    """Tiny hybrid GPT (harts' local-module GDN + gated-attention stack, partial RoPE), fp32."""
    from megatron.core.models.gpt import GPTModel

    from harts.gdn_megatron import hybrid_block_spec
    from mcore_distill.testing import TinyGPTConfig, transformer_config

    cfg = TinyGPTConfig(vocab_size=vocab, params_dtype=torch.float32, num_layers=len(pattern), hidden_size=24,
                        num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=20,
                        tensor_model_parallel_size=tp, extra=dict(GDN, attention_output_gate=True))
    return GPTModel(config=transformer_config(cfg), transformer_layer_spec=hybrid_block_spec(pattern),
                    vocab_size=vocab, max_sequence_length=128, position_embedding_type="rope", rotary_percent=0.25,
                    share_embeddings_and_output_weights=False).eval()


def hybrid_tp_roundtrip(rank: int, world_size: int, layout: str) -> dict:
    """Hybrid at TP=2 on gloo: every parameter gathered (GDN in_proj / conv1d merged section by
    section via merge_named_tp_shards), converted, loaded strictly into the HF model; logits
    compared with Megatron's (vocab-parallel output gathered)."""
    from colocate.convert import Qwen3HybridSpec, megatron_to_hf, merge_named_tp_shards
    from mcore_distill.testing import destroy_megatron, init_megatron, seed_all

    init_megatron(tp=world_size, seed=3)
    seed_all(3)
    pattern, vocab = "GAG", 40
    model = build_hybrid(pattern, vocab=vocab, tp=world_size)
    with torch.no_grad():  # per-rank A_log / dt_bias shards differ; norms are replicated
        g = torch.Generator().manual_seed(11 + rank)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(11)))
            elif n.endswith(("A_log", "dt_bias")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    spec = Qwen3HybridSpec(arch="qwen3", num_layers=3, hidden_size=24, num_attention_heads=4, num_query_groups=2,
                           head_dim=8, ffn_hidden_size=20, vocab_size=vocab, rope_theta=10000.0,
                           layer_types=["full_attention" if c == "A" else "linear_attention" for c in pattern],
                           gdn_layout=layout, **GDN)
    hf = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(world_size)]
            dist.all_gather(parts, p.detach().contiguous())
            kind = "glu" if name.endswith("linear_fc1.weight") else "col" if getattr(p, "partition_dim", 0) == 0 else "row"
        else:
            parts, kind = [p.detach()], "replicated"
        for n, t in megatron_to_hf(name, merge_named_tp_shards(name, parts, kind=kind, spec=spec), spec=spec):
            hf[n] = t
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        parts = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(parts, out.contiguous())
        mg = torch.cat(parts, dim=-1)
    result = {"names": len(hf)}
    if rank == 0:
        from transformers import Qwen3_5TextConfig, Qwen3NextConfig
        from transformers.models.qwen3_5 import modeling_qwen3_5
        from transformers.models.qwen3_next import modeling_qwen3_next

        mod, cfg_cls, cls = ((modeling_qwen3_5, Qwen3_5TextConfig, "Qwen3_5ForCausalLM") if layout == "qwen3_5"
                             else (modeling_qwen3_next, Qwen3NextConfig, "Qwen3NextForCausalLM"))
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            f = getattr(mod, fn)
            setattr(mod, fn, getattr(f, "__wrapped__", f))  # spawned process: no restore needed
        extra = {} if layout == "qwen3_5" else {"num_experts": 0, "mlp_only_layers": [0, 1, 2]}
        cfg = cfg_cls(vocab_size=vocab, hidden_size=24, intermediate_size=20, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu", rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attention_bias=False, layer_types=list(spec.layer_types),
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                      max_position_embeddings=128, **GDN, **extra)
        ref = getattr(mod, cls)(cfg).float().eval()
        ref.load_state_dict(hf, strict=True)
        with torch.no_grad():
            result["max_abs"] = (ref(input_ids=tokens).logits - mg).abs().max().item()
        result["scale"] = mg.abs().max().item()
    destroy_megatron()
    return result


def dense_moe_and_hybrid(rank: int, world_size: int, cases: list[dict]):
    """The Qwen3 dense/MoE round trips and the hybrid TP round trip in one spawned run."""
    from ._ranks import convert_and_publish

    return convert_and_publish(rank, world_size, cases), hybrid_tp_roundtrip(rank, world_size, "qwen3_5")
