"""Tree-aware chunked LM head == full-logits reference (forward and backward), also for plain
packed sequences, and under TP=2 vocab parallelism on gloo (one spawned run)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.forest import build_chain_forest, build_forest
from harts.lm_head import tree_lm_head
from harts.reference import tree_head_reference
from mcore_distill.testing import assert_close
from tests.harts.cases import CASES


def compare_head(f, *, v, h=12, chunk, temp, ent_grad, dtype, tol, seed=0, tp_group=None, rank=0, world=1):
    g = torch.Generator().manual_seed(seed)
    t = f.num_nodes
    hid = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w_full = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    vl = v // world
    w = w_full[rank * vl:(rank + 1) * vl].clone().requires_grad_(True)
    c_lp, c_en = torch.randn(t, generator=g, dtype=torch.float64), torch.randn(t, generator=g, dtype=torch.float64)
    lp, en = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=chunk, temperature=temp,
                          entropy_requires_grad=ent_grad, tp_group=tp_group)
    obj = (lp.double() * c_lp).sum() + ((en.double() * c_en).sum() if ent_grad else 0.0)
    dh, dw = torch.autograd.grad(obj, [hid, w])
    hid_r = hid.detach().double().requires_grad_(True)
    w_r = w_full.double().requires_grad_(True)
    lr, er = tree_head_reference(hid_r, w_r, f.tokens, f.parent, temperature=temp)
    obj_r = (lr * c_lp).sum() + ((er * c_en).sum() if ent_grad else 0.0)
    dh_r, dw_r = torch.autograd.grad(obj_r, [hid_r, w_r])
    assert_close("logp", lr, lp, atol=tol, rtol=tol)
    assert_close("entropy", er, en, atol=tol, rtol=tol)
    assert_close("dhidden", dh_r, dh, atol=tol, rtol=tol)
    assert_close("dweight", dw_r[rank * vl:(rank + 1) * vl], dw, atol=tol, rtol=tol)


@pytest.mark.parametrize("seqs", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 7, 4096], ids=lambda c: f"chunk{c}")
def test_chunked_head_fp64(seqs, chunk):
    compare_head(build_forest(seqs), v=37, chunk=chunk, temp=0.7, ent_grad=True, dtype=torch.float64, tol=1e-12)


@pytest.mark.parametrize("ent_grad", [False, True])
def test_chunked_head_fp32_plain_packing(ent_grad):
    seqs = [list(range(3, 40)), list(range(5, 25)), [1]]
    compare_head(build_chain_forest(seqs), v=253, chunk=16, temp=1.0, ent_grad=ent_grad, dtype=torch.float32, tol=1e-5)


def test_head_entropy_detached_by_default():
    f = build_forest([[1, 2, 3]])
    hid = torch.randn(3, 4, requires_grad=True)
    lp, en = tree_lm_head(hid, torch.randn(9, 4), f.tokens, f.parent)
    assert lp.requires_grad and not en.requires_grad
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        tree_lm_head(hid, torch.randn(9, 4), f.tokens, f.parent, chunk_size=0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=6),
       st.integers(1, 9))
def test_random_forest_fork_labels(seqs, chunk):
    """Per-sequence log-probs/entropies from the tree head equal a per-sequence head applied to
    the same rows (hidden states that depend only on the prefix, as in the model)."""
    from harts.loss import sequence_entropy, sequence_logprobs
    from harts.reference import per_sequence_head_reference

    f = build_forest(seqs)
    g = torch.Generator().manual_seed(len(seqs) * 31 + chunk)
    hid = torch.randn(f.num_nodes, 6, generator=g, dtype=torch.float64)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64)
    lp, ent = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=chunk, temperature=1.3)
    rows = [f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]] for i in range(f.num_seqs)]
    it = iter(rows)
    lr, er = per_sequence_head_reference([f.sequence(i) for i in range(f.num_seqs)], lambda s: hid[next(it)] @ w.T,
                                         temperature=1.3)
    assert_close("logp", lr, sequence_logprobs(lp, f), atol=1e-12, rtol=1e-12)
    assert_close("entropy", er, sequence_entropy(ent, f), atol=1e-12, rtol=1e-12)
