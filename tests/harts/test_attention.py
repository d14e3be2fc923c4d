"""Tree attention equals per-sequence causal attention; the O(T)-built BlockMask equals the one
FlexAttention derives from the dense mask; flex forward equals dense on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.attention import build_block_mask, build_varlen_plan, tree_attention
from harts.forest import build_forest
from harts.reference import tree_mask
from mcore_distill.testing import assert_close
from tests.harts.cases import CASES


def per_sequence_attention(seqs, f, q, k, v, scale):
    """Gather each sequence's rows and run plain causal SDPA on it."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for i in range(len(seqs)):
        idx = f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]]
        qi, ki, vi = q[idx].transpose(0, 1), k[idx].repeat_interleave(rep, 1).transpose(0, 1), \
            v[idx].repeat_interleave(rep, 1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _qkv(t, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("seqs", CASES)
def test_dense_tree_attention_equals_per_sequence(seqs):
    f = build_forest(seqs)
    q, k, v = _qkv(f.num_nodes)
    q.requires_grad_(True)
    out = tree_attention(q, k, v, last=f.last, backend="dense")
    ref = per_sequence_attention(seqs, f, q, k, v, 1 / math.sqrt(8))
    assert_close("tree attention", ref, out[f.index], atol=1e-12, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=1, max_size=6))
def test_random_forest_attention(seqs):
    f = build_forest(seqs)
    q, k, v = _qkv(f.num_nodes, seed=len(seqs))
    out = tree_attention(q, k, v, last=f.last, scale=0.3, backend="dense")
    ref = per_sequence_attention(seqs, f, q, k, v, 0.3)
    assert_close("tree attention", ref, out[f.index], atol=1e-12, rtol=1e-12)


def _random_forest(n, seed):
    g = torch.Generator().manual_seed(seed)
    seqs, prompt = [], torch.randint(0, 5, (40,), generator=g).tolist()
    for i in range(n):
        cut = int(torch.randint(0, 40, (1,), generator=g))
        tail = torch.randint(0, 5, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        seqs.append(prompt[:cut] + tail if i % 4 else tail)
    return build_forest(seqs)


@pytest.mark.parametrize("block", [16, 32, 128])
def test_block_mask_matches_dense(block):
    from torch.nn.attention.flex_attention import create_block_mask

    f = _random_forest(12, block)
    last = f.last
    bm = build_block_mask(last, block_size=block)
    ref = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi <= last[ki]), None, None, f.num_nodes,
                            f.num_nodes, device="cpu", BLOCK_SIZE=block)
    dense_ref = ref.to_dense()
    assert torch.equal(bm.to_dense(), dense_ref)
    # full blocks must really be full, partial blocks must be non-empty (check against the dense mask)
    m = tree_mask(last)
    nb = bm.kv_num_blocks.shape[-1]
    pad = nb * block - f.num_nodes
    mp = torch.nn.functional.pad(m, (0, pad, 0, pad)).view(nb, block, nb, block)
    cnt = mp.sum((1, 3))
    for qb in range(nb):
        fulls = bm.full_kv_indices[0, 0, qb, : bm.full_kv_num_blocks[0, 0, qb]].tolist()
        parts = bm.kv_indices[0, 0, qb, : bm.kv_num_blocks[0, 0, qb]].tolist()
        rows = min(block, f.num_nodes - qb * block)
        for kb in fulls:
            assert cnt[qb, kb] == rows * block, (qb, kb)
        for kb in parts:
            assert cnt[qb, kb] > 0, (qb, kb)
        assert (cnt[qb] > 0).sum() == len(fulls) + len(parts)


def test_flex_forward_matches_dense_cpu():
    f = _random_forest(10, 1)
    q, k, v = _qkv(f.num_nodes, seed=3)
    bm = build_block_mask(f.last, block_size=32)
    with torch.no_grad():
        out = tree_attention(q, k, v, last=f.last, backend="flex", block_mask=bm)
        ref = tree_attention(q, k, v, last=f.last, backend="dense")
    assert_close("flex vs dense", ref, out, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("seqs", CASES)
def test_varlen_plan_equals_dense(seqs):
    """The varlen gather plan (keys = ancestor path, bottom-right causal) is the tree mask, with
    gradients summed into shared key/value rows by the gather's backward."""
    f = build_forest(seqs).padded(4)
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent)
    if bool((f.seg_parent < 0).all()):  # a forest of chains: keys are the rows themselves, no gather
        assert plan.kv_index is None and torch.equal(plan.cu_k, plan.cu_q)
    else:
        assert plan.kv_index.numel() == int((f.depth[f.seg_offsets[1:] - 1] + 1).sum())
    q, k, v = (x.requires_grad_(True) for x in _qkv(f.num_nodes, seed=5))
    out = tree_attention(q, k, v, last=f.last, backend="varlen", varlen_plan=plan, scale=0.4)
    do = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [q, k, v], do)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention(q2, k2, v2, last=f.last, backend="dense", scale=0.4)
    grads_r = torch.autograd.grad(ref, [q2, k2, v2], do)
    assert_close("varlen out", ref, out, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", grads_r, grads):
        assert_close(f"varlen d{name}", a, b, atol=1e-12, rtol=1e-12)


def test_bad_attention_input():
    q, k, v = _qkv(5)
    with pytest.raises(ValueError, match="backend must be"):
        tree_attention(q, k, v, last=torch.arange(5), backend="flash")
    with pytest.raises(ValueError, match="needs varlen_plan"):
        tree_attention(q, k, v, last=torch.arange(5), backend="varlen")
    with pytest.raises(ValueError, match="len\\(last\\) 4"):
        tree_attention(q, k, v, last=torch.arange(4), backend="dense")
