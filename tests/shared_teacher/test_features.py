"""Teacher features and student batching against fp64 references, with the real tiny Megatron GPT."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from shared_teacher import CompatKey, MegatronTeacher, features_from_logits
from shared_teacher.features import fingerprint_state_dict
from shared_teacher.megatron import collate, topk_distill_loss
from shared_teacher.reference import teacher_features_reference, topk_distill_loss_reference


@pytest.mark.parametrize("lengths, vocab, top_k, chunk", [
    pytest.param([7, 1, 33], 31, 3, 5, id="L7,1,33-V31-k3-chunk5"),
    pytest.param([12], 123, 1, 1024, id="L12-V123-k1"),
    pytest.param([5, 9], 64, 8, 4, id="L5,9-V64-k8-chunk4"),
])
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_features_from_logits_match_fp64_reference(lengths, vocab, top_k, chunk, dtype, atol):
    g = torch.Generator().manual_seed(sum(lengths) + vocab)
    b, s = len(lengths), max(lengths)
    logits = (3 * torch.randn(b, s, vocab, generator=g, dtype=torch.float64)).to(dtype)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    out = features_from_logits(logits, tokens, lengths, signals=["logprobs", "topk"], top_k=top_k,
                               dtype=torch.float64, chunk=chunk)
    for i, n in enumerate(lengths):
        ref = teacher_features_reference(logits[i, :n].double(), tokens[i, :n], top_k=top_k)
        assert torch.equal(out[i]["tokens"], tokens[i, :n])
        assert_close(f"logprobs[{i}]", ref["logprobs"], out[i]["logprobs"], atol=atol)
        assert_close(f"topk_logprobs[{i}]", ref["topk_logprobs"], out[i]["topk_logprobs"], atol=atol)
        assert torch.equal(out[i]["topk_ids"], ref["topk_ids"]), i


@pytest.fixture
def tiny(cpu_megatron):
    seed_all(3)
    return build_tiny_gpt(TinyGPTConfig(vocab_size=128, hidden_size=64, num_layers=3, max_sequence_length=64))


def test_megatron_teacher_batched_equals_per_sequence_and_reference(tiny):
    key = CompatKey(teacher_fingerprint=fingerprint_state_dict(tiny.state_dict()), tokenizer="ids",
                    signals=["logprobs", "topk", "hidden"], top_k=5, hidden_taps=[0, 2], max_length=40)
    teacher = MegatronTeacher(tiny, key=key, chunk=7)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (13, 1, 40, 6)]
    batched = teacher(seqs)
    assert teacher.calls == 1 and teacher.sequences == 4
    for i, seq in enumerate(seqs):
        single = teacher([seq])[0]
        assert set(single) == {"tokens", "logprobs", "topk_logprobs", "topk_ids", "hidden.0", "hidden.2"}
        for name, t in single.items():
            if t.dtype.is_floating_point:  # right padding is exact up to fp32 matmul blocking
                assert_close(f"{name}[{i}]", t, batched[i][name], atol=2e-5, rtol=1e-5)
            else:
                assert torch.equal(t, batched[i][name]), (name, i)
        with torch.no_grad():
            logits = tiny(seq[None], torch.arange(seq.numel())[None], None)[0]
        ref = teacher_features_reference(logits.double(), seq, top_k=5)
        assert_close(f"logprobs-vs-ref[{i}]", ref["logprobs"], batched[i]["logprobs"], atol=3e-5)
        assert_close(f"topk-vs-ref[{i}]", ref["topk_logprobs"], batched[i]["topk_logprobs"], atol=3e-5)
    assert batched[2]["hidden.2"].shape == (40, 64) and batched[1]["logprobs"].shape == (0,)
    with pytest.raises(ValueError, match="exceeds key.max_length=40"):
        teacher([torch.zeros(41, dtype=torch.int64)])


def test_packed_and_unpacked_student_batches_agree(tiny):
    key = CompatKey(teacher_fingerprint="t", tokenizer="ids", signals=["topk"], top_k=4, max_length=32)
    g = torch.Generator().manual_seed(1)
    feats = MegatronTeacher(tiny, key=key)([torch.randint(0, 128, (n,), generator=g) for n in (9, 3, 14)])
    seed_all(9)
    student = build_tiny_gpt(TinyGPTConfig(vocab_size=128, hidden_size=32, num_layers=2, max_sequence_length=64))
    packed, unpacked = collate(feats, packed=True), collate(feats, packed=False)
    with torch.no_grad():
        lp = student(packed["tokens"], packed["position_ids"], packed["attention_mask"])
        lu = student(unpacked["tokens"], unpacked["position_ids"], None)
    offset = 0
    ref_total = torch.zeros((), dtype=torch.float64)
    for i, f in enumerate(feats):
        n = f["tokens"].numel()
        assert_close(f"packed-vs-unpacked logits[{i}]", lu[i, :n], lp[0, offset:offset + n], atol=2e-5)
        ref_total += topk_distill_loss_reference(lu[i, :n], f["topk_ids"], f["topk_logprobs"])
        offset += n
    for name, batch, logits in (("packed", packed, lp), ("unpacked", unpacked, lu)):
        total, count = topk_distill_loss(logits, batch)
        assert count.item() == 26
        assert_close(f"{name} loss", ref_total, total, atol=1e-4, rtol=1e-6)


def test_hf_export_loads_strictly_and_matches_logits(cpu_megatron):
    transformers = pytest.importorskip("transformers")
    from shared_teacher.megatron import export_hf_state_dict

    seed_all(5)
    cfg = TinyGPTConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=96, max_sequence_length=64)
    model = build_tiny_gpt(cfg)
    hf_cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
                                      attention_bias=False)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    missing = hf.load_state_dict(export_hf_state_dict(model), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(tokens, torch.arange(11).expand(2, 11), None)
        out = hf(input_ids=tokens).logits
    assert_close("hf-vs-megatron logits", ref, out, atol=1e-4, rtol=1e-4)
