"""Runs the Triton kernels of the LM head (:mod:`harts.lm_head_triton`) under Triton's CPU
interpreter. Started by ``tests/harts/test_lm_head.py`` in a subprocess with ``TRITON_INTERPRET=1``
(set before Triton is imported); prints one JSON line with, per check, the largest error relative
to the reference's scale (``max |out − ref| / max(max |ref|, 1e-300)``):

* ``kernel …``: each Triton kernel against its plain-torch reference (same contract, same inputs) in
  fp64, fp32 and bf16 (the GEMM kernels in each variant the GPU's autotuner chooses among), on a forest with forks, a vocabulary shard that some targets fall outside of,
  ``H`` and ``V`` that are not multiples of the tiles, and in fp64 and bf16 again with ``V`` a
  multiple of the forward's 128-column tile (its epilogue without column masks);
* ``head …``: :func:`harts.lm_head.tree_lm_head` with ``impl="triton"`` in fp64 against the
  full-logits reference (forward and backward), with and without a differentiable entropy, several
  chunk sizes and vocabulary blocks, a temperature; and in bf16 (relative Frobenius errors);
* ``tp2 …``: the same at TP = 2 on two gloo ranks (vocabulary shards, all-reduced statistics).
"""

from __future__ import annotations

import json
import sys

import torch

from harts import lm_head_triton as tri
from harts.forest import build_forest
from harts.lm_head import tree_lm_head
from harts.reference import tree_head_reference

SEQS = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [5, 6, 7, 13], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 8, 10],
        [1, 2, 12], [3, 4, 5, 6], [3, 4, 5, 6], [9, 3, 4, 5], [4, 4, 4, 4], [2, 5], [250, 251, 1, 299, 298]]


# the GEMM kernels' variants (harts.lm_head_triton._MM_CONFIGS): pointer loads, one program per tile
# (the interpreter's default tiles); tensor descriptors (TMA); persistent programs walking the tiles
# (fewer programs than tiles, so each takes several, and a repeated last one), with and without TMA
VARIANTS = {"": None, " tma": {"BM": 16, "BK": 8, "TMA": True},
            " persistent": {"BM": 32, "BK": 16, "PERSIST": True, "NP": 3},
            " tma-persistent": {"BM": 16, "BK": 16, "TMA": True, "PERSIST": True, "FLAT": True, "NP": 4},
            " tma-store": {"BM": 16, "BK": 16, "TMA": True, "OSTORE": True},
            " tma-persistent-store": {"BM": 32, "BK": 8, "TMA": True, "OSTORE": True, "PERSIST": True, "NP": 3}}


def _err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / max(float(ref.abs().max()), 1e-300)) if ref.numel() else 0.0


def _frob(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def kernels(dtype: torch.dtype, v: int = 300) -> dict[str, float]:
    """``v = 300``: the last vocabulary tile is partial (masked columns); ``v = 256``: two whole tiles."""
    f = build_forest([[t * 37 % 500 for t in s] for s in SEQS])
    g = torch.Generator().manual_seed(0)
    t, hd, v0 = f.num_nodes, 24, 100  # shard [100, 100 + v) of a 500-token vocabulary
    h = torch.randn(t, hd, generator=g, dtype=torch.float64).to(dtype)
    w = (0.7 * torch.randn(v, hd, generator=g, dtype=torch.float64)).to(dtype)
    from harts.lm_head import head_edges

    ed = head_edges(f.tokens, f.parent)
    row_ptr, tok = ed.row_ptr, (ed.token - v0).to(torch.int32)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inv = torch.full((1,), 1 / 0.7, dtype=acc)
    out = {}
    tgt_r = torch.zeros(tok.numel(), dtype=acc)
    er, pmr, psr, pqr = tri.logit_tiles_reference(h, w, row_ptr, tok, tgt_r, inv)
    for variant, cfg in VARIANTS.items():  # H = 24: 16-byte aligned rows in every dtype, so TMA applies
        tgt = torch.zeros(tok.numel(), dtype=acc)
        e, pm, ps, pq = tri.logit_tiles(h, w, row_ptr, tok, tgt, inv, config=cfg and {**cfg, "BN": 16})
        for name, a, b in (("E", e, er), ("m", pm, pmr), ("S", ps, psr), ("Q", pq, pqr), ("tgt", tgt, tgt_r)):
            out[f"kernel logit_tiles{variant} {name}"] = _err(a, b)
    m, se, es = tri.combine_tiles(pm, ps, pq)
    for name, a, b in zip("MSQ", (m, se, es), tri.combine_tiles_reference(pm, ps, pq), strict=True):
        out[f"kernel combine {name}"] = _err(a, b)
    lse, ent = m + torch.log(se), torch.log(se) - es / se
    lse_f, ent_f = torch.empty_like(lse), torch.empty_like(ent)
    tri.combine_tiles(pm, ps, pq, lse=lse_f, ent=ent_f)
    out["kernel combine lse"], out["kernel combine entropy"] = _err(lse_f, lse), _err(ent_f, ent)
    p_ref = tri.scale_tiles_reference(e, pm, lse, ent)
    out["kernel scale_tiles p"] = _err(tri.scale_tiles(e.clone(), pm, lse, ent), p_ref)
    out["kernel scale_tiles entropy"] = _err(tri.scale_tiles(p_ref.clone(), pm, lse, ent, entropy=True),
                                             tri.scale_tiles_reference(p_ref, pm, lse, ent, entropy=True))
    out.update(_ref_kernels(h, w, row_ptr, tok, inv, e, pm, ps, pq, lse))
    a_, a_ent = torch.randn(2, t, hd, generator=g, dtype=torch.float64).to(acc)
    g_edge, g_ent = torch.randn(tok.numel(), generator=g, dtype=torch.float64).to(acc), torch.randn(
        t, generator=g, dtype=torch.float64).to(acc)
    for with_ent in (False, True):
        dh, gs = torch.empty(t, hd, dtype=dtype), torch.empty(t, dtype=acc)
        ae, ge = (a_ent, g_ent) if with_ent else (None, None)
        tri.hidden_grad(a_, ae, lse, ent, ge, row_ptr, tok, g_edge, tgt, w, inv, dh, gs)
        dh_r, gs_r = tri.hidden_grad_reference(a_, ae, lse, ent, ge, row_ptr, tok, g_edge, tgt, w, inv)
        out[f"kernel hidden_grad ent={with_ent}"] = _err(dh, dh_r)
        out[f"kernel hidden_grad G ent={with_ent}"] = _err(gs, gs_r)
        if not with_ent:  # A given as E W of logit_tiles(ref=...) and its row factor
            sc = torch.rand(t, generator=g, dtype=torch.float64).to(acc)
            tri.hidden_grad(a_, None, lse, ent, None, row_ptr, tok, g_edge, tgt, w, inv, dh, gs, scale=sc)
            dh_r, _ = tri.hidden_grad_reference(a_, None, lse, ent, None, row_ptr, tok, g_edge, tgt, w, inv, scale=sc)
            out["kernel hidden_grad ent=False scaled A"] = _err(dh, dh_r)
        for c0, nb in ((0, 128), (128, 100), (v - 50, 50)):
            ref = tri.logit_grad_reference(h, w[c0:c0 + nb], c0, lse, gs_r, ge, ent, row_ptr, tok, g_edge, inv)
            for variant, cfg in VARIANTS.items():
                out_buf = torch.empty(t, -(-nb // 8) * 8, dtype=dtype)[:, :nb]  # 16-byte aligned rows (TMA)
                dz = tri.logit_grad(h, w[c0:c0 + nb], c0, lse, gs, ge, ent, row_ptr, tok, g_edge, inv, out_buf,
                                    config=cfg and {**cfg, "BN": 32})
                out[f"kernel logit_grad{variant} ent={with_ent} cols {c0}+{nb}"] = _err(dz, ref)
    return {f"{k} {str(dtype)[6:]}" + ("" if v == 300 else f" V={v}"): val for k, val in out.items()}


def _ref_kernels(h, w, row_ptr, tok, inv, e_plain, pm_plain, ps, pq, lse) -> dict[str, float]:
    """The row-reference path: :func:`target_logit_max`, ``logit_tiles(ref=)`` and ``combine_tiles``
    writing the row factor (and rescaling the rows it must) against their references, and the
    product ``scale · E`` against the probabilities of the per-tile path (``scale_tiles``), at the
    default slack (every row within it here) and at slack 12 (rows of both kinds)."""
    out = {}
    acc = pm_plain.dtype
    ref = tri.target_logit_max(h, w, row_ptr, tok, inv)
    ref_r = tri.target_logit_max_reference(h, w, row_ptr, tok, inv)
    fin = torch.isfinite(ref_r)
    out["kernel target_logit_max"] = _err(ref[fin], ref_r[fin])
    out["kernel target_logit_max rows without a target"] = float(not torch.equal(torch.isfinite(ref), fin))
    p_plain = tri.scale_tiles_reference(e_plain, pm_plain, lse, None)
    for slack in (None, 12.0):
        tag = f"slack={slack or tri.REF_SLACK:g}"
        tgt_r = torch.zeros(tok.numel(), dtype=acc)
        er = tri.logit_tiles_reference(h, w, row_ptr, tok, tgt_r, inv, ref=ref, slack=slack)[0]
        for variant in ("", " tma-persistent-store"):
            cfg = VARIANTS[variant]
            tgt = torch.zeros(tok.numel(), dtype=acc)
            e, pm, _, _ = tri.logit_tiles(h, w, row_ptr, tok, tgt, inv, ref=ref, slack=slack,
                                          config=cfg and {**cfg, "BN": 16})
            out[f"kernel logit_tiles ref{variant} {tag} E "] = _err(e, er)
        lse_f, ent_f, sc = (torch.empty(h.shape[0], dtype=acc) for _ in range(3))
        e_fix, sc_r = tri.combine_scale_reference(e, pm, lse, ref, slack)
        tri.combine_tiles(pm, ps, pq, lse=lse_f, ent=ent_f, e=e, ref=ref, scale=sc, slack=slack)
        out[f"kernel combine ref {tag} lse"] = _err(lse_f, lse)
        out[f"kernel combine ref {tag} E "] = _err(e, e_fix)
        out[f"kernel combine ref {tag} scale"] = _err(sc, sc_r)
        # P = scale · E is the per-tile path's P on every row with a target (the rows whose A is used)
        out[f"kernel combine ref {tag} P as scale_tiles"] = _err(sc[fin, None] * e[fin].to(acc), p_plain[fin].to(acc))
        fixed = int(((sc == 1.0) & fin).sum())
        if slack is not None:  # this forest at slack 12: rows rescaled in place and rows left to the factor
            out[f"kernel combine ref {tag} both kinds of rows"] = float(not 0 < fixed < int(fin.sum()))
    return out


def _head_case(f, *, v, hd, dtype, chunk, vocab_block, temp, ent_grad, seed=0, tp_group=None, rank=0, world=1,
               sum_objective=False):
    """(errors of logp, entropy, dhidden, dweight) of the Triton head against the fp64 full-logits reference."""
    g = torch.Generator().manual_seed(seed)
    t = f.num_nodes
    hid = torch.randn(t, hd, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w_full = (0.5 * torch.randn(v, hd, generator=g, dtype=torch.float64)).to(dtype)
    vl = v // world
    w = w_full[rank * vl:(rank + 1) * vl].clone().requires_grad_(True)
    if sum_objective:  # autograd hands the gradients of .sum() over as expanded (stride-0) tensors
        c_lp, c_en = (torch.ones(1, dtype=torch.float64).expand(t) for _ in range(2))
    else:
        c_lp, c_en = (torch.randn(t, generator=g, dtype=torch.float64) for _ in range(2))
    lp, en = tree_lm_head(hid, w, f.tokens, f.parent, chunk_size=chunk, temperature=temp, entropy_requires_grad=ent_grad,
                          impl="triton", vocab_block=vocab_block, tp_group=tp_group)
    obj = (lp.double() * c_lp).sum() + ((en.double() * c_en).sum() if ent_grad else 0.0)
    if sum_objective:
        obj = lp.sum() + (en.sum() if ent_grad else 0.0)
    dh, dw = torch.autograd.grad(obj, [hid, w])
    hr, wr = hid.detach().double().requires_grad_(True), w_full.double().requires_grad_(True)
    lr, er = tree_head_reference(hr, wr, f.tokens, f.parent, temperature=temp)
    obj_r = (lr * c_lp).sum() + ((er * c_en).sum() if ent_grad else 0.0)
    dh_r, dw_r = torch.autograd.grad(obj_r, [hr, wr])
    dw_r = dw_r[rank * vl:(rank + 1) * vl]
    err = _err if dtype == torch.float64 else _frob
    return err(lp, lr), err(en, er), err(dh, dh_r), err(dw, dw_r)


def heads() -> dict[str, float]:
    out = {}
    f = build_forest(SEQS)
    for chunk, vb, ent_grad in ((7, 16, True), (4096, 128, True), (1, None, False), (16, 48, False)):
        e = _head_case(f, v=301, hd=20, dtype=torch.float64, chunk=chunk, vocab_block=vb, temp=0.7, ent_grad=ent_grad)
        for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
            out[f"head fp64 chunk={chunk} vb={vb} ent_grad={ent_grad} {name}"] = val
    # H a multiple of the K tile (no masked loads), several chunks, the gradients of .sum()
    e = _head_case(f, v=301, hd=32, dtype=torch.float64, chunk=8, vocab_block=64, temp=1.0, ent_grad=True,
                   sum_objective=True)
    for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
        out[f"head fp64 sum-objective H=32 {name}"] = val
    # the same through the persistent TMA kernels with bulk output stores (what the GPU's autotuner may pick)
    default = tri._INTERPRET_CONFIG
    tri._INTERPRET_CONFIG = {"BM": 16, "BN": 32, "BK": 16, "TMA": True, "OSTORE": True, "PERSIST": True, "FLAT": True,
                             "NP": 3}
    try:
        e = _head_case(f, v=301, hd=32, dtype=torch.float64, chunk=24, vocab_block=96, temp=0.8, ent_grad=True)
    finally:
        tri._INTERPRET_CONFIG = default
    for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
        out[f"head fp64 tma-persistent H=32 {name}"] = val
    e = _head_case(f, v=301, hd=20, dtype=torch.bfloat16, chunk=16, vocab_block=128, temp=1.0, ent_grad=True)
    for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
        out[f"head bf16 {name}"] = val
    # without an entropy gradient E is stored relative to each row's target logit; rows whose maximum
    # is more than REF_SLACK above it are rescaled in the combine: slack 7 (both kinds of rows) and
    # -1 (every row rescaled), fp64 and bf16
    default = tri.REF_SLACK
    for slack in (7.0, -1.0):
        tri.REF_SLACK = slack
        try:
            for dtype in (torch.float64, torch.bfloat16):
                e = _head_case(f, v=301, hd=20, dtype=dtype, chunk=16, vocab_block=64, temp=0.8, ent_grad=False)
                for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
                    out[f"head {'fp64' if dtype == torch.float64 else 'bf16'} slack={slack:g} {name}"] = val
        finally:
            tri.REF_SLACK = default
    return out


def _tp_body(rank, world):
    import torch.distributed as dist

    f = build_forest(SEQS)
    return _head_case(f, v=302, hd=20, dtype=torch.float64, chunk=8, vocab_block=64, temp=0.9, ent_grad=True,
                      tp_group=dist.group.WORLD, rank=rank, world=world)


def main(payload: dict) -> dict[str, float]:
    out = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        out.update(kernels(dtype))
    for dtype in (torch.float64, torch.bfloat16):
        out.update(kernels(dtype, v=256))
    out.update(heads())
    if payload.get("tp2", True):
        from mcore_distill.testing import run_ranks

        for rank, e in enumerate(run_ranks(_tp_body, 2, timeout=500)):
            for name, val in zip(("logp", "entropy", "dhidden", "dweight"), e, strict=True):
                out[f"tp2 rank{rank} {name}"] = val
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})))
