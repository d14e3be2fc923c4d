"""Prefix forest invariants on fixed cases and random forests (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.forest import (
    EmptySequenceError,
    TokenOutOfRangeError,
    build_chain_forest,
    build_forest,
)
from tests.harts.cases import CASES


def check_forest(seqs, f):
    """Every documented invariant, checked against brute force."""
    t = f.num_nodes
    prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
    assert f.num_real == len(prefixes), "each distinct prefix must be exactly one node"
    assert f.total_tokens == sum(len(s) for s in seqs)
    paths = [f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]].tolist() for i in range(len(seqs))]
    for i, s in enumerate(seqs):
        assert f.sequence(i).tolist() == list(s)
        assert f.depth[paths[i]].tolist() == list(range(len(s)))
        assert f.parent[paths[i]].tolist() == [-1] + paths[i][:-1]
    par = f.parent.tolist()
    assert all(p < v for v, p in enumerate(par)), "pre-order: parents precede children"
    # ancestor test k <= q <= last[k] equals brute-force path membership
    anc = [set() for _ in range(t)]
    for v in range(t):
        anc[v] = ({v} | anc[par[v]]) if par[v] >= 0 else {v}
    last = f.last.tolist()
    for q in range(t):
        assert {k for k in range(t) if k <= q <= last[k]} == anc[q]
    mult = torch.zeros(t, dtype=torch.int64)
    for p in paths:
        mult[p] += 1
    assert torch.equal(f.multiplicity, mult)
    # segments: contiguous single-child chains, parent segment ends at the first node's parent
    nchild = f.num_children()
    so, sp = f.seg_offsets.tolist(), f.seg_parent.tolist()
    assert so[0] == 0 and so[-1] == t and all(a < b for a, b in zip(so, so[1:]))
    for s in range(len(sp)):
        a, b = so[s], so[s + 1]
        assert f.node_seg[a:b].tolist() == [s] * (b - a)
        for v in range(a + 1, b):
            assert par[v] == v - 1 and nchild[v - 1] == 1
        if par[a] >= 0:
            assert sp[s] >= 0 and so[sp[s] + 1] - 1 == par[a]
            assert nchild[par[a]] > 1 or par[a] != a - 1
        else:
            assert sp[s] == -1


@pytest.mark.parametrize("seqs", CASES)
def test_cases(seqs):
    f = build_forest(seqs)
    check_forest(seqs, f)


def test_counts_and_single_tokens():
    f = build_forest([[4], [4], [4, 5], [6]])
    assert f.num_nodes == 3 and f.total_tokens == 5 and f.multiplicity.tolist() == [3, 1, 1]
    assert f.label_index().tolist() == [1] and f.row_index().tolist() == [0]
    assert f.pred_offsets().tolist() == [0, 0, 0, 1, 1]


def test_chain_forest_is_thd_packing():
    seqs = [[1, 2, 3], [1, 2], [7]]
    f = build_chain_forest(seqs)
    assert f.num_nodes == 6 and f.last.tolist() == [2, 2, 2, 4, 4, 5]
    assert f.depth.tolist() == [0, 1, 2, 0, 1, 0]
    check_forest_paths = [f.sequence(i).tolist() for i in range(3)]
    assert check_forest_paths == seqs


def test_padding():
    f = build_forest([[1, 2, 3], [1, 2, 4]]).padded(8)
    assert f.num_nodes == 8 and f.num_pad == 4 and f.num_real == 4
    assert f.parent[4:].tolist() == [-1] * 4 and f.last[4:].tolist() == [4, 5, 6, 7]
    assert f.seg_offsets[-1].item() == 8 and f.compression == 6 / 4


def test_bad_input():
    with pytest.raises(EmptySequenceError, match=r"seqs\[1\] is empty"):
        build_forest([[1], []])
    with pytest.raises(EmptySequenceError, match="seqs is empty"):
        build_forest([])
    with pytest.raises(TokenOutOfRangeError, match=r"seqs\[0\] holds token id 9 outside \[0, 9\)"):
        build_forest([[1, 9]], vocab_size=9)
    with pytest.raises(TokenOutOfRangeError, match="token id -1"):
        build_forest([[-1]])
    with pytest.raises(TypeError, match="integer token ids"):
        build_forest([torch.tensor([1.0])])


# random forests: sequences made of shared prefixes plus random tails over a tiny alphabet
seq_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=7), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(seq_strategy, st.data())
def test_random_forests(base, data):
    seqs = []
    for s in base:
        k = data.draw(st.integers(0, len(seqs))) if seqs else 0
        if k and data.draw(st.booleans()):
            donor = seqs[k - 1]
            cut = data.draw(st.integers(1, len(donor)))
            s = donor[:cut] + s[: data.draw(st.integers(0, len(s)))]
        seqs.append(s)
    f = build_forest(seqs)
    check_forest(seqs, f)
    check_forest(seqs, f.padded(5))
