"""Gated DeltaNet over trees on CPU: references vs FLA's naive functions, tree convolution and
tree recurrence vs per-sequence execution (fp64, gradients included), chunk alignment, the plan,
typed errors, and the real hybrid Megatron GPT (GDN + attention layers) tree vs per-sequence with
every parameter gradient in fp64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from harts.forest import build_chain_forest, build_forest
from harts.gdn import (
    GdnConfigError,
    GdnShapeError,
    GdnTreeConfig,
    ancestor_table,
    build_gdn_plan,
    chain_rounds,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from harts.gdn_reference import (
    causal_conv1d_reference,
    chunk_gated_delta_rule_reference,
    l2norm_reference,
    recurrent_gated_delta_rule_reference,
)
from harts.workload import caterpillar
from mcore_distill.testing import assert_close

C = 16  # chunk size used by the tree cases (forks placed relative to it)


def _seq(start, n):
    return [(start + i) % 50 + 1 for i in range(n)]


P = _seq(0, 10)  # a 10-token prompt
GDN_CASES = [
    pytest.param([P + _seq(20, 7), P + _seq(30, 9), P + _seq(40, 5)], id="grpo-fork"),
    pytest.param([P[:5] + [51, 52], P[:5] + [51, 53, 54], P[:5] + [55, 56], P[:3] + [57]], id="nested-forks-in-chunk"),
    pytest.param([_seq(0, C) + _seq(20, 6), _seq(0, C) + _seq(30, 4), _seq(0, 2 * C) + [58, 59], _seq(0, 2 * C) + [60]],
                 id="fork-at-chunk-boundary"),
    pytest.param([[3] + _seq(5, 20), [4] + _seq(5, 18), [3, 9, 9]], id="fork-at-0"),
    pytest.param([_seq(0, 21), _seq(0, 12), _seq(0, 21) + _seq(7, 5), _seq(0, 1)], id="prefix-of-another"),
]


def _inputs(t, *, h=2, hv=4, k=8, v=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, k, generator=g, dtype=dtype)
    kk = F.normalize(torch.randn(t, h, k, generator=g, dtype=dtype), dim=-1)
    vv = torch.randn(t, hv, v, generator=g, dtype=dtype)
    gg = F.logsigmoid(torch.randn(t, hv, generator=g, dtype=dtype) + 2)
    beta = torch.rand(t, hv, generator=g, dtype=dtype)
    return q, kk, vv, gg, beta


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,chunk", [(37, 16), (64, 64), (5, 32)], ids=["T37-C16", "T64-C64", "T5-C32"])
def test_references_match_fla_naive_and_each_other(t, chunk):
    from fla.ops.gated_delta_rule import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    q, k, v, g, beta = (x[None] for x in _inputs(t, seed=t))
    h0 = torch.randn(1, 4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o_rec, s_rec = recurrent_gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_chk, s_chk = chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=chunk, initial_state=h0,
                                                    output_final_state=True)
    assert o_rec.dtype == torch.float64 and s_chk.dtype == torch.float64
    assert_close("chunk vs recurrent o (fp64)", o_rec, o_chk, atol=1e-12, rtol=1e-12)
    assert_close("chunk vs recurrent state (fp64)", s_rec, s_chk, atol=1e-12, rtol=1e-12)
    qe, ke = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)  # FLA naive has no GVA
    f32 = [x.float() for x in (qe, ke, v, g, beta)]
    o_nr, s_nr = naive_recurrent_gated_delta_rule(f32[0], f32[1], f32[2], f32[4], f32[3],  # (beta, g) order
                                                  initial_state=h0.float(), output_final_state=True)
    o_nc, s_nc = naive_chunk_gated_delta_rule(*f32, chunk_size=chunk, initial_state=h0.float(), output_final_state=True)
    for name, ref, out in (("naive recurrent o", o_nr, o_rec), ("naive recurrent state", s_nr, s_rec),
                           ("naive chunk o", o_nc, o_chk), ("naive chunk state", s_nc, s_chk)):
        assert_close(name, ref, out, atol=2e-5, rtol=2e-5)


def test_conv_reference_matches_module_conv():
    """The sequential reference equals ``nn.Conv1d(padding=W-1)`` truncated to L (Megatron's layout)."""
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=True).double()
    x = torch.randn(2, 9, 6, generator=g, dtype=torch.float64)
    ref = F.silu(conv(x.transpose(1, 2))[..., :9]).transpose(1, 2)
    out = causal_conv1d_reference(x, conv.weight.squeeze(1), conv.bias)
    assert_close("conv reference", ref, out, atol=1e-14, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# tree ops vs per-sequence
# ---------------------------------------------------------------------------------------------
def _per_sequence(forest, fn):
    return [(forest.index[forest.seq_offsets[i]:forest.seq_offsets[i + 1]], fn(forest.index[
        forest.seq_offsets[i]:forest.seq_offsets[i + 1]])) for i in range(forest.num_seqs)]


@pytest.mark.parametrize("width", [1, 4, 6])
@pytest.mark.parametrize("seqs", GDN_CASES)
def test_tree_conv_matches_sequential(seqs, width):
    f = build_forest(seqs).padded(8)
    t, d = f.num_nodes, 5
    g = torch.Generator().manual_seed(width)
    x0 = torch.randn(t, d, generator=g, dtype=torch.float64)
    w0 = torch.randn(d, width, generator=g, dtype=torch.float64)
    b0 = torch.randn(d, generator=g, dtype=torch.float64)
    x, w, b = (z.clone().requires_grad_(True) for z in (x0, w0, b0))
    y = tree_causal_conv1d(x, w, b, anc=ancestor_table(f.parent, width))
    xr, wr, br = (z.clone().requires_grad_(True) for z in (x0, w0, b0))
    loss_t, loss_r = 0.0, 0.0
    for i in range(f.num_seqs):
        idx = f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]]
        wt = torch.linspace(0.5, 1.5, idx.numel(), dtype=torch.float64)[:, None]
        yr = causal_conv1d_reference(xr[idx][None], wr, br)[0]
        assert_close(f"conv seq {i}", yr, y[idx], atol=1e-13, rtol=1e-13)
        loss_t = loss_t + (y[idx] * wt).sum()
        loss_r = loss_r + (yr * wt).sum()
    loss_t.backward()
    loss_r.backward()
    for name, ref, out in (("dx", xr.grad, x.grad), ("dw", wr.grad, w.grad), ("db", br.grad, b.grad)):
        assert_close(f"conv {name}", ref, out, atol=1e-12, rtol=1e-12)


def test_fla_tree_conv_under_triton_interpreter():
    """The GPU conv path (FLA ``causal_conv1d`` per trie segment, ancestors as its initial state,
    state gradient back into the ancestor rows) equals the torch tree conv: FLA's real Triton
    kernels, run by Triton's CPU interpreter in a subprocess (fp32, outputs and all gradients)."""
    from tests.harts.interpreter import run_interpreted

    cases = {c.id: c.values[0] for c in GDN_CASES}
    err = run_interpreted("fla_conv_interpret", cases)
    assert len(err) == 3 * len(cases)
    assert max(err.values()) <= 1e-5, err


@pytest.mark.parametrize("activation", ["silu", None])
def test_tree_conv_gradcheck(activation):
    """The hand-written backward (recomputed pre-activation, scatter-add) against finite differences."""
    f = build_forest([[1, 2, 3, 4], [1, 2, 5], [1, 6], [7]])
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((f.num_nodes, 3), (3, 4), (3,)))
    anc = ancestor_table(f.parent, 4)
    assert torch.autograd.gradcheck(lambda x, w, b: tree_causal_conv1d(x, w, b, anc=anc, activation=activation),
                                    (x, w, b))


@pytest.mark.parametrize("schedule", ["level", "chain"])
@pytest.mark.parametrize("align", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("seqs", GDN_CASES)
def test_tree_rule_matches_per_sequence_fp64(seqs, align, schedule):
    """Outputs and the gradients of q, k, v, g, β (through every handoff) equal per-sequence
    recurrence in fp64."""
    f = build_forest(seqs).padded(4)
    plan = build_gdn_plan(f, chunk_size=C, align=align, schedule=schedule)
    base = _inputs(f.num_nodes, seed=len(seqs))
    leaves = [x.clone().requires_grad_(True) for x in base]
    o = tree_gated_delta_rule(*leaves, plan=plan, state_dtype=torch.float64)
    refs = [x.clone().requires_grad_(True) for x in base]
    g = torch.Generator().manual_seed(3)
    loss_t, loss_r = 0.0, 0.0
    for i in range(f.num_seqs):
        idx = f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]]
        o_r, _ = recurrent_gated_delta_rule_reference(*(x[idx][None] for x in refs))
        assert_close(f"o seq {i}", o_r[0], o[idx], atol=1e-12, rtol=1e-12)
        wt = torch.randn(o_r[0].shape, generator=g, dtype=torch.float64)
        loss_t = loss_t + (o[idx] * wt).sum()
        loss_r = loss_r + (o_r[0] * wt).sum()
    loss_t.backward()
    loss_r.backward()
    for name, ref, out in zip(("dq", "dk", "dv", "dg", "dbeta"), refs, leaves):
        assert ref.grad.abs().max() > 0
        assert_close(name, ref.grad, out.grad, atol=1e-11, rtol=1e-11)


def test_chain_forest_runs_one_ungathered_round():
    """THD packing (a chain forest) takes the identity fast path and equals per-sequence recurrence."""

    seqs = GDN_CASES[0].values[0] + GDN_CASES[3].values[0]
    f = build_chain_forest(seqs)
    plan = build_gdn_plan(f, chunk_size=C)
    assert plan.identity
    x = _inputs(f.num_nodes, seed=9)
    o = tree_gated_delta_rule(*x, plan=plan, state_dtype=torch.float64)
    for i in range(f.num_seqs):
        idx = f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]]
        o_r, _ = recurrent_gated_delta_rule_reference(*(t[idx][None] for t in x))
        assert_close(f"chain seq {i}", o_r[0], o[idx], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("schedule", ["level", "chain"])
def test_alignment_reproduces_sequence_chunks_bitwise(schedule):
    """fp32, torch backend: with alignment every chunk the tree computes is a chunk of
    per-sequence chunked execution with the same start state, so outputs are bitwise equal."""
    seqs = [s for p in GDN_CASES for s in p.values[0]]
    f = build_forest(seqs)
    plan = build_gdn_plan(f, chunk_size=C, align=True, schedule=schedule)
    q, k, v, g, beta = _inputs(f.num_nodes, dtype=torch.float32, seed=5)
    o = tree_gated_delta_rule(q, k, v, g, beta, plan=plan, backend="torch")
    o_un = tree_gated_delta_rule(q, k, v, g, beta, plan=build_gdn_plan(f, chunk_size=C, align=False,
                                                                       schedule=schedule))
    unaligned_equal = True
    for i in range(f.num_seqs):
        idx = f.index[f.seq_offsets[i]:f.seq_offsets[i + 1]]
        o_r, _ = chunk_gated_delta_rule_reference(*(x[idx][None] for x in (q, k, v, g, beta)), chunk_size=C,
                                                  initial_state=torch.zeros(1, 4, 8, 6))
        assert torch.equal(o_r[0], o[idx]), f"seq {i}: max diff {(o_r[0] - o[idx]).abs().max().item():.3e}"
        assert_close(f"unaligned seq {i}", o_r[0], o_un[idx], atol=1e-5, rtol=1e-5)
        unaligned_equal &= torch.equal(o_r[0], o_un[idx])
    assert not unaligned_equal, "without alignment chunk boundaries differ, so some rows should round differently"


def test_plan_shapes_replay_and_rounds():
    # fork exactly at a chunk boundary: no replay; children start from the parent's final state
    f = build_forest([_seq(0, C) + [51, 52], _seq(0, C) + [53]])
    p = build_gdn_plan(f, chunk_size=C, align=True, schedule="level")
    assert (p.num_rounds, p.num_pieces, p.replay_tokens) == (2, 3, 0)
    # fork at depth C + 3: the prompt is cut at depth C, each child replays 3 shared tokens
    f = build_forest([_seq(0, C + 3) + [51, 52], _seq(0, C + 3) + [53]])
    p = build_gdn_plan(f, chunk_size=C, align=True, schedule="level")
    assert (p.num_rounds, p.num_pieces, p.replay_tokens) == (2, 4, 6)
    assert p.rounds[1].rows.tolist()[:3] == [C, C + 1, C + 2]
    p = build_gdn_plan(f, chunk_size=C, align=False, schedule="level")
    assert (p.num_rounds, p.num_pieces, p.replay_tokens) == (2, 3, 0)
    # nested forks inside the first chunk replay from depth 0: everything runs in one round
    f = build_forest(GDN_CASES[1].values[0])
    p = build_gdn_plan(f, chunk_size=C, align=True, schedule="level")
    assert p.num_rounds == 1 and p.replay_tokens == (3 + 3) + (5 + 5) + (6 + 6)  # forks at depths 3, 5, 6
    assert build_gdn_plan(f, chunk_size=C, align=False, schedule="level").num_rounds == 4
    # caterpillar with 3 side forks: 4 level rounds, 2 rounds if one child continued each chain
    spine = _seq(0, 40)
    cat = [spine[:10] + [51], spine[:20] + [52], spine[:30] + [53], spine]
    f = build_forest(cat)
    assert build_gdn_plan(f, chunk_size=C, align=False, schedule="level").num_rounds == 4
    assert chain_rounds(f) == 2
    # chain schedule: the spine continues; each side fork's state is recomputed from the spine start
    p = build_gdn_plan(f, chunk_size=C, align=False, schedule="chain")
    assert (p.num_rounds, p.export_tokens, p.replay_tokens) == (2, 10 + 20 + 30, 0)
    p = build_gdn_plan(f, chunk_size=C, align=True, schedule="chain")  # forks at 10, 20, 30 -> b = 0, 16, 16
    assert (p.num_rounds, p.export_tokens, p.replay_tokens) == (2, 16, 10 + 4 + 14)
    assert torch.equal(ancestor_table(f.parent, 3)[:3], torch.tensor([[0, -1, -1], [1, 0, -1], [2, 1, 0]]))
    assert not build_gdn_plan(f, chunk_size=C).identity
    # THD packing as a forest: one round, rows in order, no gather

    p = build_gdn_plan(build_chain_forest(cat), chunk_size=C)
    assert p.identity and p.num_rounds == 1 and p.rounds[0].cu_seqlens.tolist() == [0, 11, 32, 63, 103]


def test_auto_schedule_takes_chain_only_with_fewer_rounds():
    """``schedule='auto'`` (the default): the chain schedule when it has fewer rounds, else level."""
    spine = _seq(0, 40)
    cat = build_forest([spine[:10] + [51], spine[:20] + [52], spine[:30] + [53], spine])
    big = build_forest(caterpillar(1, turns=6, turn_len=40, branches=2, branch_len=8, vocab_size=97))
    for forest, align, want in ((cat, False, "chain"), (cat, True, "level"), (big, True, "chain")):
        auto = build_gdn_plan(forest, chunk_size=C, align=align)
        chain = build_gdn_plan(forest, chunk_size=C, align=align, schedule="chain")
        level = build_gdn_plan(forest, chunk_size=C, align=align, schedule="level")
        # aligned, the small caterpillar's side forks replay from chunk starts: 2 level rounds, a tie
        assert (chain.num_rounds < level.num_rounds) == (want == "chain")
        ref = chain if want == "chain" else level
        assert (auto.schedule, auto.num_rounds, auto.export_tokens, auto.replay_tokens) == (
            want, ref.num_rounds, ref.export_tokens, ref.replay_tokens)
        assert all(torch.equal(a.rows, b.rows) for a, b in zip(auto.rounds, ref.rounds))
    # a GRPO fork: both schedules take 2 rounds, so auto keeps the level schedule (nothing recomputed)
    grpo = build_forest([_seq(0, C + 3) + [51, 52], _seq(0, C + 3) + [53]])
    auto, chain = build_gdn_plan(grpo, chunk_size=C), build_gdn_plan(grpo, chunk_size=C, schedule="chain")
    assert auto.num_rounds == chain.num_rounds == 2 and auto.schedule == "level" and auto.export_tokens == 0
    # one round (a chain forest): nothing to choose
    assert build_gdn_plan(build_chain_forest([spine]), chunk_size=C).schedule == "level"
    assert GdnTreeConfig().schedule == "auto"


def test_config_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(GdnTreeConfig), {"chunk_size": 32, "align": False})
    assert OmegaConf.to_object(cfg) == GdnTreeConfig(chunk_size=32, align=False)
    with pytest.raises(GdnConfigError, match="GdnTreeConfig.chunk_size must be one of .* got 48"):
        OmegaConf.to_object(OmegaConf.merge(cfg, {"chunk_size": 48}))


@pytest.mark.parametrize("schedule", ["level", "chain"])
@pytest.mark.parametrize("align", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("seqs", GDN_CASES + [pytest.param("chain-forest", id="chain-forest")])
def test_one_function_recurrence_equals_composed_rounds_fp64(seqs, align, schedule):
    """:func:`harts.gdn_rounds.tree_recurrence` (all rounds in one autograd function, explicit backward:
    output-gradient rows, state-gradient routing, scatter-adds) on the torch kernels equals the
    composed autograd path in fp64: outputs and every input gradient within 1e-12. The chain schedule
    adds state-only pieces (several rounds read one source round); the chain forest takes the
    identity path."""
    from harts.gdn import composed_rounds
    from harts.gdn_rounds import tree_recurrence

    if seqs == "chain-forest":
        f = build_chain_forest(GDN_CASES[0].values[0] + GDN_CASES[3].values[0])
    else:
        f = build_forest(seqs).padded(4)
    plan = build_gdn_plan(f, chunk_size=C, align=align, schedule=schedule)
    base = _inputs(f.num_nodes, seed=len(f.seq_offsets))
    wt = torch.randn(f.num_nodes, 4, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    res = []
    for fn in (lambda *x: tree_recurrence(*x, plan=plan, kernels="torch", state_dtype=torch.float64),
               lambda *x: composed_rounds(*x, plan=plan, scale=8 ** -0.5, backend="torch", state_dtype=torch.float64)):
        leaves = [x.clone().requires_grad_(True) for x in base]
        o = fn(*leaves)
        (o * wt).sum().backward()
        res.append((o.detach(), [x.grad for x in leaves]))
    (o1, g1), (o2, g2) = res
    assert_close("o", o2, o1, atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # the inference path (no saved tensors) gives the same output
        assert torch.equal(tree_recurrence(*base, plan=plan, kernels="torch", state_dtype=torch.float64), o1)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), g2, g1):
        assert a.abs().max() > 0
        assert_close(name, a, b, atol=1e-12, rtol=1e-12)


def test_round_graphs_belong_to_one_plan_and_stay_idle_off_fla():
    """``RoundGraphs`` is built for one plan (another plan is a typed error); on the torch backend it is
    never used (no eager/capture/replay counted) and results equal a run without it."""
    from harts.gdn_graphs import RoundGraphs
    from harts.gdn_megatron import make_gdn_tree_params
    from harts.gdn_rounds import tree_recurrence

    f = build_forest([[1, 2, 3], [1, 2, 4]])
    plan, other = build_gdn_plan(f, chunk_size=C), build_gdn_plan(f, chunk_size=C)
    q, k, v, g, beta = _inputs(f.num_nodes)
    graphs = RoundGraphs(plan)
    with pytest.raises(GdnConfigError, match="graphs were built for another plan"):
        tree_gated_delta_rule(q, k, v, g, beta, plan=other, state_dtype=torch.float64, graphs=graphs)
    out = tree_gated_delta_rule(q, k, v, g, beta, plan=plan, state_dtype=torch.float64, graphs=graphs)
    assert torch.equal(out, tree_gated_delta_rule(q, k, v, g, beta, plan=plan, state_dtype=torch.float64))
    assert graphs.counts == {"eager": 0, "captured": 0, "replayed": 0}
    with pytest.raises(GdnConfigError, match="graphs were built for another plan"):
        tree_recurrence(q, k, v, g, beta, plan=other, kernels="torch", graphs=graphs)
    with pytest.raises(GdnConfigError, match="kernels must be one of .* got 'cuda'"):
        tree_recurrence(q, k, v, g, beta, plan=plan, kernels="cuda")
    assert isinstance(make_gdn_tree_params(f, backend="dense").gdn_graphs, RoundGraphs)
    assert make_gdn_tree_params(f, config=GdnTreeConfig(cuda_graphs=False), backend="dense").gdn_graphs is None


def test_recurrence_with_graphs_off_cuda_falls_back_to_eager():
    """Through the autograd function with :class:`RoundGraphs`: three layers, the second tries its
    captures (forward and backward; no CUDA here), warns and runs eagerly: every layer's output and
    gradients equal those without graphs."""
    from harts.gdn_graphs import RoundGraphs
    from harts.gdn_rounds import tree_recurrence

    f = build_forest(GDN_CASES[0].values[0])
    plan = build_gdn_plan(f, chunk_size=C)
    base = _inputs(f.num_nodes)
    graphs = RoundGraphs(plan)
    res = []
    for gr in (None, graphs):
        leaves = [[x.clone().requires_grad_(True) for x in base] for _ in range(3)]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs = [tree_recurrence(*xs, plan=plan, kernels="torch", graphs=gr, state_dtype=torch.float64)
                    for xs in leaves]
            sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
        res.append((outs, [[x.grad for x in xs] for xs in leaves]))
        assert len([w for w in seen if "CUDA graph failed" in str(w.message)]) == (0 if gr is None else 2)
    assert graphs.counts == {"eager": 6, "captured": 0, "replayed": 0}
    for (o1, g1), (o2, g2) in zip(zip(*res[0]), zip(*res[1])):
        assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_dropped_round_graphs_are_freed_without_the_cyclic_collector():
    """A microbatch's :class:`RoundGraphs` (with its graphed calls, after a forward and backward) is freed
    by reference counting the moment it is dropped: were it left to Python's cyclic collector, that
    could run inside a later microbatch's capture, and destroying graphs or releasing a pool there
    invalidates the capture (seen on the GPU lane as a failed capture, 2026-12-02)."""
    import gc
    import weakref

    from harts.gdn_graphs import RoundGraphs
    from harts.gdn_rounds import tree_recurrence

    f = build_forest(GDN_CASES[0].values[0])
    plan = build_gdn_plan(f, chunk_size=C)
    graphs = RoundGraphs(plan)
    xs = [x.requires_grad_(True) for x in _inputs(f.num_nodes)]
    tree_recurrence(*xs, plan=plan, kernels="torch", graphs=graphs, state_dtype=torch.float64).sum().backward()
    assert graphs.counts["eager"] == 2  # the forward and backward calls exist
    ref = weakref.ref(graphs)
    gc.disable()
    try:
        del graphs
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()


def test_graphed_call_runs_eagerly_when_capture_fails():
    """The capture policy: call 1 eager; call 2 tries a capture, and a failure (here: no CUDA) warns once
    and keeps the call eager for good, with the eager results."""
    from harts.gdn_graphs import _GraphedCall

    seen = []

    def fn(x, y):
        seen.append(1)
        return (x + y, x * y)

    call = _GraphedCall(fn, None, "recurrence forward")
    a, b = torch.arange(3.0), torch.full((3,), 2.0)
    assert all(torch.equal(u, w) for u, w in zip(call(a, b), (a + b, a * b)))
    with pytest.warns(RuntimeWarning, match="capturing the recurrence forward in a CUDA graph failed"):
        call(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call(a, b)
    assert torch.equal(out[1], a * b) and len(seen) == 3
    assert call.counts == {"eager": 3, "captured": 0, "replayed": 0}


def test_bad_input_raises_typed_errors():
    with pytest.raises(GdnConfigError, match="chunk_size must be one of .* got 48"):
        GdnTreeConfig(chunk_size=48)
    with pytest.raises(GdnConfigError, match="state_dtype .* got 'bfloat16'"):
        GdnTreeConfig(state_dtype="bfloat16")
    with pytest.raises(GdnConfigError, match="backend must be one of .* got 'cuda'"):
        GdnTreeConfig(backend="cuda")
    with pytest.raises(GdnConfigError, match="schedule must be one of .* got 'dfs'"):
        GdnTreeConfig(schedule="dfs")
    with pytest.raises(GdnConfigError, match="chunk_size must be one of .* got 128"):
        build_gdn_plan(build_forest([[1, 2]]), chunk_size=128)
    f = build_forest([[1, 2, 3], [1, 2, 4]])
    plan = build_gdn_plan(f, chunk_size=C)
    q, k, v, g, beta = _inputs(f.num_nodes)
    with pytest.raises(GdnShapeError, match=r"q and k must both be \[T, H, K\]"):
        tree_gated_delta_rule(q, k[..., :4], v, g, beta, plan=plan, state_dtype=torch.float64)
    with pytest.raises(GdnShapeError, match="HV a multiple of H=2"):
        tree_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], plan=plan, state_dtype=torch.float64)
    with pytest.raises(GdnShapeError, match="plan was built for T=4"):
        tree_gated_delta_rule(*(x[:3] for x in (q, k, v, g, beta)), plan=plan, state_dtype=torch.float64)
    with pytest.raises(GdnConfigError, match="state_dtype must be torch.float32 .* got torch.bfloat16"):
        tree_gated_delta_rule(q, k, v, g, beta, plan=plan, state_dtype=torch.bfloat16)
    with pytest.raises(GdnConfigError, match="fp64 inputs on the torch backend need state_dtype=float64"):
        tree_gated_delta_rule(q, k, v, g, beta, plan=plan)
    with pytest.raises(GdnConfigError, match="backend='fla' needs CUDA tensors"):
        tree_gated_delta_rule(q, k, v, g, beta, plan=plan, backend="fla")
    with pytest.raises(GdnShapeError, match=r"ancestor table \(4, 2\) must be \[T=4, >= W=4\]"):
        tree_causal_conv1d(torch.zeros(4, 3), torch.zeros(3, 4), anc=ancestor_table(f.parent, 2))


# ---------------------------------------------------------------------------------------------
# the real hybrid Megatron model
# ---------------------------------------------------------------------------------------------
VOCAB = 61
GDN_DIMS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4)


def build_hybrid(pattern, *, dtype, recompute=False, tp=1, vocab=VOCAB, device="cpu", sp=False):
    """Tiny hybrid GPT (GatedDeltaNet + attention layers, local modules) with tree execution enabled."""
    from megatron.core.models.gpt import GPTModel

    from harts.gdn_megatron import hybrid_block_spec
    from harts.megatron import apply_harts
    from mcore_distill.testing import TinyGPTConfig, transformer_config

    cfg = TinyGPTConfig(vocab_size=vocab, params_dtype=dtype, num_layers=len(pattern), recompute=recompute,
                        tensor_model_parallel_size=tp, sequence_parallel=sp, extra=dict(GDN_DIMS))
    model = GPTModel(config=transformer_config(cfg), transformer_layer_spec=hybrid_block_spec(pattern),
                     vocab_size=vocab, max_sequence_length=128, position_embedding_type="rope")
    model = model.to(device=device, dtype=dtype)
    apply_harts(model)
    return model


def hybrid_exactness(seqs, *, pattern="GAG", dtype=torch.float64, recompute=False, gdn=None, tol=1e-10,
                     device="cpu", attn_backend="dense", sp=False, forest=None):
    """Tree vs per-sequence on the hybrid model: log-probs, entropies, a PPO-style loss and every
    parameter gradient. ``forest`` (sequence k = ``seqs[k]``) defaults to ``build_forest(seqs)``.
    Returns the number of gradients compared (shared with the TP=2 body)."""
    import torch.distributed as dist

    from harts.gdn_megatron import make_gdn_tree_params
    from harts.loss import aggregate_loss, ppo_clip_token_loss, sequence_entropy, sequence_logprobs
    from harts.megatron import tree_forward
    from mcore_distill.testing import seed_all

    tp = dist.get_world_size()
    seed_all(1234)
    model = build_hybrid(pattern, dtype=dtype, recompute=recompute, tp=tp, vocab=VOCAB + VOCAB % tp, device=device,
                         sp=sp)
    gdn = gdn or GdnTreeConfig(chunk_size=C, state_dtype="float64" if dtype == torch.float64 else "float32")
    forest = forest if forest is not None else build_forest(seqs, vocab_size=VOCAB, device=device).padded(tp)
    n = len(seqs)
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(n, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    seq_ids = forest.pred_seq_ids()

    def objective(lp, ent, old):
        tok = ppo_clip_token_loss(lp, old, adv[seq_ids], clip_low=0.2, clip_high=0.28) - 0.01 * ent
        return aggregate_loss(tok, torch.ones_like(tok), seq_ids, num_seqs=n, mode="seq_mean")

    params = make_gdn_tree_params(forest, config=gdn, backend=attn_backend)
    out = tree_forward(model, forest, params=params, chunk_size=5, entropy_requires_grad=True)
    lp, ent = sequence_logprobs(out.logp, forest), sequence_entropy(out.entropy, forest)
    old = (lp.detach() + 0.1 * torch.randn(lp.shape, generator=g, dtype=torch.float64).to(device)).to(lp.dtype)
    loss = objective(lp, ent, old)
    loss.backward()
    g_tree = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    lps, ents = [], []
    for s in seqs:
        t = torch.tensor(s, device=device)
        causal = torch.triu(torch.ones(len(s), len(s), dtype=torch.bool, device=device), diagonal=1)[None, None]
        logits = model(t[None], torch.arange(len(s), device=device)[None], causal, runtime_gather_output=True)[0]
        lr = torch.log_softmax(logits.to(lp.dtype), -1)
        lps.append(lr[:-1].gather(-1, t[1:, None]).squeeze(-1))
        ents.append(-(lr.exp() * lr).sum(-1)[:-1])
    lp_r, ent_r = torch.cat(lps), torch.cat(ents)
    loss_r = objective(lp_r, ent_r, old)
    loss_r.backward()
    g_ref = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}

    assert_close("logp", lp_r, lp, atol=tol, rtol=tol)
    assert_close("entropy", ent_r, ent, atol=tol, rtol=tol)
    assert_close("loss", loss_r, loss, atol=tol, rtol=tol)
    assert set(g_ref) == set(g_tree) and any(".conv1d." in k for k in g_ref) and any("A_log" in k for k in g_ref)
    for name, ref in g_ref.items():
        assert ref.abs().max() > 0, f"{name}: zero reference gradient makes the check vacuous"
        assert_close(f"grad {name}", ref, g_tree[name], atol=tol, rtol=tol)
    return len(g_ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seqs", GDN_CASES)
def test_hybrid_model_tree_equals_per_sequence_fp64(cpu_megatron, seqs):
    hybrid_exactness(seqs, tol=1e-9)


@pytest.mark.timeout(120)
def test_hybrid_model_chain_schedule_fp64(cpu_megatron):
    """Chain schedule (state-only pieces) inside the model, aligned."""
    seqs = GDN_CASES[1].values[0] + GDN_CASES[4].values[0]
    hybrid_exactness(seqs, pattern="GA", gdn=GdnTreeConfig(chunk_size=C, schedule="chain", state_dtype="float64"),
                     tol=1e-9)


@pytest.mark.timeout(120)
def test_hybrid_model_unaligned_with_recompute_fp64(cpu_megatron):
    """Without chunk alignment (no replay) and with full activation recomputation."""
    seqs = GDN_CASES[0].values[0] + GDN_CASES[2].values[0]
    hybrid_exactness(seqs, pattern="GGA", recompute=True, gdn=GdnTreeConfig(chunk_size=C, align=False,
                                                                             state_dtype="float64"), tol=1e-9)


@pytest.mark.timeout(120)
def test_hybrid_model_over_planner_microbatches(cpu_megatron):
    """Planner microbatches (tree and THD-fallback, alignment padding) through the hybrid model."""
    from harts.config import PlannerConfig
    from harts.planner import plan_step

    seqs = GDN_CASES[0].values[0] + [_seq(5, 30), _seq(25, 27)] + GDN_CASES[1].values[0]
    plan = plan_step(seqs, PlannerConfig(token_cap=64, align=16, fallback_compression=1.15))
    mbs = plan.microbatches
    assert {mb.mode for mb in mbs} == {"tree", "thd"}
    for mb in mbs:
        hybrid_exactness([seqs[i] for i in mb.seq_ids], pattern="GA", forest=mb.build(seqs), tol=1e-9)


def test_spec_swap_and_errors(cpu_megatron):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from harts.gdn_megatron import TreeGatedDeltaNet, apply_tree_gdn, gdn_layer_spec, tree_gdn_spec
    from harts.megatron import TreeIncompatibleError, make_tree_params, tree_forward
    from mcore_distill.testing import seed_all

    spec = gdn_layer_spec(tree=False)
    assert spec.submodules.self_attention.module is GatedDeltaNet
    assert tree_gdn_spec([spec])[0].submodules.self_attention.module is TreeGatedDeltaNet
    assert spec.submodules.self_attention.module is GatedDeltaNet  # the input spec is not modified
    seed_all(2)
    model = build_hybrid("GA", dtype=torch.float64)
    mixer = model.decoder.layers[0].self_attention
    mixer.__class__ = GatedDeltaNet  # as built from Megatron's own spec
    sd = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert apply_tree_gdn(model) == 1 and type(mixer) is TreeGatedDeltaNet
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    forest = build_forest([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(TreeIncompatibleError, match="without a GDN plan.*make_gdn_tree_params"):
        tree_forward(model, forest, params=make_tree_params(forest, backend="dense"))
    from harts.gdn_megatron import make_gdn_tree_params

    with pytest.raises(GdnShapeError, match="3 rows after in_proj but the plan has T=4"):
        params = make_gdn_tree_params(forest, config=GdnTreeConfig(state_dtype="float64"), backend="dense")
        mixer(torch.zeros(3, 1, 64, dtype=torch.float64), None, packed_seq_params=params)
    with pytest.raises(GdnConfigError, match="conv_width=2 is smaller than the layer's linear_conv_kernel_dim=4"):
        tree_forward(model, forest, params=make_gdn_tree_params(
            forest, config=GdnTreeConfig(conv_width=2, state_dtype="float64"), backend="dense"))


def test_split_qkv_is_megatrons_preparation_without_the_repeat(cpu_megatron, monkeypatch):
    """The tree path's ``_split_qkv`` against ``GatedDeltaNet._prepare_input_for_gated_delta_rule`` (its
    undecorated body, with FLA's Triton ``l2norm`` swapped for the same formula in plain torch): value
    equal, and q/k equal once repeated to the value heads, as FLA's grouped value attention reads them."""
    import megatron.core.ssm.gated_delta_net.common as mcore_gdn
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from harts.gdn_megatron import _split_qkv
    from mcore_distill.testing import seed_all

    seed_all(3)
    mixer = build_hybrid("G", dtype=torch.float64).decoder.layers[0].self_attention
    rep = mixer.num_value_heads // mixer.num_key_heads
    assert rep == 2  # GDN_DIMS: 2 key heads, 4 value heads
    monkeypatch.setattr(mcore_gdn, "l2norm", l2norm_reference)
    b, s = 1, 7
    qkv = torch.randn(b, s, 2 * mixer.qk_dim_local_tp + mixer.v_dim_local_tp, dtype=torch.float64)
    gate, beta, alpha = (torch.randn(b, s, n, dtype=torch.float64) for n in (mixer.v_dim_local_tp, 4, 4))
    prepare = GatedDeltaNet._prepare_input_for_gated_delta_rule.__wrapped__  # the body under torch.compile
    q_ref, k_ref, v_ref, *_ = prepare(mixer, qkv, gate, b, s, beta, alpha)
    q, k, v = _split_qkv(mixer, qkv, b, s)
    assert q.shape == (b, s, 2, 8) and v.shape == (b, s, 4, 8)
    assert torch.equal(q.repeat_interleave(rep, dim=2), q_ref)
    assert torch.equal(k.repeat_interleave(rep, dim=2), k_ref)
    assert torch.equal(v, v_ref)
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(b, s, 2, dtype=torch.float64), rtol=0, atol=1e-6)


def _tp2_body(rank, world):
    from mcore_distill.testing import destroy_megatron, init_megatron

    init_megatron(tp=world)
    seqs = GDN_CASES[0].values[0] + GDN_CASES[3].values[0] + [[40, 50, 60, 41], [40, 50, 59]]  # both vocab shards
    n = hybrid_exactness(seqs, pattern="GA", recompute=True, tol=1e-9)
    destroy_megatron()
    return n


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_hybrid_model_tp2_gloo():
    """TP=2 (column-parallel in_proj: GDN heads split over ranks; row-parallel out_proj), full recompute.
    Sequence parallelism is not testable here: Megatron's torch norms (local spec) refuse it."""
    from mcore_distill.testing import run_ranks

    res = run_ranks(_tp2_body, 2, timeout=170)
    assert res[0] == res[1] > 0
