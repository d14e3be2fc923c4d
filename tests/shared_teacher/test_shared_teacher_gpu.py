"""GPU lane: the Megatron teacher on CUDA (fp32 and bf16) against fp64 references, and the shared
store fed from CUDA features. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from shared_teacher import CompatKey, MegatronTeacher, ShmStore
from shared_teacher.reference import teacher_features_reference

pytestmark = pytest.mark.gpu


def _key(dtype: str) -> CompatKey:
    return CompatKey(teacher_fingerprint="gpu", tokenizer="ids", signals=["logprobs", "topk", "hidden"], top_k=16,
                     hidden_taps=[0, 3], dtype=dtype, max_length=256)


def test_cuda_teacher_batched_equals_per_sequence_and_fp64_reference(cpu_megatron):
    seed_all(0)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_attention_heads=8,
                                         ffn_hidden_size=512, max_sequence_length=256)).cuda()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1024, (n,), generator=g) for n in (255, 17, 128, 1)]
    teacher = MegatronTeacher(model, key=_key("float32"), chunk=64)
    batched = teacher(seqs)
    for i, seq in enumerate(seqs):
        single = teacher([seq])[0]
        for name, t in single.items():
            if t.dtype.is_floating_point:  # right padding is exact up to fp32 GEMM tiling
                assert_close(f"{name}[{i}]", t, batched[i][name], atol=1e-4, rtol=1e-4)
            elif name == "tokens":
                assert torch.equal(t, batched[i][name])
            else:  # near-tied top-k entries may swap under different tiling
                assert (t == batched[i][name]).double().mean().item() > 0.99, (name, i)
        with torch.no_grad():
            logits = model(seq[None].cuda(), torch.arange(seq.numel(), device="cuda")[None], None)[0]
        ref = teacher_features_reference(logits.double().cpu(), seq, top_k=16)
        assert_close(f"logprobs-vs-ref[{i}]", ref["logprobs"], single["logprobs"], atol=2e-5, rtol=1e-6)
        assert_close(f"topk-vs-ref[{i}]", ref["topk_logprobs"], single["topk_logprobs"], atol=2e-5, rtol=1e-6)


def test_bf16_teacher_features_match_fp64_reference_of_its_own_logits(cpu_megatron):
    from megatron.core.transformer.module import Float16Module

    seed_all(1)
    cfg = TinyGPTConfig(vocab_size=4096, hidden_size=256, num_layers=4, num_attention_heads=8, ffn_hidden_size=512,
                        max_sequence_length=256, params_dtype=torch.bfloat16)
    model = build_tiny_gpt(cfg)
    model = Float16Module(model.config, model.cuda())
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 4096, (n,), generator=g) for n in (200, 33)]
    teacher = MegatronTeacher(model, key=_key("float32"))
    feats = teacher(seqs)
    # the same padded batch the teacher runs, so both sides reduce identical bf16-model logits
    tokens = torch.zeros(2, 200, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        tokens[i, : seq.numel()] = seq
    with torch.no_grad():
        logits = model(tokens.cuda(), torch.arange(200, device="cuda").expand(2, 200), None)
    store = ShmStore()
    try:
        for i, seq in enumerate(seqs):
            n = seq.numel()
            ref = teacher_features_reference(logits[i, :n].double().cpu(), seq, top_k=16)
            assert_close(f"logprobs[{i}]", ref["logprobs"], feats[i]["logprobs"], atol=2e-5, rtol=1e-6)
            assert_close(f"topk[{i}]", ref["topk_logprobs"], feats[i]["topk_logprobs"], atol=2e-5, rtol=1e-6)
            ref_obj = store.put(feats[i], sample_id=f"e0-i{i}", generation=1, node="n0", num_tokens=n,
                                schema_key="gpu", epoch=0, position=i)
            back = store.get(ref_obj)
            for name, t in feats[i].items():
                assert torch.equal(back[name], t), name
    finally:
        store.close(remove=True)
