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


def test_forward_row_chunks_fold_a_short_tail():
    """A last chunk shorter than chunk/8 joins the one before (4,099 rows: four chunks, not a
    fifth of 3 rows that reads all of W twice); the head stays exact across the joined chunk."""
    from harts.lm_head import _row_chunks

    assert _row_chunks(4099, 1024) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4099)]
    assert _row_chunks(16384, 1024)[-1] == (15360, 16384) and len(_row_chunks(16384, 1024)) == 16
    assert _row_chunks(4224, 1024)[-1] == (4096, 4224)  # 128 rows = chunk / 8: its own chunk
    assert _row_chunks(10, 16) == [(0, 10)] and _row_chunks(0, 4) == []
    assert _row_chunks(18, 7) == [(0, 7), (7, 14), (14, 18)]
    for t, c in ((4099, 1024), (33, 16), (200, 64), (1, 1)):  # a partition of [0, t)
        ch = _row_chunks(t, c)
        assert ch[0][0] == 0 and ch[-1][1] == t and all(a[1] == b[0] for a, b in zip(ch, ch[1:], strict=False))
        assert all(r1 - r0 <= c + c // 8 for r0, r1 in ch)
    f = build_chain_forest([list(range(3, 20)), list(range(5, 21))])  # 33 rows: chunks of 16 and 17
    assert f.num_nodes == 33
    compare_head(f, v=37, chunk=16, temp=0.8, ent_grad=True, dtype=torch.float64, tol=1e-12)


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


class _LargeLiveBytes:
    """TorchDispatchMode that tracks the peak total size of live storages of at least
    ``min_bytes`` created inside it (views and in-place results share their storage)."""

    def __init__(self, min_bytes):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.min_bytes, self.live, self.peak, self.sizes = min_bytes, {}, 0, []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(out)
                return out

        self.mode = Mode()

    def _see(self, out):
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.nbytes() >= self.min_bytes and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.sizes.append(tuple(t.shape))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(b for _, b in self.live.values()))


@pytest.mark.parametrize("ent_grad", [False, True], ids=["logp", "logp+entropy"])
def test_head_keeps_one_chunk_alive(ent_grad):
    """Structural memory bound: during forward and backward, live tensors of ≥ 1/16 of a
    [chunk, V] buffer never sum to more than 1.25 chunks (target: one chunk + O(chunk) vectors).
    H is tiny so the [V, H] weight-gradient accumulator stays below the tracking threshold."""
    t, h, v, chunk = 200, 2, 3001, 64
    f = build_chain_forest([list(range(1, 120)), list(range(7, 88))])
    assert f.num_nodes == t
    g = torch.Generator().manual_seed(3)
    hid = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    chunk_bytes = chunk * v * 8
    probe = _LargeLiveBytes(chunk_bytes // 16)
    with probe.mode:
        lp, en = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=chunk, temperature=0.9,
                              entropy_requires_grad=ent_grad)
        (lp.sum() + (en.sum() if ent_grad else 0.0)).backward()
    assert any(s == (chunk, v) for s in probe.sizes), f"no chunk buffer seen: {probe.sizes}"
    assert probe.peak <= 1.25 * chunk_bytes, f"peak live large tensors {probe.peak / chunk_bytes:.2f} chunks"
    # the same probe sees the full-logits reference hold several [T, V] tensors (the check can fail)
    probe_ref = _LargeLiveBytes(chunk_bytes // 16)
    with probe_ref.mode:
        lr, er = tree_head_reference(hid, w, f.tokens, f.parent, temperature=0.9)
        (lr.sum() + er.sum()).backward()
    assert probe_ref.peak > 4 * chunk_bytes


@pytest.mark.parametrize("in_place", [False, True], ids=["product-slices", "in-place-addmm"])
def test_chunked_head_bf16_vocab_slices(in_place, monkeypatch):
    """bf16 weights take the vocab-sliced gradient path (dz rounded to bf16 slice by slice, fp32
    accumulators): several slices per chunk, compared with the fp64 head on the same bf16 values.
    ``in_place``: the CUDA branch that accumulates with ``addmm(out_dtype=float32, out=acc)``,
    here with that one call emulated on CPU (fp32 product of the bf16 operands, added in place)."""
    import harts.lm_head as lm

    if in_place:
        monkeypatch.setattr(lm, "_use_inplace_accumulation", lambda h, w: h.dtype == torch.bfloat16)
        monkeypatch.setattr(lm, "_addmm_fp32_", lambda acc, a, b: acc.add_(a.float() @ b.float()))
    f = build_forest([list(range(1, 30)), list(range(1, 12)) + [40, 41, 42], [7, 8, 9]])
    t, h, v, chunk = f.num_nodes, 8, 1000, 16
    assert -(-v // lm._vocab_slice(chunk, v, h, in_place)) >= 4  # at least four slices
    g = torch.Generator().manual_seed(5)
    hid = torch.randn(t, h, generator=g).bfloat16().requires_grad_(True)
    w = (0.5 * torch.randn(v, h, generator=g)).bfloat16().requires_grad_(True)
    lp, en = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=chunk, entropy_requires_grad=True)
    (lp.sum() + 0.5 * en.sum()).backward()
    hr, wr = hid.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    lr, er = tree_head_reference(hr, wr, f.tokens, f.parent)
    (lr.sum() + 0.5 * er.sum()).backward()
    assert_close("logp", lr, lp, atol=1e-4, rtol=1e-4)  # fp32 softmax math on exact bf16 products
    assert_close("entropy", er, en, atol=1e-4, rtol=1e-4)
    for name, ref, out in (("dhidden", hr.grad, hid.grad), ("dweight", wr.grad, w.grad)):
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 8e-3, f"{name}: relative Frobenius error {rel:.2e} (bf16 rounding of dz and the result)"


def _interpreter_bound(name: str) -> float:
    """Tolerance of one check of ``lm_head_interpret`` (error relative to the reference's scale)."""
    if "float64" in name or "fp64" in name or name.startswith("tp2"):
        return 1e-12  # same math in fp64
    if "float32" in name:
        return 1e-5  # fp32 accumulation order
    if name.startswith("head bf16"):
        # relative Frobenius: fp32 softmax math; gradients rounded to bf16 (as the torch path's test)
        return 1e-5 if name.endswith(("logp", "entropy")) else 8e-3
    if any(k in name for k in (" E ", "scale_tiles", "hidden_grad ent", "logit_grad")):
        return 1e-2  # outputs rounded to bf16: one bf16 ulp of the largest value is <= 2^-7
    return 1e-5  # fp32 statistics of exact bf16 products


def test_triton_kernels_under_interpreter():
    """The Triton kernels of the head (``impl="triton"``) under Triton's CPU interpreter: each
    kernel vs its plain-torch reference (fp64, fp32, bf16), the whole head vs the full-logits
    reference in fp64 (trees with forks, chunk sizes, vocabulary blocks, entropy gradient,
    temperature) and in bf16, and at TP = 2 on two gloo ranks."""
    from tests.harts.interpreter import run_interpreted

    out = run_interpreted("lm_head_interpret", {"tp2": True})
    assert any(k.startswith("tp2") for k in out) and any(k.startswith("head fp64") for k in out)
    bad = {k: v for k, v in out.items() if not v <= _interpreter_bound(k)}
    assert not bad, f"beyond tolerance: {bad}"


def test_triton_backward_vocab_block_keeps_dz_size_not_width():
    """The Triton backward's default block: 2048 columns at 16,384 rows, wider for fewer rows (the
    ``[T, block]`` dz buffer stays at 32 Mi elements, so small tree micro-batches pay 20 host launch
    pairs at V = 151,936 instead of 75), capped by a forward chunk; an explicit block is kept."""
    from harts.lm_head import _triton_vocab_block

    v = 151936
    assert _triton_vocab_block(16384, v, 1024) == 2048
    assert _triton_vocab_block(32768, v, 1024) == 2048  # never narrower than 2048 by default
    assert _triton_vocab_block(4099, v, 1024) == 7936
    assert -(-v // _triton_vocab_block(4099, v, 1024)) == 20
    for t in (1, 100, 3000, 4099, 9000, 16384):
        vb = _triton_vocab_block(t, v, 1024)
        assert vb % 256 == 0 or vb == v
        assert t * vb <= max(2048 * 16384, 2048 * t) and t * vb <= 1024 * v
    assert _triton_vocab_block(8, v, 1024) == v  # a block wider than the vocabulary is the vocabulary
    assert _triton_vocab_block(4099, v, 1024, vocab_block=1024) == 1024
    assert _triton_vocab_block(16384, 4096, 64) == 128  # the forward chunk's cap (64 · 4096 / 16384 -> 128)
