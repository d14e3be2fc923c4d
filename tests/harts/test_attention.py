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
from harts.varlen import gather_kv_triton
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


@pytest.mark.parametrize("mode", ["gather", "gather+save", "levels", "auto"])
@pytest.mark.parametrize("seqs", CASES)
def test_varlen_plan_equals_dense(seqs, mode):
    """Both varlen plans are the tree mask: keys gathered along the ancestor path and expanded to
    the query heads (bottom-right causal; gradients summed into shared rows and key heads; the
    backward gathers again or uses the saved gather), and the cascade (causal self part + one
    full attention per level, merged by log-sum-exp; backward with the merged out/lse). fp64, CPU
    kernels that follow the flash math."""
    f = build_forest(seqs).padded(4)
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent, mode=mode.removesuffix("+save"),
                             save_gathered_kv=mode.endswith("+save"))
    chains = bool((f.seg_parent < 0).all())
    if chains:  # a forest of chains: keys are the rows themselves, no gather, no levels
        assert plan.kv_index is None and torch.equal(plan.cu_k, plan.cu_q) and not plan.levels
    elif plan.mode == "gather":
        # a segment and its first child (next in pre-order) share a sequence; its keys are the
        # path of the sequence's last segment, so only sequence ends count
        sp = f.seg_parent
        first_child = torch.cat([sp[1:] == torch.arange(sp.numel() - 1), torch.tensor([False])])
        assert torch.equal(plan.cu_q.long(), torch.cat([f.seg_offsets[:-1][~torch.roll(first_child, 1)],
                                                         f.seg_offsets[-1:]]))
        ends = f.seg_offsets[1:][~first_child] - 1
        assert plan.kv_index.numel() == int((f.depth[ends] + 1).sum())
        # the copy CSR is the inverse of the gather: row r's copies, in gathered order
        rows = torch.repeat_interleave(torch.arange(f.num_nodes), plan.copy_ptr.diff().long())
        assert torch.equal(plan.kv_index[plan.copy_pos], rows)
        assert all(bool((plan.copy_pos[a:b].diff() > 0).all()) for a, b in zip(plan.copy_ptr[:-1].tolist(),
                                                                               plan.copy_ptr[1:].tolist(), strict=True))
    else:  # every row is a query once per strict-ancestor segment, every key row once per level
        anc = torch.zeros(f.num_nodes, dtype=torch.long)
        for lv in plan.levels:
            anc.index_add_(0, lv.q_index, torch.ones_like(lv.q_index))
            assert lv.k_index.unique().numel() == lv.k_index.numel()
        seg_depth = torch.zeros(f.seg_parent.numel(), dtype=torch.long)
        for s in range(f.seg_parent.numel()):
            p = int(f.seg_parent[s])
            seg_depth[s] = 0 if p < 0 else seg_depth[p] + 1
        assert torch.equal(anc, seg_depth[f.node_seg])
    q, k, v = (x.requires_grad_(True) for x in _qkv(f.num_nodes, seed=5))
    out = tree_attention(q, k, v, last=f.last, backend="varlen", varlen_plan=plan, scale=0.4)
    do = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [q, k, v], do)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention(q2, k2, v2, last=f.last, backend="dense", scale=0.4)
    grads_r = torch.autograd.grad(ref, [q2, k2, v2], do)
    assert_close(f"varlen[{plan.mode}] out", ref, out, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", grads_r, grads):
        assert_close(f"varlen[{plan.mode}] d{name}", a, b, atol=1e-12, rtol=1e-12)


def test_varlen_plan_modes_and_gathered_rows():
    """``auto`` is the key gather (the faster plan on the GPU lane once shared rows' gradients are
    summed by the segment-sum kernel), where a segment and its first child share a sequence;
    ``gathered_rows`` counts the duplicated keys (gather) or
    the extra query rows (levels: each row once per strict-ancestor level); a forest of chains
    gathers nothing."""
    grpo = [[1] * 40 + [2 + i] * 10 for i in range(8)]  # prefix 40 shared by 8 responses of 10
    f = build_forest(grpo)
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent)
    # the prompt shares a sequence with its first response: the other 7 gather it
    assert plan.mode == "gather" and plan.gathered_rows == 7 * 40 and plan.copy_ptr.numel() == f.num_nodes + 1
    assert plan.cu_q.tolist() == [0] + [50 + 10 * i for i in range(8)] and plan.max_q == 50
    lv = build_varlen_plan(f.seg_offsets, f.seg_parent, mode="levels")
    assert lv.gathered_rows == 80 and len(lv.levels) == 1 and lv.kv_index is None and lv.copy_ptr is None
    nested = [[1] * 10 + [2] * 5 + [3 + i] * 4 for i in range(3)] + [[1] * 10 + [9] * 6]
    f = build_forest(nested)
    lv = build_varlen_plan(f.seg_offsets, f.seg_parent, mode="levels")
    assert len(lv.levels) == 2 and lv.gathered_rows == (5 + 12 + 6) + 12  # below the root, below [2]*5
    chains = build_forest([[1, 2, 3], [4, 5]])
    assert build_varlen_plan(chains.seg_offsets, chains.seg_parent).gathered_rows == 0
    with pytest.raises(ValueError, match="mode must be"):
        build_varlen_plan(f.seg_offsets, f.seg_parent, mode="cascade")


def test_bad_attention_input():
    q, k, v = _qkv(5)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two, got 3"):
        gather_kv_triton(k, v, torch.arange(5), 4, rows_per_program=3)
    with pytest.raises(ValueError, match="backend must be"):
        tree_attention(q, k, v, last=torch.arange(5), backend="flash")
    with pytest.raises(ValueError, match="needs varlen_plan"):
        tree_attention(q, k, v, last=torch.arange(5), backend="varlen")
    with pytest.raises(ValueError, match="len\\(last\\) 4"):
        tree_attention(q, k, v, last=torch.arange(4), backend="dense")


def test_kv_gather_kernels_under_triton_interpreter():
    """The CUDA path of the gather plan's keys/values: the Triton gather with head expansion
    (strided ``k``/``v``) is bitwise ``index_select`` + ``repeat_interleave``, and its backward
    (copies and query heads summed in fp32, one rounding) is within the error bound of that sum
    against fp64 (fp32 and bf16; GQA 2:1 and 3:1, MHA, non-power-of-two widths). Triton's CPU
    interpreter in a subprocess, on a forest with a GRPO fork, nested forks, a duplicate and a prefix-of-another.
    The interpreter rounds fp32 → bf16 toward zero (the GPU rounds to nearest even, which
    ``test_sum_kv_copies_triton_matches_fp64`` pins to half an ulp), so bf16 gets one ulp here
    (the bound is in ``kv_gather_interpret``)."""
    from tests.harts.interpreter import run_interpreted

    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 6, 7, 8], [1, 2, 9], [1, 2, 9], [10, 11, 12], [10, 13]]
    res = run_interpreted("kv_gather_interpret", seqs)
    assert len(res) == 12
    for name, v in res.items():
        if name.startswith("gather"):
            assert v is True, name
        else:  # error / bound
            assert v <= 1.0, (name, v)


def test_flash_aten_schemas_take_the_arguments_harts_passes():
    """``harts.varlen`` calls aten's flash varlen kernels directly (``torch.nn.attention.varlen``'s
    custom-op layer costs host time per call): the installed torch's schemas must take the
    arguments it passes, by position and keyword (the GPU test compares the results bitwise)."""
    fwd = str(torch.ops.aten._flash_attention_forward.default._schema)
    bwd = str(torch.ops.aten._flash_attention_backward.default._schema)
    for schema in (fwd, bwd):
        for kw in ("float? scale=None", "window_size_left=None", "window_size_right=None"):
            assert kw in schema, (kw, schema)
    assert fwd.split("(", 1)[1].startswith("Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? "
                                           "cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
                                           "bool return_debug_mask"), fwd
    assert "-> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)" in fwd
    assert bwd.split("(", 1)[1].startswith("Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
                                           "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
                                           "SymInt max_k, float dropout_p, bool is_causal, Tensor rng_state, "
                                           "Tensor unused"), bwd
