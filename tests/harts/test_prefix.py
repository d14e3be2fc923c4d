"""Shared-prefix groups (a tree larger than the cap, its prefix run once across microbatches):
the planner's groups, the varlen context plan, and the real tiny Megatron GPT through
``tree_shared_step`` against per-sequence execution in fp64 (values and every gradient, 1e-10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.config import PlannerConfig
from harts.forest import build_forest
from harts.loss import aggregate_loss, ppo_clip_token_loss
from harts.planner import PlanError, plan_step
from harts.prefix import build_shared_prefix
from harts.reference import tree_attention_reference
from harts.varlen import build_varlen_plan, varlen_tree_attention
from harts.workload import grpo_groups
from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from tests.harts.test_megatron import VOCAB, _grads, _per_sequence

P = [3, 1, 4, 1, 5, 9, 2, 6]  # the shared prefix of the model cases
GROUPS = [
    pytest.param([P + [7, 8, 9], P + [10, 11], P + [12, 13, 14, 15], P + [16]], [[0, 1], [2, 3]], id="grpo"),
    # deeper sharing below the prefix, one sub-prefix cut between the parts, a sequence equal to
    # the prefix, a duplicate and a part whose first sequence is a prefix of the next
    pytest.param([P + [7, 8, 9, 10], P + [7, 8, 11], P + [7, 8, 11, 12, 13], P, P + [20, 21], P + [20, 21],
                  P + [22], P + [22, 23, 24]], [[3, 0, 1], [2, 4, 5], [6, 7]], id="nested"),
]


def test_planner_groups_a_tree_larger_than_the_cap():
    seqs = grpo_groups(1, prompt_len=40, response_len=10, n=8, vocab_size=50, seed=0)
    cut = plan_step(seqs, PlannerConfig(token_cap=96, align=1))
    shared = plan_step(seqs, PlannerConfig(token_cap=96, align=1, prefix_reuse=True))
    assert [mb.mode for mb in cut.microbatches] == ["tree", "tree"]
    assert sum(mb.real_rows for mb in cut.microbatches) == 2 * 40 + 80  # the prompt runs twice
    (mb,) = shared.microbatches
    assert mb.mode == "shared" and mb.prefix_len == 40 and sorted(mb.seq_ids) == list(range(8))
    assert [len(p) for p in mb.parts] == [4, 4]  # two parts of 40 rows (48-row prefix + 40 <= 96)
    assert mb.real_rows == 40 + 8 + 80  # prompt once, one lookahead row per response, the responses
    assert mb.attn_pairs == 40 * 41 // 2 + 8 * 41 + 8 * sum(range(41, 51))
    batch = mb.build_shared(seqs)
    assert batch.prefix.num_nodes == 48 and [p.forest.num_nodes for p in batch.parts] == [40, 40]
    assert all(p.forest.num_nodes + batch.prefix.num_nodes <= 96 for p in batch.parts)
    with pytest.raises(PlanError, match="build_shared"):
        mb.build(seqs)
    # a tree that fits, or a prefix shorter than the alignment, is planned as before
    fits = plan_step(seqs, PlannerConfig(token_cap=128, align=1, prefix_reuse=True))
    assert [m.mode for m in fits.microbatches] == ["tree"]
    short = grpo_groups(1, prompt_len=4, response_len=30, n=8, vocab_size=50, seed=0)
    assert {m.mode for m in plan_step(short, PlannerConfig(token_cap=128, align=8, prefix_reuse=True)).microbatches} \
        == {"tree"}


def test_shared_prefix_vectors_rebuild_every_sequence():
    """Gathering the tokens with ``label_src`` from ``[prefix tokens ; part tokens]`` gives each
    sequence's positions 1..L−1; ``row_src`` gives the rows at depths 0..L−2."""
    seqs = GROUPS[1].values[0]
    batch = build_shared_prefix(seqs, GROUPS[1].values[1], align=4)
    assert batch.prefix_len == len(P)
    for part in batch.parts:
        toks = torch.cat([batch.prefix.tokens, part.forest.tokens])
        depth = torch.cat([batch.prefix.depth, part.forest.depth])
        got = toks[part.label_src]
        rows = depth[part.row_src]
        off = part.pred_offsets.tolist()
        for k, i in enumerate(part.seq_ids):
            assert got[off[k]:off[k + 1]].tolist() == seqs[i][1:]
            assert rows[off[k]:off[k + 1]].tolist() == list(range(len(seqs[i]) - 1))
        assert part.pred_seq_ids.tolist() == np.repeat(np.arange(len(part.seq_ids)), np.diff(off)).tolist()


def test_context_plan_equals_tree_attention_fp64():
    """A part's attention (its own rows as queries, the prefix's rows as leading context keys)
    equals the rows of the whole tree's attention, forward and backward."""
    seqs = [P + [7, 8, 9, 10], P + [7, 8, 11], P + [12, 13], P + [12]]
    full = build_forest(seqs)
    part = build_forest([s[len(P):] for s in seqs])
    c = len(P)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(full.num_nodes, h, 5, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    w = torch.randn(part.num_nodes, 4, 5, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = tree_attention_reference(*ref_in, last=full.last, scale=0.3)[c:]
    (ref * w).sum().backward()
    plan = build_varlen_plan(part.seg_offsets, part.seg_parent, context_rows=c)
    inp = [q[c:].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
    out = varlen_tree_attention(*inp, plan=plan, scale=0.3)
    (out * w).sum().backward()
    assert_close("out", ref, out, atol=1e-12)
    assert_close("dq", ref_in[0].grad[c:], inp[0].grad, atol=1e-12)
    assert_close("dk", ref_in[1].grad, inp[1].grad, atol=1e-12)
    assert_close("dv", ref_in[2].grad, inp[2].grad, atol=1e-12)
    with pytest.raises(ValueError, match="context_rows"):
        build_varlen_plan(part.seg_offsets, part.seg_parent, mode="levels", context_rows=c)


def _objective(part, lp, ent, old, adv, num_seqs):
    tok = ppo_clip_token_loss(lp, old, adv[part.pred_seq_ids], clip_low=0.2, clip_high=0.28) - 0.01 * ent
    return aggregate_loss(tok, torch.ones_like(tok), part.pred_seq_ids, num_seqs=len(part.seq_ids), mode="seq_mean",
                          num_sequences=num_seqs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seqs,parts", GROUPS)
def test_shared_step_equals_per_sequence_fp64(cpu_megatron, seqs, parts):
    """Prefix microbatch + parts through ``tree_shared_step`` (varlen backend, CPU kernels with the
    flash math) vs each sequence alone: per-sequence log-probs and entropies, the PPO loss with an
    entropy bonus (a nonlinear per-sequence objective), and every parameter gradient."""
    from harts.megatron import apply_harts, make_shared_params, tree_shared_step

    seed_all(1234)
    cfg = TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64)
    model = build_tiny_gpt(cfg).to(dtype=torch.float64)
    apply_harts(model)
    n = len(seqs)
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    off = np.concatenate([[0], np.cumsum([len(s) - 1 for s in seqs])])
    old = torch.randn(int(off[-1]), generator=g, dtype=torch.float64) * 0.1 - 2.0

    batch = build_shared_prefix(seqs, parts, align=4)
    params = make_shared_params(batch)
    got_lp, got_ent = {}, {}

    def loss_fn(part, lp, ent):
        sel = torch.as_tensor(np.concatenate([np.arange(off[i], off[i + 1]) for i in part.seq_ids]))
        for k, i in enumerate(part.seq_ids):
            a, b = part.pred_offsets[k:k + 2].tolist()
            got_lp[i], got_ent[i] = lp[a:b].detach(), ent[a:b].detach()
        return _objective(part, lp, ent, old[sel], adv[part.seq_ids], n)

    losses = tree_shared_step(model, batch, loss_fn, params=params, chunk_size=3, entropy_requires_grad=True)
    g_tree = _grads(model)
    model.zero_grad(set_to_none=True)

    lp_r, ent_r = _per_sequence(model, seqs)
    ref_losses = []
    for part in batch.parts:
        sel = torch.as_tensor(np.concatenate([np.arange(off[i], off[i + 1]) for i in part.seq_ids]))
        ref_losses.append(_objective(part, lp_r[sel], ent_r[sel], old[sel], adv[part.seq_ids], n))
    sum(ref_losses).backward()
    g_ref = _grads(model)

    assert sorted(got_lp) == list(range(n))
    assert_close("logp", lp_r, torch.cat([got_lp[i] for i in range(n)]), atol=1e-10, rtol=1e-10)
    assert_close("entropy", ent_r, torch.cat([got_ent[i] for i in range(n)]), atol=1e-10, rtol=1e-10)
    assert_close("losses", torch.stack(ref_losses).detach(), torch.stack(losses), atol=1e-10, rtol=1e-10)
    assert set(g_tree) == set(g_ref) and len(g_ref) > 0
    for name, ref in g_ref.items():
        assert ref.abs().max() > 0, f"{name}: zero reference gradient makes the check vacuous"
        assert_close(f"grad {name}", ref, g_tree[name], atol=1e-10, rtol=1e-10)


@pytest.mark.timeout(120)
def test_shared_step_rejects_what_it_cannot_run(cpu_megatron):
    from harts.megatron import (
        TreeIncompatibleError,
        apply_harts,
        make_shared_params,
        make_tree_params,
        tree_shared_step,
    )

    seqs, parts = GROUPS[0].values
    batch = build_shared_prefix(seqs, parts)
    with pytest.raises(TreeIncompatibleError, match="backend='varlen'"):
        make_shared_params(batch, backend="flex")
    with pytest.raises(TreeIncompatibleError, match="context_rows"):
        make_tree_params(batch.parts[0].forest, backend="dense", context_rows=batch.prefix_len)
    seed_all(0)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, recompute=True))
    apply_harts(model)
    with pytest.raises(TreeIncompatibleError, match="recompute_granularity"):
        tree_shared_step(model, batch, lambda part, lp, ent: lp.sum())
    with pytest.raises(ValueError, match="prefix_len"):
        build_shared_prefix(seqs, parts, prefix_len=len(P) + 1)
    with pytest.raises(ValueError, match="disjoint"):
        build_shared_prefix(seqs, [[0, 1], [1, 2]])
