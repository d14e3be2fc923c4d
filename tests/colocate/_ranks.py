"""Rank bodies for the colocate multi-rank tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, destroy_megatron, init_megatron


def _megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out = model(tokens, pos, None)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def convert_roundtrip(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case build the tiny Megatron Qwen3 at (tp, ep), gather + convert to HF, load
    into a config-built ``transformers`` model and compare logits with Megatron's."""
    from colocate.convert import check_params, hf_param_specs
    from colocate.engines import build_hf_model, hf_checkpoint_views
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron

    results = []
    for case in cases:
        init_megatron(tp=case["tp"], ep=case.get("ep", 1), seed=case.get("seed", 7))
        cfg = TinyGPTConfig(tensor_model_parallel_size=case["tp"], num_moe_experts=case.get("experts"),
                            tie_embeddings=case.get("tied", False), num_layers=2, hidden_size=48,
                            num_attention_heads=6, num_query_groups=2, kv_channels=10, ffn_hidden_size=40,
                            vocab_size=96, extra=case.get("extra", {}))
        model = build_tiny_gpt(cfg).eval()
        # Make norms non-trivial so a norm mapped to the wrong place cannot pass.
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for n, p in model.named_parameters():
                if "layernorm" in n or n.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        spec = model_spec_from_megatron(model)
        hf = dict(iter_hf_weights([model], spec=spec))
        check_params({n: (tuple(t.shape), t.dtype) for n, t in hf.items()}, hf_param_specs(spec, dtype=torch.float32))
        tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
        ref = _megatron_logits(model, tokens)
        ref_model = build_hf_model(spec, dtype=torch.float32)
        views = hf_checkpoint_views(ref_model)
        check_params({n: (tuple(t.shape), t.dtype) for n, t in hf.items()},
                     {n: (tuple(v.shape), v.dtype) for n, v in views.items()})
        with torch.no_grad():
            for n, t in hf.items():
                views[n].copy_(t)
            out = ref_model(input_ids=tokens).logits
        results.append({"case": case["id"], "max_abs": (out - ref).abs().max().item(),
                        "ref_scale": ref.abs().max().item(), "names": sorted(hf),
                        "logits_equal_shape": tuple(out.shape) == tuple(ref.shape)})
        destroy_megatron()
    return results
