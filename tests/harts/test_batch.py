"""[B, L] rows ↔ tree micro-batches (harts.batch) and the one-call scorer harts.megatron.tree_logprobs:
the label layout, padding rows, several micro-batches with the THD fallback, a hybrid (Gated DeltaNet)
model without GDN-specific calls, gradients, and typed errors. Oracles run in fp64 on CPU."""

from __future__ import annotations

import pytest
import torch

from harts import AttentionBackend, PlannerConfig, plan_tree_batch
from harts.batch import TreeBatch
from mcore_distill.errors import ConfigTypeError
from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all

VOCAB = 61


def _rows():
    """Five right-padded rows (pad id 0): two groups sharing prompts, a duplicate, a loner."""
    seqs = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [5, 6, 7, 13], [20, 21, 22], [5, 6, 7, 8, 9]]
    width = max(map(len, seqs)) + 1  # one all-padding column too
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    return seqs, ids, torch.tensor([len(s) for s in seqs])


def test_rows_round_trip_in_label_layout():
    """Each position's value lands at [row, t] for t < lengths − 1; everything else is 0."""
    seqs, ids, lengths = _rows()
    batch = plan_tree_batch(ids, lengths, config=PlannerConfig(token_cap=8, align=1, fallback_compression=1.05))
    assert isinstance(batch, TreeBatch) and len(batch.microbatches) > 1  # the cap splits the rows
    assert batch.shape == tuple(ids.shape) and batch.compression > 1.0
    per_mb = []
    for mb in batch.microbatches:
        # node value = its own token id: the "log-prob" of position t is then the token at t + 1
        per_mb.append(mb.logprob_rows(mb.forest.tokens.double()))
        assert per_mb[-1].shape == (mb.rows.numel(), ids.shape[1])
    out = batch.gather(per_mb)
    want = torch.zeros(ids.shape, dtype=torch.float64)
    for r, s in enumerate(seqs):
        want[r, : len(s) - 1] = torch.tensor(s[1:], dtype=torch.float64)
    assert torch.equal(out, want)
    padded = batch.padded(16)
    assert all(mb.forest.num_nodes == 16 for mb in padded.microbatches)
    assert torch.equal(padded.gather([mb.logprob_rows(mb.forest.tokens.double()) for mb in padded.microbatches]),
                       want)
    with pytest.raises(ValueError, match="smaller than a micro-batch"):
        batch.padded(2)


def test_bad_input_is_named():
    _, ids, lengths = _rows()
    with pytest.raises(ConfigTypeError, match="input_ids must be a Tensor"):
        plan_tree_batch(ids.tolist())
    with pytest.raises(ValueError, match="integer \\[B, L\\]"):
        plan_tree_batch(ids.float())
    with pytest.raises(ValueError, match="lengths must be \\[B\\]=5"):
        plan_tree_batch(ids, lengths[:3])
    with pytest.raises(ConfigTypeError, match="config must be a harts.PlannerConfig, got dict"):
        plan_tree_batch(ids, lengths, config={"token_cap": 8})
    with pytest.raises(ValueError, match="dp_size must be 1"):
        plan_tree_batch(ids, lengths, config=PlannerConfig(dp_size=2))


def test_attention_backend_is_one_enum():
    from harts.config import HartsConfigError, HeadConfig
    from mopd.config import TeacherTreeConfig

    assert [b.value for b in AttentionBackend] == ["flex", "varlen", "dense"]
    assert AttentionBackend("varlen") == "varlen" and f"{AttentionBackend.dense}" == "dense"
    assert HeadConfig(backend=AttentionBackend.varlen).backend == "varlen"
    with pytest.raises(HartsConfigError, match=r"HeadConfig.backend must be one of \['flex', 'varlen', 'dense'\]"):
        HeadConfig(backend="sdpa")
    with pytest.raises(ValueError, match=r"teacher_tree.backend must be one of \['flex', 'varlen', 'dense'\]"):
        TeacherTreeConfig(backend="sdpa")


def _per_row(model, ids, lengths):
    """Label-layout [B, L] log-probs and entropies, one unpacked row at a time (the oracle)."""
    lp = torch.zeros(ids.shape, dtype=torch.float64)
    ent = torch.zeros(ids.shape, dtype=torch.float64)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        t = ids[r, :n]
        logits = model(t[None], torch.arange(n)[None], None, runtime_gather_output=True)[0]
        logp = torch.log_softmax(logits.double(), -1)[:-1]
        lp[r, : n - 1] = logp.gather(-1, t[1:, None])[:, 0]
        ent[r, : n - 1] = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planner", [None, PlannerConfig(token_cap=8, align=4, fallback_compression=1.2)],
                         ids=["one-microbatch", "capped-with-fallback"])
def test_tree_logprobs_equals_per_row_fp64(cpu_megatron, planner):
    from harts.megatron import tree_logprobs

    seqs, ids, lengths = _rows()
    seed_all(3)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64)).double()
    res = tree_logprobs(model, ids, lengths, backend="dense", planner=planner, chunk_size=3,
                        entropy_requires_grad=True)
    if planner is not None:
        assert {mb.mode for mb in res.batch.microbatches} == {"tree", "thd"}
    (res.logp.sum() + 0.1 * res.entropy.sum()).backward()
    g_tree = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    lp, ent = _per_row(model, ids, lengths)
    (lp.sum() + 0.1 * ent.sum()).backward()
    assert_close("logp", lp, res.logp, atol=1e-10, rtol=1e-10)
    assert_close("entropy", ent, res.entropy, atol=1e-10, rtol=1e-10)
    for n, p in model.named_parameters():
        assert p.grad.abs().max() > 0
        assert_close(f"grad {n}", p.grad, g_tree[n], atol=1e-10, rtol=1e-10)
    # the same through Megatron's forward-only schedule (what mopd's tree teacher runs)
    sched = tree_logprobs(model, ids, lengths, backend="dense", planner=planner, chunk_size=3, forward_only=True)
    assert not sched.logp.requires_grad
    assert_close("scheduled logp", lp, sched.logp, atol=1e-10, rtol=1e-10)
    assert_close("scheduled entropy", ent, sched.entropy, atol=1e-10, rtol=1e-10)


@pytest.mark.timeout(120)
def test_tree_logprobs_on_a_hybrid_model_needs_no_gdn_call(cpu_megatron):
    """A Gated DeltaNet + attention model built from Megatron's own GatedDeltaNet class: apply_harts
    swaps it, make_tree_params picks the GDN plan (fp64 states for fp64 layers)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from harts.gdn_megatron import GdnTreeParams, TreeGatedDeltaNet
    from harts.megatron import apply_harts, make_tree_params, tree_logprobs
    from tests.harts.test_gdn import build_hybrid

    seqs, ids, lengths = _rows()
    seed_all(5)
    model = build_hybrid("GA", dtype=torch.float64)
    mixer = model.decoder.layers[0].self_attention
    mixer.__class__ = GatedDeltaNet  # as built from Megatron's own spec
    handle = apply_harts(model)
    assert type(mixer) is TreeGatedDeltaNet
    forest = plan_tree_batch(ids, lengths).microbatches[0].forest
    assert isinstance(make_tree_params(forest, backend="dense", model=model), GdnTreeParams)
    assert not isinstance(make_tree_params(forest, backend="dense"), GdnTreeParams)
    res = tree_logprobs(model, ids, lengths, backend="dense")
    lps = torch.zeros(ids.shape, dtype=torch.float64)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        t = ids[r, :n]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]
        logits = model(t[None], torch.arange(n)[None], causal, runtime_gather_output=True)[0]
        lps[r, : n - 1] = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, t[1:, None])[:, 0]
    assert_close("logp", lps, res.logp.detach(), atol=1e-9, rtol=1e-9)
    handle.remove()
    assert type(mixer) is GatedDeltaNet


def test_tree_logprobs_refuses_a_non_megatron_model(cpu_megatron):
    from harts.megatron import tree_logprobs

    with pytest.raises(ConfigTypeError, match="model must be \\(or wrap\\) a Megatron GPTModel, got Linear"):
        tree_logprobs(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.int64))


def test_real_vocab_rows_cut_the_padding_of_a_shard(monkeypatch):
    """``HeadConfig.vocab_size`` and the row cut the tree head applies to a padded output layer
    (the values: tests/mopd/test_hf_teacher.py and the TP=2 case of test_megatron_multirank.py)."""
    import torch.distributed as dist

    from harts.config import HartsConfigError, HeadConfig
    from harts.errors import TreeIncompatibleError
    from harts.megatron import real_vocab_rows

    w = torch.randn(64, 8)
    cut, start = real_vocab_rows(w, 40)
    assert start == 0 and cut.shape == (40, 8) and cut.data_ptr() == w.data_ptr()  # a view: gradients reach w
    assert real_vocab_rows(w, 64)[0] is w and real_vocab_rows(w, None)[0] is w
    assert HeadConfig(vocab_size=40).vocab_size == 40
    with pytest.raises(HartsConfigError, match="HeadConfig.vocab_size must be >= 1 or None, got 0"):
        HeadConfig(vocab_size=0)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # rank 1 of a TP group: shard [64, 128)
    group = object()
    cut, start = real_vocab_rows(w, 100, group)
    assert start == 64 and cut.shape == (36, 8)
    with pytest.raises(TreeIncompatibleError, match=r"vocab_size=50: .*rows \[64, 128\) are all padding"):
        real_vocab_rows(w, 50, group)
