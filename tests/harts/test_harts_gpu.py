"""GPU lane: FlexAttention backward (compiled) against the fp64 dense reference, the real tiny
GPT tree vs per-sequence through the flex backend, and the LM head in bf16 (both implementations;
at the real vocabulary against fp64).

Run: ``pytest -q -m gpu tests/harts/test_harts_gpu.py`` on a CUDA machine (skipped on CPU).
"""

from __future__ import annotations

import pytest
import torch

from harts.attention import build_block_mask, build_varlen_plan, tree_attention
from harts.forest import build_forest
from harts.lm_head import _triton_vocab_block, tree_lm_head
from harts.reference import tree_attention_reference, tree_head_reference
from harts.workload import caterpillar, grpo_groups
from mcore_distill.testing import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["grpo", "caterpillar"])
def test_flex_backward_matches_dense(kind):
    seqs = (grpo_groups(2, prompt_len=300, response_len=200, n=4, vocab_size=1000, seed=1) if kind == "grpo"
            else caterpillar(2, turns=4, turn_len=70, branches=2, branch_len=50, vocab_size=1000))
    f = build_forest(seqs, device="cuda")
    t = f.num_nodes
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, h, 64, device="cuda", generator=g) for h in (8, 2, 2))
    do = torch.randn(t, 8, 64, device="cuda", generator=g)
    qf, kf, vf = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = tree_attention(qf, kf, vf, last=f.last, backend="flex", block_mask=build_block_mask(f.last))
    out.backward(do)
    qr, kr, vr = (x.double().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention_reference(qr, kr, vr, last=f.last, scale=0.125)
    ref.backward(do.double())
    assert_close("flex out", ref, out, atol=2e-5, rtol=1e-4)
    for name, a, b in (("dq", qr.grad, qf.grad), ("dk", kr.grad, kf.grad), ("dv", vr.grad, vf.grad)):
        assert_close(f"flex {name}", a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["gather", "gather+save", "levels"])
@pytest.mark.parametrize("kind", ["grpo", "caterpillar"])
def test_varlen_matches_dense_bf16(kind, mode):
    """FlashAttention-2 varlen (bf16), both plans, vs the fp64 dense reference on the same
    bf16-rounded inputs: the key gather (also checks the kernel's bottom-right causal alignment;
    the backward gathers again or uses the saved gather) and the cascade (FA2 partials with their
    log-sum-exp, merged in fp32; the backward calls FA2's backward with the merged output and lse)."""
    seqs = (grpo_groups(2, prompt_len=300, response_len=200, n=4, vocab_size=1000, seed=1) if kind == "grpo"
            else caterpillar(2, turns=4, turn_len=70, branches=2, branch_len=50, vocab_size=1000))
    f = build_forest(seqs, device="cuda")
    t = f.num_nodes
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, h, 64, device="cuda", generator=g).bfloat16() for h in (8, 2, 2))
    do = torch.randn(t, 8, 64, device="cuda", generator=g).bfloat16()
    qf, kf = (x.clone().requires_grad_(True) for x in (q, k))
    v_base = torch.cat([torch.zeros_like(v), v], -1).requires_grad_(True)  # v as a strided slice, as in Megatron
    vf = v_base[..., 64:]
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent, mode=mode.removesuffix("+save"),
                             save_gathered_kv=mode.endswith("+save"))
    assert plan.mode == mode.removesuffix("+save")
    out = tree_attention(qf, kf, vf, last=f.last, backend="varlen", varlen_plan=plan, scale=0.125)
    out.backward(do)
    assert torch.count_nonzero(v_base.grad[..., :64]) == 0
    qr, kr, vr = (x.double().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention_reference(qr, kr, vr, last=f.last, scale=0.125)
    ref.backward(do.double())
    # bf16 output rounding (2^-8 relative) dominates; fp32 accumulation inside the kernel
    assert_close("varlen out", ref, out, atol=1e-2, rtol=1e-2)
    for name, a, b in (("dq", qr.grad, qf.grad), ("dk", kr.grad, kf.grad), ("dv", vr.grad, v_base.grad[..., 64:])):
        assert_close(f"varlen {name}", a, b, atol=3e-2, rtol=2e-2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
def test_megatron_tree_flex_fp32(cpu_megatron, recompute):
    from tests.harts.cases import CASES
    from tests.harts.test_megatron import run_exactness

    seqs = [s for c in CASES[:4] for s in c.values[0]]
    run_exactness(seqs, dtype=torch.float32, recompute=recompute, tol=1e-5, grad_tol=1e-4, device="cuda",
                  backend="flex")


_HEAD_VARIANTS = {"triton": {}, "torch": {"impl": "torch"}, "fused": {"fused": True}}  # triton = the default


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(_HEAD_VARIANTS))
def test_chunked_head_bf16_inputs(variant):
    seqs = grpo_groups(2, prompt_len=500, response_len=300, n=4, vocab_size=32000, seed=2)
    f = build_forest(seqs, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(f.num_nodes, 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (0.05 * torch.randn(32000, 256, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    lp, ent = tree_lm_head(h, w, f.tokens, f.parent, chunk_size=512, entropy_requires_grad=True,
                           **_HEAD_VARIANTS[variant])
    (lp.sum() + ent.sum()).backward()
    hr, wr = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    lr, er = tree_head_reference(hr, wr, f.tokens, f.parent)
    (lr.sum() + er.sum()).backward()
    assert_close("logp", lr, lp, atol=1e-4, rtol=1e-4)
    assert_close("entropy", er, ent, atol=1e-4, rtol=1e-4)
    # gradients are rounded to bf16 (8 bits of mantissa): relative tolerance 1/128
    assert_close("dhidden", hr.grad, h.grad, atol=1e-3, rtol=8e-3)
    # dW sums ~3.4k bf16-rounded logit gradients (rounded like Megatron's own head): an element
    # whose terms cancel keeps the terms' rounding, so bound it by the terms' scale, and the
    # whole matrix by the bf16 rounding unit in norm.
    assert_close("dweight", wr.grad, w.grad, atol=2e-2, rtol=8e-3)
    rel = ((w.grad.double() - wr.grad).norm() / wr.grad.norm()).item()
    assert rel < 4e-3, f"dweight: relative Frobenius error {rel:.2e}"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("ent_grad", [False, True], ids=["logp", "logp+entropy"])
def test_head_vs_fp64_at_qwen3_vocab(impl, ent_grad):
    """The head at the real vocabulary (151,936) and width (2048) on tree rows (GRPO forks and a
    caterpillar, 1,368 rows), bf16 inputs, against the fp64 full-logits reference on the same
    values, with per-edge and per-row upstream gradients (as a PPO loss gives). Log-probs and
    entropies within 1e-4; each gradient's relative Frobenius error within twice the error of
    rounding the fp64 reference itself to bf16 (the floor of any bf16 result): one rounding of
    ``dz`` and one of the result, no accumulation in bf16."""
    v, hd = 151936, 2048
    seqs = grpo_groups(2, prompt_len=300, response_len=100, n=4, vocab_size=v, seed=4) + caterpillar(
        1, turns=3, turn_len=64, branches=2, branch_len=32, vocab_size=v)
    f = build_forest(seqs, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(f.num_nodes, hd, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (0.02 * torch.randn(v, hd, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    c_lp = torch.randn(f.num_nodes, device="cuda", generator=g, dtype=torch.float64)
    c_en = torch.randn(f.num_nodes, device="cuda", generator=g, dtype=torch.float64)
    lp, ent = tree_lm_head(h, w, f.tokens, f.parent, impl=impl, entropy_requires_grad=ent_grad)
    ((lp.double() * c_lp).sum() + ((ent.double() * c_en).sum() if ent_grad else 0.0)).backward()
    hr, wr = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    lr, er = tree_head_reference(hr, wr, f.tokens, f.parent)
    ((lr * c_lp).sum() + ((er * c_en).sum() if ent_grad else 0.0)).backward()
    assert_close("logp", lr, lp, atol=1e-4, rtol=1e-4)
    assert_close("entropy", er, ent, atol=1e-4, rtol=1e-4)
    for name, out, ref in (("dhidden", h.grad, hr.grad), ("dweight", w.grad, wr.grad)):
        floor = _rel(ref.bfloat16(), ref)
        err = _rel(out, ref)
        assert err <= 2 * floor, f"{name}: relative error {err:.3e} > 2 x bf16 rounding of the reference {floor:.3e}"


def _head_peak_bound(t, h, v, chunk, ent_grad, impl) -> float:
    """Bytes the head may hold beyond its inputs. Triton path: forward = A [T, H] fp32 (two with
    the entropy gradient) + E [chunk, V] bf16 + the tile partials; backward = A + bf16 dh, then the
    bf16 dW + dh + a [T, vocab block] bf16 dz block (``_triton_vocab_block``: 32 Mi elements by default). Torch path: the bf16 dW, dh and their former fp32
    accumulators + 1.25 fp32 [chunk, V] buffers (the bound before the rewrite, kept)."""
    if impl == "triton":
        a = 4 * t * h * (2 if ent_grad else 1)
        fwd = a + 2 * chunk * v + 12 * chunk * -(-v // 128)
        bwd = max(a + 2 * t * h, 2 * v * h + 2 * t * h + 2 * t * _triton_vocab_block(t, v, chunk))
        return 1.05 * max(fwd, bwd) + 8 * 2**20
    return (v * h + t * h) * (2 + 4) + 1.25 * chunk * v * 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(_HEAD_VARIANTS))
@pytest.mark.parametrize("ent_grad", [False, True], ids=["logp", "logp+entropy"])
def test_chunked_head_peak_memory_bf16(ent_grad, variant):
    """Memory bound (not timing): fwd+bwd of the bf16 head allocates at most what its design holds
    (:func:`_head_peak_bound`); an fp32 [V, H] dW accumulator alone would exceed the Triton bound."""
    t, h, v, chunk = 8192, 1024, 65536, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(t, h, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, v, (t,), device="cuda", generator=g)
    parent = torch.arange(-1, t - 1, device="cuda")
    from harts.lm_head import head_edges

    kw = _HEAD_VARIANTS[variant]
    edges = head_edges(tokens, parent)
    lp, ent = tree_lm_head(hid[:2048], w, tokens[:2048], parent[:2048], chunk_size=chunk, entropy_requires_grad=ent_grad,
                           **kw)
    (lp.sum() + (ent.sum() if ent_grad else 0.0)).backward()  # warm-up (compiles / autotunes the kernels)
    hid.grad = w.grad = None
    del lp, ent
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = tree_lm_head(hid, w, tokens, parent, chunk_size=chunk, entropy_requires_grad=ent_grad, edges=edges, **kw)
    (lp.sum() + (ent.sum() if ent_grad else 0.0)).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = _head_peak_bound(t, h, v, chunk, ent_grad, "torch" if kw else "triton")
    assert peak <= bound, f"peak {peak / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("t", [120, 200], ids=lambda t: f"T{t}")
def test_flex_unaligned_strided_fp32(t):
    """FlexAttention with T % 128 != 0 and ``v`` sliced out of a fused QKV tensor (the layout of
    Megatron's GQA projection: per group [q, q, k, v] × head dim 16), fp32, vs the fp64 reference."""
    seqs = grpo_groups(2, prompt_len=t // 8, response_len=t // 16, n=3, vocab_size=50, seed=3)
    f = build_forest(seqs, device="cuda").padded(t)
    n = f.num_nodes
    assert n == t
    g = torch.Generator(device="cuda").manual_seed(0)
    mixed = torch.randn(n, 2, 4 * 16, device="cuda", generator=g)  # [T, groups, (2 q + k + v) · D]
    q = mixed[:, :, :32].reshape(n, 4, 16).clone().requires_grad_(True)
    k = mixed[:, :, 32:48].clone().requires_grad_(True)
    v_base = mixed.clone().requires_grad_(True)
    v = v_base[:, :, 48:]  # strides [128, 64, 1]: not contiguous
    out = tree_attention(q, k, v, last=f.last, backend="flex", block_mask=build_block_mask(f.last), scale=0.25)
    do = torch.randn(out.shape, device="cuda", generator=g)
    out.backward(do)
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention_reference(qr, kr, vr, last=f.last, scale=0.25)
    ref.backward(do.double())
    assert_close("flex out", ref, out, atol=2e-5, rtol=1e-4)
    assert_close("flex dq", qr.grad, q.grad, atol=1e-4, rtol=1e-4)
    assert_close("flex dv", vr.grad, v_base.grad[:, :, 48:], atol=1e-4, rtol=1e-4)


def _gather_plan():
    seqs = grpo_groups(2, prompt_len=300, response_len=90, n=16, vocab_size=1000, seed=2) + \
        caterpillar(1, turns=3, turn_len=50, branches=2, branch_len=30, vocab_size=1000, seed=3)
    f = build_forest(seqs, device="cuda")
    return f, build_varlen_plan(f.seg_offsets, f.seg_parent, mode="gather")


@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 128), (2, 2, 64), (6, 3, 40), (6, 2, 64)])
def test_gather_kv_triton_is_exact_copy(heads, kv_heads, dim):
    """The Triton key/value gather with head expansion equals ``index_select`` +
    ``repeat_interleave`` bit for bit, with ``v`` a strided slice of a fused QKV tensor, whatever
    the rows per program."""
    from harts.varlen import gather_kv, gather_kv_triton

    f, plan = _gather_plan()
    t, rep = f.num_nodes, heads // kv_heads
    mixed = torch.randn(t, kv_heads, (rep + 2) * dim, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    k = mixed[:, :, rep * dim:(rep + 1) * dim].contiguous()
    v = mixed[:, :, (rep + 1) * dim:]  # strides [(rep + 2)·Hkv·D, (rep + 2)·D, 1]
    kk, vv = gather_kv(k, v, plan.kv_index, heads)
    assert kk.shape == vv.shape == (plan.kv_index.numel(), heads, dim) and kk.is_contiguous()
    assert torch.equal(kk, k[plan.kv_index].repeat_interleave(rep, 1))
    assert torch.equal(vv, v[plan.kv_index].repeat_interleave(rep, 1))
    for rows in (1, 8):  # other launch shapes (the default is 4 rows per program)
        for a, b in zip(gather_kv_triton(k, v, plan.kv_index, heads, rows_per_program=rows), (kk, vv), strict=True):
            assert torch.equal(a, b), rows


@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 128), (2, 2, 64), (6, 3, 40), (6, 2, 64)])
def test_sum_kv_copies_triton_matches_fp64(heads, kv_heads, dim):
    """The gather's backward (Triton, fp32 registers, one bf16 rounding): each shared row's
    copies and each key head's query heads summed, against the fp64 sum of the same terms on a
    GRPO + caterpillar gather plan: within one bf16 rounding; a rerun gives the same bits."""
    from harts.varlen import sum_kv_copies, sum_row_copies_reference

    f, plan = _gather_plan()
    gen = torch.Generator(device="cuda").manual_seed(1)
    gk, gv = (torch.randn(plan.kv_index.numel(), heads, dim, device="cuda", generator=gen).bfloat16() for _ in "kv")
    dk, dv = sum_kv_copies(gk, gv, plan.copy_ptr, plan.copy_pos, kv_heads)
    for name, g, got in (("dk", gk, dk), ("dv", gv, dv)):
        ref = sum_row_copies_reference(g.double(), plan.kv_index, f.num_nodes, kv_heads)
        assert got.dtype == torch.bfloat16 and got.shape == (f.num_nodes, kv_heads, dim)
        assert_close(f"kv copies {name}", ref, got, atol=1e-5, rtol=1.01 * 2**-8)  # half a bf16 ulp + fp32 order
    assert all(torch.equal(a, b) for a, b in zip((dk, dv), sum_kv_copies(gk, gv, plan.copy_ptr, plan.copy_pos,
                                                                          kv_heads), strict=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save", [False, True], ids=["regather", "save_gathered_kv"])
def test_megatron_tree_varlen_bf16_as_close_as_thd(cpu_megatron, save):
    """bf16 model through the varlen gather plan (Triton gather and copy/head sum, flash kernels,
    Megatron recomputation): log-probs and every gradient are as close to fp32 per-sequence
    execution as bf16 THD packing through the same kernels is: tree error ≤ 3 × THD error (plus a
    floor of one bf16 ulp at 1). A wrong ancestor row or a lost copy gives O(1) errors."""
    from tests.harts.test_megatron import check_varlen_bf16

    check_varlen_bf16("cuda", save)


@pytest.mark.timeout(300)
def test_varlen_chain_forest_is_plain_thd_bf16():
    """A chain forest (THD packing / planner fallback) runs varlen without gathers, also with ``v``
    sliced out of a fused QKV tensor, and equals the fp64 dense reference."""
    from harts.forest import build_chain_forest

    seqs = grpo_groups(3, prompt_len=0, response_len=333, n=2, vocab_size=1000, seed=4)
    f = build_chain_forest(seqs, device="cuda").padded(16)
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent)
    assert plan.kv_index is None
    t = f.num_nodes
    g = torch.Generator(device="cuda").manual_seed(0)
    mixed = torch.randn(t, 2, 6 * 64, device="cuda", generator=g).bfloat16()  # per group [4 q, k, v] · D
    q = mixed[:, :, :256].reshape(t, 8, 64).clone().requires_grad_(True)
    k = mixed[:, :, 256:320].clone().requires_grad_(True)
    v_base = mixed.clone().requires_grad_(True)
    v = v_base[:, :, 320:]
    out = tree_attention(q, k, v, last=f.last, backend="varlen", varlen_plan=plan, scale=0.125)
    do = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    out.backward(do)
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = tree_attention_reference(qr, kr, vr, last=f.last, scale=0.125)
    ref.backward(do.double())
    assert_close("varlen out", ref, out, atol=1e-2, rtol=1e-2)
    assert_close("varlen dk", kr.grad, k.grad, atol=3e-2, rtol=2e-2)
    assert_close("varlen dv", vr.grad, v_base.grad[:, :, 320:], atol=3e-2, rtol=2e-2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_head_and_label_gathers_do_not_sync(impl):
    """With the metadata built ahead (``head_edges``), the head's forward/backward (both
    implementations) and the per-sequence gathers issue no device-to-host synchronization."""
    from harts.lm_head import head_edges
    from harts.loss import sequence_entropy, sequence_logprobs

    seqs = grpo_groups(2, prompt_len=100, response_len=60, n=4, vocab_size=4000, seed=6)
    f = build_forest(seqs, device="cuda").padded(16)
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(f.num_nodes, 128, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (0.05 * torch.randn(4000, 128, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    edges = head_edges(f.tokens, f.parent)
    lp, ent = tree_lm_head(h, w, f.tokens, f.parent, chunk_size=128, entropy_requires_grad=True, edges=edges, impl=impl)
    (lp.sum() + ent.sum()).backward()  # warm-up before checking
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = tree_lm_head(h, w, f.tokens, f.parent, chunk_size=128, entropy_requires_grad=True, edges=edges,
                               impl=impl)
        loss = sequence_logprobs(lp, f).sum() + 0.1 * sequence_entropy(ent, f).sum()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ent_grad", [False, True], ids=["logp", "logp+entropy"])
def test_fused_head_fp64(ent_grad):
    """The compiled (fused) chunk kernels in fp64 equal the full-logits reference at 1e-12, with a
    temperature and a short last chunk."""
    f = build_forest([list(range(1, 300)), list(range(1, 120)) + [900, 901], [5, 6, 7]], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(f.num_nodes, 16, device="cuda", generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1000, 16, device="cuda", generator=g, dtype=torch.float64, requires_grad=True)
    lp, en = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=128, temperature=0.7, entropy_requires_grad=ent_grad,
                          fused=True)
    c = torch.randn(lp.shape, device="cuda", generator=g, dtype=torch.float64)
    obj = (lp * c).sum() + ((en * c.flip(0)).sum() if ent_grad else 0.0)
    dh, dw = torch.autograd.grad(obj, [hid, w])
    hr, wr = hid.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    lr, er = tree_head_reference(hr, wr, f.tokens, f.parent, temperature=0.7)
    obj_r = (lr * c).sum() + ((er * c.flip(0)).sum() if ent_grad else 0.0)
    dh_r, dw_r = torch.autograd.grad(obj_r, [hr, wr])
    for name, a, b in (("logp", lr, lp), ("entropy", er, en), ("dhidden", dh_r, dh), ("dweight", dw_r, dw)):
        assert_close(f"fused {name}", a, b, atol=1e-12, rtol=1e-12)


def test_direct_flash_calls_equal_torch_varlen_attn():
    """harts calls aten's flash varlen kernels without ``torch.nn.attention.varlen``'s custom-op
    layer: the output and ``dk, dv`` must be bitwise those of the public ``varlen_attn``, for the
    chain-forest path (plain causal THD) and the plan-level calls. ``dq`` is accumulated with
    atomics by FlashAttention-2's backward (the order varies from run to run, torch's own
    reruns included): it must agree to within one bf16 ulp of its largest entry."""
    from torch.nn.attention.varlen import varlen_attn

    from harts.varlen import attention_backward, attention_with_lse, varlen_tree_attention

    torch.manual_seed(0)
    lens = [700, 1, 129, 2048, 333]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, mx = int(cu[-1]), max(lens)
    q = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16)
    ref = varlen_attn(q, k, v, cu, cu, mx, mx, scale=0.0883, window_size=(-1, 0))
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    rerun = torch.autograd.grad(varlen_attn(q, k, v, cu, cu, mx, mx, scale=0.0883, window_size=(-1, 0)), q, do)[0]
    print(f"\ntorch's own dq rerun: max |diff| {(rerun.float() - ref_grads[0].float()).abs().max().item():.3e}")

    def check(out, grads):
        assert torch.equal(out, ref)
        dq_err = ((grads[0].float() - ref_grads[0].float()).abs().max() / ref_grads[0].float().abs().max()).item()
        assert dq_err <= 2 ** -7, dq_err  # one bf16 ulp of the largest entry
        assert torch.equal(grads[1], ref_grads[1]) and torch.equal(grads[2], ref_grads[2])

    plan = build_varlen_plan(cu.cpu(), torch.full((len(lens),), -1), device="cuda")
    assert plan.kv_index is None  # a forest of chains: the plain THD call
    out = varlen_tree_attention(q, k, v, plan=plan, scale=0.0883)
    check(out, torch.autograd.grad(out, (q, k, v), do))
    with torch.no_grad():
        o, lse = attention_with_lse(q, k, v, cu, cu, mx, mx, causal=True, scale=0.0883)
        check(o, attention_backward(do, q, k, v, o, lse, cu, cu, mx, mx, causal=True, scale=0.0883))
