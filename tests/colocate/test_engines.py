"""Embedded transformers engine: sampling with logprobs against a plain recomputation,
determinism by seed, greedy, top-k, and the residency / update surface."""

from __future__ import annotations

import pytest
import torch

from colocate import EngineConfig, HFModelSpec, NotResidentError, PublishConfig
from colocate.engines import HFEngine, UpdateError, WeightReceiver, hf_checkpoint_views
from colocate.publish import Publisher, PublishError
from colocate.residency import BusyError

SPEC = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)


def _recompute_logprobs(engine, prompt, tokens, temperature):
    """Log-probabilities of ``tokens`` after ``prompt`` from one full, unpadded forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = engine.logits(ids)[0, len(prompt) - 1: -1]
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    e = HFEngine(SPEC, EngineConfig(max_new_tokens=6, temperature=1.0))
    with torch.no_grad():
        for v in hf_checkpoint_views(e.model).values():
            v.normal_(0, 0.3)  # a peaked distribution so sampling is not uniform noise
    return e


def test_protocol_and_capabilities(engine):
    assert isinstance(engine, WeightReceiver)
    assert engine.capabilities() == {"inprocess", "shm", "disk"}


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["T1", "T0.7", "greedy"])
def test_batched_sampling_logprobs_match_full_forward(engine, temperature):
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]  # ragged: left padding in the batch
    out = engine.generate(prompts, temperature=temperature, seed=5)
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        assert len(toks) == 6
        ref = _recompute_logprobs(engine, p, toks, temperature)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float32), ref, atol=1e-5, rtol=0), (lps, ref)
    if temperature == 0:
        for p, toks in zip(prompts, out.tokens):
            ids = list(p)
            for t in toks:  # greedy equals step-by-step argmax of the full forward
                assert t == int(engine.logits(torch.tensor([ids]))[0, -1].argmax())
                ids.append(t)


def test_seeds_are_deterministic_and_per_sequence(engine):
    a = engine.generate([[1, 2], [3, 4, 5]], seed=11)
    b = engine.generate([[1, 2], [3, 4, 5]], seed=11)
    c = engine.generate([[1, 2], [3, 4, 5]], seed=12)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    alone = engine.generate([[1, 2]], seed=11)  # sequence 0 does not depend on the others
    assert alone.tokens[0] == a.tokens[0]


def test_top_k_restricts_support(engine):
    prompt = [4, 5, 6]
    out = engine.generate([prompt] * 4, temperature=1.0, top_k=1, seed=0, max_new_tokens=3)
    greedy = engine.generate([prompt], temperature=0.0, max_new_tokens=3)
    assert all(t == greedy.tokens[0] for t in out.tokens)
    assert all(abs(lp) < 1e-6 for lps in out.logprobs for lp in lps)  # only one token left: log 1
    with pytest.raises(ValueError, match="prompt needs >= 1 token"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate([[1]], temperature=-1.0)


def test_residency_cycle_and_republish():
    torch.manual_seed(1)
    e = HFEngine(SPEC)
    pub = Publisher(e, PublishConfig(bucket_bytes=32 << 10))
    w = {n: v.detach().clone() for n, v in hf_checkpoint_views(e.model).items()}
    pub.publish(w, version=1)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = e.logits(ids)
    freed = e.release_memory(["kv_cache", "weights", "cuda_graph"])
    assert freed["weights"] == 2 * sum(t.numel() * 4 for t in w.values())  # live weights + staging shadow
    assert e.release_memory() == {}
    with pytest.raises(NotResidentError):
        e.generate([[1]])
    with pytest.raises(PublishError) as ei:
        pub.publish(w, version=2)  # cannot stage into released weights
    assert isinstance(ei.value.cause, NotResidentError) and ei.value.phase == "begin"
    e.resume_memory(["weights"])
    with pytest.raises(NotResidentError, match=r"needs \['kv_cache', 'cuda_graph'\]"):
        e.logits(ids)
    e.resume_memory()
    with pytest.raises(NotResidentError, match="not re-published"):
        e.logits(ids)
    pub.publish(w, version=3)
    assert torch.equal(e.logits(ids), before)
    # release is refused while the engine is busy
    with e.residency.busy(), pytest.raises(BusyError):
        e.release_memory(["kv_cache"])


def test_rollback_and_update_bracket_errors():
    e = HFEngine(SPEC)
    with pytest.raises(UpdateError, match="load without begin_update"):
        e.load_tensors([])
    with pytest.raises(UpdateError, match="end_update\\(3\\) without a matching"):
        e.end_update(3)
    w0 = e.checksums()
    e.begin_update(1)
    e.load_tensors([("model.norm.weight", torch.full((32,), 2.0))])
    e.end_update(1)
    assert e.weight_version() == 1 and e.checksums() != w0
    e.rollback()
    assert e.checksums() == w0 and e.weight_version() is None
