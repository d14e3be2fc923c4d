"""Triton kernels of :func:`harts.lm_head.tree_lm_head` (``impl="triton"``), each with a
plain-torch reference of the same contract (``*_reference``) that the tests compare it with.

Rows ``u`` of ``h [n, H]``, a vocabulary shard ``W [V, H]`` (local ids), ``s = h Wᵀ / τ``.
The children ``c`` of row ``u`` are the edges ``row_ptr[u] <= c < row_ptr[u + 1]`` (a CSR sorted
by parent row); ``tok[c]`` is the child's token as a local id (outside ``[0, V)``: another shard).

* :func:`logit_tiles` (forward GEMM, statistics in its epilogue): per row and vocabulary tile
  ``t`` of ``BN`` columns, ``m_t = max s``, ``S_t = Σ e`` and ``Q_t = Σ e (s − m_t)`` with
  ``e = exp(s − m_t)``; the target logits ``s[u, tok[c]]``; and ``E = e`` in the model dtype with
  the target columns set to 0. No fp32 logits leave the chip.
* :func:`combine_tiles`: ``M = max_t m_t``, ``S = Σ_t e^{m_t − M} S_t``,
  ``Q = Σ_t e^{m_t − M} (Q_t + (m_t − M) S_t)``, so ``lse = M + log S`` and
  ``H = log S − Q / S`` (the entropy).
* :func:`scale_tiles` (in place on ``E``, memory-bound): ``P = E · e^{m_t − lse}``, the
  probabilities without the target columns, or for the entropy gradient ``P (log P + H)``; the
  caller forms ``A = P W`` with one cuBLAS GEMM (fp32 output). (A Triton GEMM that applied the
  scale in its prologue, to the A operand in registers before ``wgmma``, ran 17× slower than
  this pair on an H200 and was dropped.)
* Without that pass (the head's default: unsharded, no entropy gradient): :func:`target_logit_max`
  gives each row a reference ``r_u``, the largest logit of its targets, and ``logit_tiles(ref=)``
  stores ``E = e^{s − r_u}`` in every tile whose maximum is within :data:`REF_SLACK` of it
  (``e^{s − m_t} · e^{m_t − r_u}``: one multiply, no second exp). Then ``P_u = e^{r_u − lse_u} E_u``
  is one factor per row, which :func:`combine_tiles` writes and :func:`hidden_grad` applies to
  ``A = E W``; a row with a tile above ``r_u + REF_SLACK`` (its targets more than 60 nats below its
  maximum) is rescaled to ``P`` in place by the combine instead. This saves a read and a write of
  ``[T, V]`` values (2.5 ms at T = 16,384, V = 151,936 on an H200).
* :func:`hidden_grad`: ``dh_u = (Σ_c coef_c W[tok_c] − G_u A_u − g^H_u A^H_u) / τ`` with
  ``G_u = Σ_c g_c`` and ``coef_c = g_c − G_u p_c − g^H_u p_c (log p_c + H_u)``: the target
  columns enter with their exact fp32 coefficient, so ``1 − p`` never cancels in a rounded sum.
* :func:`logit_grad` (backward GEMM, gradient in its epilogue), for one vocabulary block:
  ``dz = (Σ_c g_c [v = tok_c] − p (G + g^H (log p + H))) / τ`` rounded once to the model dtype;
  the caller forms ``dW_block = dzᵀ h`` as one GEMM over all rows.

Accumulation is fp32 for 16/32-bit inputs and fp64 for fp64 (the CPU interpreter tests). The GEMM
loop bound ``H`` is a compile-time constant (one compilation per hidden width). The two GEMM kernels
come in two families with identical arithmetic (the same products in the same order): pointer loads
with one program per tile, and tensor-descriptor loads (TMA on Hopper, where operand rows and
columns are 16-byte aligned), mostly persistent (one program per SM walking the tiles, the loop
over tiles and ``K`` software-pipelined as one, so the next tile's loads overlap this tile's
epilogue). On CUDA the autotuner times both families' configurations on first use per shape and
keeps the fastest (:func:`tuning_record` lists the times).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["REF_SLACK", "TILE_N", "logit_tiles", "combine_tiles", "target_logit_max", "scale_tiles", "hidden_grad",
           "logit_grad", "logit_tiles_reference", "combine_tiles_reference", "combine_scale_reference",
           "target_logit_max_reference", "scale_tiles_reference", "hidden_grad_reference", "logit_grad_reference",
           "tuned_config", "tuning_record"]

TILE_N = 128
"""Vocabulary columns per forward tile: the granularity of the partial softmax statistics."""

REF_SLACK = 60.0
"""With row references ``r`` (:func:`logit_tiles` ``ref=``), a tile whose maximum ``m_t`` is at most
``r + REF_SLACK`` stores ``E = e^{s − r}``: entries up to ``e^60`` (bf16 and the fp32 sum ``E W``
over 151,936 columns stay finite), entries below ``e^{−87}`` of ``r`` flush to 0 as before."""


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _cast(x, dtype: tl.constexpr, low: tl.constexpr):
    if low:  # round to nearest even, also under the CPU interpreter (which truncates by default)
        return x.to(dtype, fp_downcast_rounding="rtne")
    return x.to(dtype)


@triton.jit
def _x_wt(X, W, rows, cols, stride_x, stride_w, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):
    """``X[rows] @ W[cols]ᵀ`` as a ``[BM, BN]`` accumulator (rows, cols already clamped in range)."""
    ks = tl.arange(0, BK)
    xp = X + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    wp = W + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BM, BN], ACC)
    for k0 in range(0, H, BK):
        if H % BK == 0:
            x = tl.load(xp)
            w = tl.load(wp)
        else:
            km = ks[None, :] < H - k0
            x = tl.load(xp, mask=km, other=0.0)
            w = tl.load(wp, mask=km, other=0.0)
        if F32:  # the CPU interpreter multiplies 16-bit floats as integers: exact fp32 products instead
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC, out_dtype=ACC)
        xp += BK
        wp += BK
    return acc


@triton.jit
def _x_wt_tma(XD, WD, off_m, off_n, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              ACC: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):
    """``X[off_m : off_m + BM] @ W[off_n : off_n + BN]ᵀ`` through tensor descriptors (TMA on Hopper:
    rows and columns outside the tensors load as 0, so no masks and no clamping)."""
    acc = tl.zeros([BM, BN], ACC)
    for k0 in range(0, H, BK):
        x = XD.load([off_m, k0])
        w = WD.load([off_n, k0])
        if F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC, out_dtype=ACC)
    return acc


@triton.jit
def _logit_tile(pid_m, pid_n, X, W, XD, WD, OD, E, PM, PS, PQ, TGT, PTR, TOK, REF, SLACK, n, V, INV, stride_x,
                stride_w, stride_e, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                ACC: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr, STORE_E: tl.constexpr, F32: tl.constexpr,
                TMA: tl.constexpr, OSTORE: tl.constexpr, EVEN: tl.constexpr, HAS_REF: tl.constexpr):
    """One ``[BM, BN]`` tile of :func:`logit_tiles`: GEMM, then the statistics in the epilogue
    (``EVEN``: ``V`` is a multiple of ``BN``, no column is masked; ``HAS_REF``: ``E`` relative to
    the rows' references where the tile's maximum is within ``SLACK`` of them)."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < n
    cmask = cols < V
    if TMA:
        acc = _x_wt_tma(XD, WD, pid_m * BM, pid_n * BN, H, BM, BN, BK, ACC, PREC, F32)
    else:
        acc = _x_wt(X, W, tl.minimum(rows, n - 1), tl.minimum(cols, V - 1), stride_x, stride_w, H, BM, BN, BK, ACC,
                    PREC, F32)
    if EVEN:
        s = acc * tl.load(INV)
    else:
        s = tl.where(cmask[None, :], acc * tl.load(INV), float("-inf"))
    m = tl.max(s, 1)
    sm = s - m[:, None]
    e = tl.exp(sm)
    tot = tl.sum(e, 1)
    if EVEN:
        q = tl.sum(e * sm, 1)
    else:
        q = tl.sum(tl.where(cmask[None, :], e * sm, 0.0), 1)
    # targets: store their logits and drop them from E (their gradient is formed exactly elsewhere);
    # a tile holds the target of few of its rows (of a chain row's one target, 1 tile in V / BN), so
    # the [BM, BN] comparison runs only where one falls
    start = tl.load(PTR + rows, mask=rmask, other=0)
    cnt = tl.load(PTR + rows + 1, mask=rmask, other=0) - start
    kmax = tl.max(cnt, 0)
    i = 0
    while i < kmax:
        has = i < cnt
        tok = tl.load(TOK + start + i, mask=has, other=-1)
        mine = has & (tok >= pid_n * BN) & (tok < pid_n * BN + BN) & (tok < V)
        if tl.max(mine.to(tl.int32), 0) > 0:
            hit = cols[None, :] == tok[:, None]
            tl.store(TGT + start + i, tl.sum(tl.where(hit, s, 0.0), 1), mask=mine)
            e = tl.where(hit, 0.0, e)
        i += 1
    if STORE_E:
        if HAS_REF:  # e^{s − m} e^{m − r} = e^{s − r}: one multiply per element, no second exp
            r = tl.load(REF + rows, mask=rmask, other=float("-inf"))
            e = e * tl.where(m - r <= SLACK, tl.exp(tl.minimum(m - r, SLACK)), 1.0)[:, None]
        if OSTORE:  # one bulk tensor store (rows and columns outside E are clipped)
            OD.store([pid_m * BM, pid_n * BN], _cast(e, E.dtype.element_ty, LOW))
        else:
            tl.store(E + rows.to(tl.int64)[:, None] * stride_e + cols[None, :], _cast(e, E.dtype.element_ty, LOW),
                     mask=rmask[:, None] & cmask[None, :])
    po = pid_n * n + rows  # partials are [tiles, n]: one contiguous vector per tile
    tl.store(PM + po, m, mask=rmask)
    tl.store(PS + po, tot, mask=rmask)
    tl.store(PQ + po, q, mask=rmask)


@triton.jit
def _logit_tiles_kernel(X, W, XD, WD, OD, E, PM, PS, PQ, TGT, PTR, TOK, REF, SLACK, n, V, INV, stride_x, stride_w,
                        stride_e, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        ACC: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr, STORE_E: tl.constexpr,
                        F32: tl.constexpr, TMA: tl.constexpr, OSTORE: tl.constexpr, PERSIST: tl.constexpr,
                        FLAT: tl.constexpr, NP: tl.constexpr, INTERP: tl.constexpr, EVEN: tl.constexpr = False,
                        HAS_REF: tl.constexpr = False, WS: tl.constexpr = False):
    # tile t: row tile t % nm, vocabulary tile t // nm, so that consecutive tiles share a tile of W
    # (the large operand). PERSIST: NP programs walk the tiles t = pid, pid + NP, ... (FLAT: one
    # software-pipelined loop, the next tile's loads overlap this tile's epilogue); else one
    # program per tile on a 2-D grid (axis 0 over row tiles).
    if PERSIST:
        nm = tl.cdiv(n, BM)
        tiles = nm * tl.cdiv(V, BN)
        pid = tl.program_id(0)
        if INTERP:  # the CPU interpreter has no range() over program-dependent bounds
            it = 0
            while it < tiles:
                t = tl.minimum(pid + it, tiles - 1)  # a repeated last tile writes the same values
                _logit_tile(t % nm, t // nm, X, W, XD, WD, OD, E, PM, PS, PQ, TGT, PTR, TOK, REF, SLACK, n, V, INV,
                            stride_x, stride_w, stride_e, H, BM, BN, BK, ACC, PREC, LOW, STORE_E, F32, TMA, OSTORE,
                            EVEN, HAS_REF)
                it += NP
        else:
            for t in tl.range(pid, tiles, NP, flatten=FLAT, warp_specialize=WS):
                _logit_tile(t % nm, t // nm, X, W, XD, WD, OD, E, PM, PS, PQ, TGT, PTR, TOK, REF, SLACK, n, V, INV,
                            stride_x, stride_w, stride_e, H, BM, BN, BK, ACC, PREC, LOW, STORE_E, F32, TMA, OSTORE,
                            EVEN, HAS_REF)
    else:
        _logit_tile(tl.program_id(0), tl.program_id(1), X, W, XD, WD, OD, E, PM, PS, PQ, TGT, PTR, TOK, REF, SLACK, n,
                    V, INV, stride_x, stride_w, stride_e, H, BM, BN, BK, ACC, PREC, LOW, STORE_E, F32, TMA, OSTORE,
                    EVEN, HAS_REF)


@triton.jit
def _combine_kernel(PM, PS, PQ, OM, OS, OQ, E, REF, SCALE, SLACK, n, stride_e, V, NT: tl.constexpr, BR: tl.constexpr,
                    BT: tl.constexpr, FINAL: tl.constexpr, HAS_REF: tl.constexpr, LOW: tl.constexpr, TN: tl.constexpr):
    # FINAL: write lse = M + log S into OM and the entropy log S − Q / S into OS (OQ unused);
    # HAS_REF (with FINAL): E of logit_tiles(ref=REF) -> the factor P = SCALE · E, see combine_tiles
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < n
    ts = tl.arange(0, BT)
    big = tl.full([BR], float("-inf"), PM.dtype.element_ty)
    for t0 in range(0, NT, BT):
        msk = ((t0 + ts) < NT)[:, None] & rmask[None, :]
        m = tl.load(PM + (t0 + ts)[:, None] * n + rows[None, :], mask=msk, other=float("-inf"))
        big = tl.maximum(big, tl.max(m, 0))
    big = tl.where(rmask, big, 0.0)
    tot = tl.zeros([BR], PM.dtype.element_ty)
    q = tl.zeros([BR], PM.dtype.element_ty)
    for t0 in range(0, NT, BT):
        msk = ((t0 + ts) < NT)[:, None] & rmask[None, :]
        off = (t0 + ts)[:, None] * n + rows[None, :]
        m = tl.load(PM + off, mask=msk, other=0.0)
        w = tl.where(msk, tl.exp(m - big[None, :]), 0.0)
        st = tl.load(PS + off, mask=msk, other=0.0)
        tot += tl.sum(st * w, 0)
        q += tl.sum((tl.load(PQ + off, mask=msk, other=0.0) + (m - big[None, :]) * st) * w, 0)
    if FINAL:
        ls = tl.log(tl.where(rmask, tot, 1.0))
        tl.store(OM + rows, big + ls, mask=rmask)
        tl.store(OS + rows, ls - q / tl.where(rmask, tot, 1.0), mask=rmask)
        if HAS_REF:
            r = tl.load(REF + rows, mask=rmask, other=float("-inf"))
            lse = big + ls
            good = big - r <= SLACK  # every tile of the row stored E relative to r
            fix = rmask & (big - r > SLACK) & (r > float("-inf"))
            tl.store(SCALE + rows, tl.where(good, tl.exp(r - lse), tl.where(fix, 1.0, 0.0)),
                     mask=rmask)
            if tl.max(fix.to(tl.int32), 0) > 0:  # rare: rescale those rows' tiles to P = e^{s − lse} here
                cs = tl.arange(0, TN)
                rp = E + rows.to(tl.int64)[:, None] * stride_e
                for t in range(0, NT):
                    m = tl.load(PM + t * n + rows, mask=fix, other=0.0)
                    c = tl.exp(tl.where(m - r <= SLACK, r, m) - lse)
                    cols = t * TN + cs
                    msk = fix[:, None] & (cols < V)[None, :]
                    x = tl.load(rp + cols[None, :], mask=msk, other=0.0).to(PM.dtype.element_ty) * c[:, None]
                    tl.store(rp + cols[None, :], _cast(x, E.dtype.element_ty, LOW), mask=msk)
    else:
        tl.store(OM + rows, big, mask=rmask)
        tl.store(OS + rows, tot, mask=rmask)
        tl.store(OQ + rows, q, mask=rmask)


@triton.jit
def _scale_tiles_kernel(E, PM, LSE, ENT, n, stride_e, V: tl.constexpr, TN: tl.constexpr, BR: tl.constexpr,
                        ACC: tl.constexpr, LOW: tl.constexpr, ENTROPY: tl.constexpr):
    # one row block × one vocabulary tile, in place: e -> p = e · e^{m_t − lse}, or p -> p (log p + H)
    t = tl.program_id(1)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = t * TN + tl.arange(0, TN)
    rmask = rows < n
    msk = rmask[:, None] & (cols < V)[None, :]
    ptr = E + rows.to(tl.int64)[:, None] * stride_e + cols[None, :]
    e = tl.load(ptr, mask=msk, other=0.0).to(ACC)
    if ENTROPY:
        ent = tl.load(ENT + rows, mask=rmask, other=0.0)
        x = tl.where(e > 0, e * (tl.log(tl.where(e > 0, e, 1.0)) + ent[:, None]), 0.0)
    else:
        c = tl.exp(tl.load(PM + t * n + rows, mask=rmask, other=0.0) - tl.load(LSE + rows, mask=rmask, other=0.0))
        x = e * c[:, None]
    tl.store(ptr, _cast(x, E.dtype.element_ty, LOW), mask=msk)


@triton.jit
def _hidden_grad_kernel(A, AH, SC, LSE, ENT, GH, PTR, TOK, EG, TGT, W, OUT, GOUT, INV, stride_a, stride_ah, stride_w,
                        stride_o, H: tl.constexpr, V: tl.constexpr, BH: tl.constexpr, HAS_ENT: tl.constexpr,
                        LOW: tl.constexpr, HAS_SC: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    hs = hb * BH + tl.arange(0, BH)
    hm = hs < H
    start = tl.load(PTR + u)
    end = tl.load(PTR + u + 1)
    lse = tl.load(LSE + u)
    a = tl.load(A + u * stride_a + hs, mask=hm, other=0.0)
    if HAS_SC:  # A = E W of logit_tiles(ref=...): P W = scale · A
        a = a * tl.load(SC + u)
    gsum = tl.zeros([1], a.dtype)
    i = start
    while i < end:
        gsum += tl.load(EG + i)
        i += 1
    acc = -gsum * a
    if HAS_ENT:
        gh = tl.load(GH + u)
        ent = tl.load(ENT + u)
        acc -= gh * tl.load(AH + u * stride_ah + hs, mask=hm, other=0.0)
    i = start
    while i < end:
        tok = tl.load(TOK + i)
        lp = tl.load(TGT + i) - lse
        p = tl.exp(lp)
        coef = tl.load(EG + i) - gsum * p
        if HAS_ENT:
            coef -= gh * p * (lp + ent)
        own = (tok >= 0) & (tok < V)
        w = tl.load(W + tl.minimum(tl.maximum(tok, 0), V - 1).to(tl.int64) * stride_w + hs, mask=hm & own, other=0.0)
        acc += coef * w.to(a.dtype)
        i += 1
    tl.store(OUT + u * stride_o + hs, _cast(acc * tl.load(INV), OUT.dtype.element_ty, LOW), mask=hm)
    if hb == 0:
        tl.store(GOUT + u + tl.arange(0, 1), gsum)


@triton.jit
def _target_max_kernel(X, W, PTR, TOK, INV, OUT, stride_x, stride_w, V, H: tl.constexpr, BH: tl.constexpr,
                       ACC: tl.constexpr):
    # row u: max over its edges c with a token in [0, V) of the logit s[u, tok_c] (−inf: none)
    u = tl.program_id(0).to(tl.int64)
    hs = tl.arange(0, BH)
    best = tl.full([1], float("-inf"), ACC)
    i = tl.load(PTR + u)
    end = tl.load(PTR + u + 1)
    while i < end:
        tok = tl.load(TOK + i)
        own = (tok >= 0) & (tok < V)
        wp = W + tl.minimum(tl.maximum(tok, 0), V - 1).to(tl.int64) * stride_w
        acc = tl.zeros([BH], ACC)
        for k0 in range(0, H, BH):
            hm = k0 + hs < H
            acc += tl.load(X + u * stride_x + k0 + hs, mask=hm, other=0.0).to(ACC) * \
                tl.load(wp + k0 + hs, mask=hm & own, other=0.0).to(ACC)
        best = tl.where(own, tl.maximum(best, tl.sum(acc, 0) * tl.load(INV)), best)
        i += 1
    tl.store(OUT + u + tl.arange(0, 1), best)


@triton.jit
def _grad_tile(pid_n, pid_m, X, W, XD, WD, OD, DZ, LSE, G, GH, ENT, PTR, TOK, EG, T, nb, col0, INV, stride_x, stride_w,
               stride_dz, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
               PREC: tl.constexpr, LOW: tl.constexpr, HAS_ENT: tl.constexpr, F32: tl.constexpr, TMA: tl.constexpr,
               OSTORE: tl.constexpr):
    """One ``[BM, BN]`` tile of :func:`logit_grad`: GEMM, then ``dz`` in the epilogue."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < T
    rc = tl.minimum(rows, T - 1)
    if TMA:
        acc = _x_wt_tma(XD, WD, pid_m * BM, pid_n * BN, H, BM, BN, BK, ACC, PREC, F32)
    else:
        acc = _x_wt(X, W, rc, tl.minimum(cols, nb - 1), stride_x, stride_w, H, BM, BN, BK, ACC, PREC, F32)
    inv_t = tl.load(INV)
    lp = acc * inv_t - tl.load(LSE + rc)[:, None]
    p = tl.exp(lp)
    g = tl.load(G + rc) * inv_t  # the 1/τ of dz folded into the per-row (and per-edge) factors
    if HAS_ENT:
        d = -p * (g[:, None] + (tl.load(GH + rc) * inv_t)[:, None] * (lp + tl.load(ENT + rc)[:, None]))
    else:
        d = -p * g[:, None]
    start = tl.load(PTR + rows, mask=rmask, other=0)
    cnt = tl.load(PTR + rows + 1, mask=rmask, other=0) - start
    kmax = tl.max(cnt, 0)
    i = 0
    while i < kmax:  # as in _logit_tile: the comparison only in tiles that hold a target
        has = i < cnt
        tok = tl.load(TOK + start + i, mask=has, other=-1) - col0
        if tl.max((has & (tok >= pid_n * BN) & (tok < pid_n * BN + BN)).to(tl.int32), 0) > 0:
            d += tl.where(cols[None, :] == tok[:, None], (tl.load(EG + start + i, mask=has, other=0.0) * inv_t)[:, None],
                          0.0)
        i += 1
    if OSTORE:
        OD.store([pid_m * BM, pid_n * BN], _cast(d, DZ.dtype.element_ty, LOW))
    else:
        tl.store(DZ + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :],
                 _cast(d, DZ.dtype.element_ty, LOW), mask=rmask[:, None] & (cols < nb)[None, :])


@triton.jit
def _logit_grad_kernel(X, W, XD, WD, OD, DZ, LSE, G, GH, ENT, PTR, TOK, EG, T, nb, col0, INV, stride_x, stride_w,
                       stride_dz, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       ACC: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr, HAS_ENT: tl.constexpr,
                       F32: tl.constexpr, TMA: tl.constexpr, OSTORE: tl.constexpr, PERSIST: tl.constexpr,
                       FLAT: tl.constexpr, NP: tl.constexpr, INTERP: tl.constexpr, WS: tl.constexpr = False):
    # tile t: column tile t % nn, row tile t // nn, so that consecutive tiles share a tile of X rows
    # (PERSIST, FLAT, NP as in _logit_tiles_kernel; else a 2-D grid, axis 0 over column tiles)
    if PERSIST:
        nn = tl.cdiv(nb, BN)
        tiles = nn * tl.cdiv(T, BM)
        pid = tl.program_id(0)
        if INTERP:
            it = 0
            while it < tiles:
                t = tl.minimum(pid + it, tiles - 1)
                _grad_tile(t % nn, t // nn, X, W, XD, WD, OD, DZ, LSE, G, GH, ENT, PTR, TOK, EG, T, nb, col0, INV,
                           stride_x, stride_w, stride_dz, H, BM, BN, BK, ACC, PREC, LOW, HAS_ENT, F32, TMA, OSTORE)
                it += NP
        else:
            for t in tl.range(pid, tiles, NP, flatten=FLAT, warp_specialize=WS):
                _grad_tile(t % nn, t // nn, X, W, XD, WD, OD, DZ, LSE, G, GH, ENT, PTR, TOK, EG, T, nb, col0, INV,
                           stride_x, stride_w, stride_dz, H, BM, BN, BK, ACC, PREC, LOW, HAS_ENT, F32, TMA, OSTORE)
    else:
        _grad_tile(tl.program_id(0), tl.program_id(1), X, W, XD, WD, OD, DZ, LSE, G, GH, ENT, PTR, TOK, EG, T, nb, col0,
                   INV, stride_x, stride_w, stride_dz, H, BM, BN, BK, ACC, PREC, LOW, HAS_ENT, F32, TMA, OSTORE)


# ----------------------------------------------------------------------------------------------
# configurations: explicit (tests, the CPU interpreter) or autotuned on first use per shape (CUDA)

# (BM, BN, BK, num_warps, num_stages, TMA, PERSIST, FLAT, programs per SM, OSTORE): the autotuner
# times these on first use per shape and keeps the fastest. Two families: the pointer-based kernels
# (cp.async pipelines, one program per tile) and tensor-descriptor (TMA) kernels, most of them
# persistent (one program per SM walking the tiles; FLAT: the loop over tiles and K is one
# software pipeline, so the next tile's loads overlap this tile's epilogue); OSTORE: the output
# tile (``E`` or ``dz``) leaves through a bulk tensor store instead of per-thread stores.
_MM_CONFIGS = {
    "logit_tiles": [(256, TILE_N, 64, 8, 3, False, False, False, 1, False),
                    (128, TILE_N, 64, 8, 4, False, False, False, 1, False),
                    (128, TILE_N, 64, 8, 3, True, True, True, 1, False), (128, TILE_N, 64, 8, 4, True, True, True, 1, False),
                    (256, TILE_N, 64, 8, 3, True, True, True, 1, False), (128, TILE_N, 64, 4, 3, True, True, True, 2, False),
                    (256, TILE_N, 64, 8, 3, True, True, False, 1, False),
                    (256, TILE_N, 64, 8, 3, True, False, False, 1, False),
                    (128, TILE_N, 64, 8, 4, True, True, True, 1, True), (256, TILE_N, 64, 8, 3, True, False, False, 1, True)],
    "logit_grad": [(128, 256, 64, 8, 3, False, False, False, 1, False), (128, 128, 64, 8, 3, False, False, False, 1, False),
                   (128, 256, 64, 8, 3, True, True, True, 1, False), (128, 256, 64, 8, 4, True, True, True, 1, False),
                   (256, 128, 64, 8, 3, True, True, True, 1, False), (128, 128, 64, 4, 3, True, True, True, 2, False),
                   (128, 256, 64, 8, 3, True, True, False, 1, False), (128, 256, 64, 8, 3, True, False, False, 1, False),
                   (128, 128, 64, 4, 3, True, True, True, 2, True), (128, 256, 64, 8, 3, True, True, True, 1, True)],
}
_KERNELS = {"logit_tiles": _logit_tiles_kernel, "logit_grad": _logit_grad_kernel}
_INTERPRET_CONFIG = {"BM": 16, "BN": 16, "BK": 16}
_FLAGS = {"TMA": False, "OSTORE": False, "PERSIST": False, "FLAT": False, "NP": 1}
_TMA_FAILED: list[str] = []  # kernels whose descriptor launch failed in this process (then pointer-only)


def _set_blocks(nargs: dict) -> None:
    """Autotuner pre-hook: the tensor descriptors' block shapes of the configuration about to run."""
    if nargs.get("XD") is not None:
        nargs["XD"].block_shape = [nargs["BM"], nargs["BK"]]
        nargs["WD"].block_shape = [nargs["BN"], nargs["BK"]]
    if nargs.get("OD") is not None:
        nargs["OD"].block_shape = [nargs["BM"], nargs["BN"]]


def _bench_or_inf(kernel_call, quantiles):
    """The autotuner's timing, with any failure of a configuration (one that does not compile or
    launch with this Triton and GPU, not only the out-of-resources cases Triton skips itself)
    counted as never fastest."""
    try:
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)
    except Exception:  # noqa: BLE001 - a failing candidate is skipped, the others decide
        return [float("inf")] * len(quantiles)


@functools.cache
def _tuned(name: str, tma: bool, sms: int):
    """Autotuned kernel ``name`` over its configurations (only the pointer-based ones unless ``tma``);
    ``sms``: the device's multiprocessor count (persistent grids)."""
    configs = []
    for bm, bn, bk, w, st, use_tma, persist, flat, occ, ostore in _MM_CONFIGS[name]:
        if use_tma and not tma:
            continue
        kw = {"BM": bm, "BK": bk, "TMA": use_tma, "OSTORE": ostore, "PERSIST": persist, "FLAT": flat,
              "NP": sms * occ if persist else 1}
        if name != "logit_tiles":  # logit_tiles: BN is fixed (the partials' layout)
            kw["BN"] = bn
        configs.append(triton.Config(kw, num_warps=w, num_stages=st, pre_hook=_set_blocks))
    return triton.autotune(configs=configs, key=["H", "V"] if name == "logit_tiles" else ["H"],
                           do_bench=_bench_or_inf)(_KERNELS[name])


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether ``ts`` (2-D, rows dense) can be read through tensor descriptors: 16-byte aligned base
    and row stride, no empty dimension; on CUDA also compute capability 9.0 or newer."""
    for t in ts:
        if t.dim() != 2 or min(t.shape) == 0 or t.stride(-1) != 1 or t.data_ptr() % 16 \
                or (t.stride(0) * t.element_size()) % 16:
            return False
    if _interpreting():
        return True
    return ts[0].is_cuda and torch.cuda.get_device_capability(ts[0].device)[0] >= 9


def _descriptors(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, config: dict | None,
                 bn: int | None = None):
    """Tensor descriptors of ``x [rows, H]``, ``w [cols, H]`` and the output ``out [rows, cols]``
    (None: none) with the block shapes of an explicit ``config`` (``bn``: a fixed column tile), or
    of the interpreter's tiles; placeholders under the autotuner, whose pre-hook sets them per
    configuration."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = config or (_INTERPRET_CONFIG if _interpreting() else {"BM": 16, "BN": 16, "BK": 16})
    bm, bk, bn = cfg["BM"], cfg["BK"], bn or cfg["BN"]
    od = None if out is None else TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, bn])
    return (TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk]),
            TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk]), od)


def _launch(name: str, grid, args: dict, config: dict | None, tma: bool):
    """Run kernel ``name`` with ``config`` ({BM, BN, BK, TMA, OSTORE, PERSIST, FLAT, NP, num_warps,
    num_stages}; missing flags False, NP 1); ``None``: the autotuned kernel on CUDA, the small
    interpreter tiles elsewhere. ``tma``: the descriptors ``XD, WD`` in ``args`` are usable."""
    if config is None and not _interpreting():
        sms = _sm_count(args["X"].device.index or 0)
        if tma and not _TMA_FAILED:
            try:
                _tuned(name, True, sms)[grid](**args, INTERP=False)
                return
            except Exception as e:  # noqa: BLE001 - e.g. a descriptor this driver refuses: pointer kernels instead
                import warnings

                warnings.warn(f"harts.lm_head_triton: {name} through tensor descriptors failed ({e!r}); using the "
                              "pointer-based kernels from now on", RuntimeWarning, stacklevel=2)
                _TMA_FAILED.append(name)
        _tuned(name, False, sms)[grid](**{**args, "XD": None, "WD": None, "OD": None}, INTERP=False)
        return
    cfg = {**_FLAGS, **(config or _INTERPRET_CONFIG)}
    if (cfg["TMA"] or cfg["OSTORE"]) and not tma:
        raise ValueError(f"{name}: config {config} reads through tensor descriptors, which these operands do not allow")
    if name == "logit_tiles":
        cfg.pop("BN", None)  # fixed: the partials' layout
    _KERNELS[name][grid](**args, **cfg, INTERP=_interpreting())


def tuned_config(name: str) -> dict | None:
    """The configuration the autotuner chose for kernel ``name`` on the current device (None before
    its first run)."""
    if not torch.cuda.is_available():
        return None
    best = None
    for tma in (True, False):
        best = best or getattr(_tuned(name, tma, _sm_count(torch.cuda.current_device())), "best_config", None)
    return None if best is None else {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}


def tuning_record(name: str) -> list[dict]:
    """Every configuration the autotuner timed for kernel ``name`` (last tuned shape), with its
    median ms (inf: failed or out of resources), fastest first."""
    if not torch.cuda.is_available():
        return []
    out = []
    for tma in (True, False):
        timings = getattr(_tuned(name, tma, _sm_count(torch.cuda.current_device())), "configs_timings", None) or {}
        for c, t in timings.items():
            ms = t[0] if isinstance(t, (list, tuple)) else t
            out.append({**{k: v for k, v in c.kwargs.items()}, "num_warps": c.num_warps, "num_stages": c.num_stages,
                        "ms": float(ms)})
    return sorted(out, key=lambda r: r["ms"])


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _prec(dtype: torch.dtype):
    return "ieee" if dtype in (torch.float32, torch.float64) or _f32_dots(dtype) else None


def _f32_dots(dtype: torch.dtype) -> bool:
    """16-bit operands are multiplied as exact fp32 products under the CPU interpreter (its dot
    treats them as integers); on the GPU they go to the tensor cores as they are."""
    return _low(dtype) and _interpreting()


def _low(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------
# wrappers


def logit_tiles(h: torch.Tensor, w: torch.Tensor, row_ptr: torch.Tensor, tok: torch.Tensor, tgt: torch.Tensor,
                inv_t: torch.Tensor, *, store_e: bool = True, ref: torch.Tensor | None = None,
                slack: float | None = None, config: dict | None = None):
    """Forward tiles of the rows ``h [n, H]`` (see the module docstring); ``inv_t``: ``1/τ`` as a
    one-element tensor of the accumulation dtype (fp64 stays exact; a Python float would pass as fp32).

    ``row_ptr [n + 1]`` (global edge indices), ``tok [E]`` (local ids), ``tgt [E]`` (written at the
    edges whose token lies in this shard). Returns ``E [n, V]`` (``w``'s dtype) and the partials
    ``m, S, Q`` as ``[ceil(V / TILE_N), n]`` each (fp32; fp64 for fp64 inputs); ``E`` is None
    when ``store_e`` is False (statistics only).

    ``ref [n]`` (the accumulation dtype, ``−inf``: none): a reference per row, e.g.
    :func:`target_logit_max`. Tile ``t`` of row ``u`` then stores ``E = e^{s − r_t}`` with
    ``r_t = ref_u`` where ``m_t ≤ ref_u + slack``, else ``r_t = m_t`` as without ``ref`` (the
    partials do not change); :func:`combine_tiles` turns that into one factor per row.
    """
    n, hd = h.shape
    v = w.shape[0]
    h, w = _rows_dense(h), _rows_dense(w)
    nt = triton.cdiv(v, TILE_N)
    acc = _acc_dtype(h.dtype)
    pm, ps, pq = torch.empty(3, nt, n, dtype=acc, device=h.device)
    # rows padded to a multiple of 64 elements: aligned rows let the GEMM loads pipeline (cp.async)
    e = torch.empty(n, -(-v // 64) * 64, dtype=w.dtype, device=h.device)[:, :v] if store_e else None
    tma = _tma_ok(h, w) and (e is None or _tma_ok(e))
    xd, wd, od = _descriptors(h, w, e, config, TILE_N) if tma else (None, None, None)
    has_ref = ref is not None and store_e
    slack = float(REF_SLACK if slack is None else slack)
    args = dict(X=h, W=w, XD=xd, WD=wd, OD=od, E=pm if e is None else e, PM=pm, PS=ps, PQ=pq, TGT=tgt, PTR=row_ptr, TOK=tok,
                REF=ref if has_ref else pm, SLACK=slack, n=n, V=v, INV=inv_t, stride_x=h.stride(0),
                stride_w=w.stride(0), stride_e=0 if e is None else e.stride(0), H=hd, BN=TILE_N, ACC=_acc(h.dtype),
                PREC=_prec(h.dtype), LOW=_low(w.dtype), STORE_E=store_e, F32=_f32_dots(h.dtype), EVEN=v % TILE_N == 0,
                HAS_REF=has_ref)

    def grid(meta):
        tiles_m = triton.cdiv(n, meta["BM"])
        return (min(meta["NP"], tiles_m * nt),) if meta["PERSIST"] else (tiles_m, nt)
    _launch("logit_tiles", grid, args, config, tma)
    return e, pm, ps, pq


def combine_tiles(pm: torch.Tensor, ps: torch.Tensor, pq: torch.Tensor, *, lse: torch.Tensor | None = None,
                  ent: torch.Tensor | None = None, e: torch.Tensor | None = None, ref: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, slack: float | None = None):
    """``(M, S, Q) [n]`` of the tile partials ``[tiles, n]`` (module docstring); with ``lse`` and
    ``ent`` given (``[n]`` each, the partials' dtype), writes ``lse = M + log S`` and the entropy
    ``log S − Q / S`` there instead and returns ``(lse, ent)``.

    With ``e``, ``ref`` (of ``logit_tiles(..., ref=ref, slack=slack)``) and ``scale [n]`` also
    writes the factor ``scale_u`` with ``P_u = scale_u · E_u`` (the probabilities without the
    target columns): ``e^{ref_u − lse_u}`` where every tile of the row used ``ref_u`` (``M_u ≤
    ref_u + slack``); else, for a row with a reference, its tiles of ``e`` are rescaled in place to
    ``P_u`` here and ``scale_u = 1``; rows without a reference get 0 (no target: ``A_u`` unused)."""
    nt, n = pm.shape
    br, bt = (16, 16) if _interpreting() else (8, 128)  # 8 rows per program: ≈ one wave per 1024-row chunk
    grid = (triton.cdiv(n, br),)
    slack = float(REF_SLACK if slack is None else slack)
    if lse is not None:
        has_ref = e is not None
        if has_ref and (ref is None or scale is None or e.shape[0] != n):
            raise ValueError("combine_tiles: e needs ref and scale, and e must have the partials' rows")
        _combine_kernel[grid](pm, ps, pq, lse, ent, lse, e if has_ref else pm, ref if has_ref else lse,
                              scale if has_ref else lse, slack, n, e.stride(0) if has_ref else 0,
                              e.shape[1] if has_ref else 0, NT=nt, BR=br, BT=bt, FINAL=True, HAS_REF=has_ref,
                              LOW=has_ref and _low(e.dtype), TN=TILE_N)
        return lse, ent
    out = torch.empty(3, n, dtype=pm.dtype, device=pm.device)
    _combine_kernel[grid](pm, ps, pq, out[0], out[1], out[2], pm, pm, pm, 0.0, n, 0, 0, NT=nt, BR=br, BT=bt,
                          FINAL=False, HAS_REF=False, LOW=False, TN=TILE_N)
    return out[0], out[1], out[2]


def target_logit_max(h: torch.Tensor, w: torch.Tensor, row_ptr: torch.Tensor, tok: torch.Tensor,
                     inv_t: torch.Tensor) -> torch.Tensor:
    """``[n]``: per row ``u`` of ``h [n, H]`` the largest logit ``h_u · w_{tok_c} / τ`` of its edges
    ``c`` whose token lies in this shard (``−inf``: none); the accumulation dtype. A reference for
    :func:`logit_tiles`: a sampled token's logit is rarely far below its row's maximum."""
    n, hd = h.shape
    out = torch.empty(n, dtype=_acc_dtype(h.dtype), device=h.device)
    if n == 0:
        return out
    h, w = _rows_dense(h), _rows_dense(w)
    bh = 16 if _interpreting() else min(1024, triton.next_power_of_2(hd))
    _target_max_kernel[(n,)](h, w, row_ptr, tok, inv_t, out, h.stride(0), w.stride(0), w.shape[0], H=hd, BH=bh,
                             ACC=_acc(h.dtype))
    return out


def scale_tiles(e: torch.Tensor, pm: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, *,
                entropy: bool = False) -> torch.Tensor:
    """In place on ``E`` of :func:`logit_tiles`: ``E ← E · e^{m_t − lse}`` (the probabilities
    without the target columns), or with ``entropy=True`` on those probabilities
    ``P ← P (log P + H)``; computed in the accumulation dtype, rounded to ``E``'s dtype."""
    n, v = e.shape
    if n == 0:
        return e
    br = 16 if _interpreting() else 32
    _scale_tiles_kernel[(triton.cdiv(n, br), triton.cdiv(v, TILE_N))](
        e, pm, lse, ent, n, e.stride(0), V=v, TN=TILE_N, BR=br, ACC=_acc(e.dtype), LOW=_low(e.dtype), ENTROPY=entropy)
    return e


def hidden_grad(a: torch.Tensor, a_ent: torch.Tensor | None, lse: torch.Tensor, ent: torch.Tensor,
                g_ent: torch.Tensor | None, row_ptr: torch.Tensor, tok: torch.Tensor, g_edge: torch.Tensor,
                tgt: torch.Tensor, w: torch.Tensor, inv_t: torch.Tensor, out: torch.Tensor, gsum: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """``out [T, H] = dh`` (before any tensor-parallel sum; may alias ``a``) and ``gsum [T] = G``;
    ``scale [T]``: ``A = scale · a`` per row (:func:`combine_tiles` with ``ref``)."""
    t, hd = a.shape
    if t == 0:
        return
    w = _rows_dense(w)
    bh = min(1024, triton.next_power_of_2(hd)) if not _interpreting() else 16
    has_ent = a_ent is not None and g_ent is not None
    _hidden_grad_kernel[(t, triton.cdiv(hd, bh))](
        a, a_ent if has_ent else a, lse if scale is None else scale, lse, ent, g_ent if has_ent else lse, row_ptr, tok,
        g_edge, tgt, w, out, gsum, inv_t, a.stride(0), (a_ent if has_ent else a).stride(0), w.stride(0), out.stride(0),
        H=hd, V=w.shape[0], BH=bh, HAS_ENT=has_ent, LOW=_low(out.dtype), HAS_SC=scale is not None)


def logit_grad(h: torch.Tensor, w_block: torch.Tensor, col0: int, lse: torch.Tensor, gsum: torch.Tensor,
               g_ent: torch.Tensor | None, ent: torch.Tensor, row_ptr: torch.Tensor, tok: torch.Tensor,
               g_edge: torch.Tensor, inv_t: torch.Tensor, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``out [T, nb] = dz`` of the vocabulary block ``w_block = W[col0 : col0 + nb]`` (module docstring)."""
    t, hd = h.shape
    nb = w_block.shape[0]
    h, w_block = _rows_dense(h), _rows_dense(w_block)
    has_ent = g_ent is not None
    tma = _tma_ok(h, w_block, out)
    xd, wd, od = _descriptors(h, w_block, out, config) if tma else (None, None, None)
    args = dict(X=h, W=w_block, XD=xd, WD=wd, OD=od, DZ=out, LSE=lse, G=gsum, GH=g_ent if has_ent else lse, ENT=ent,
                PTR=row_ptr, TOK=tok, EG=g_edge, T=t, nb=nb, col0=col0, INV=inv_t, stride_x=h.stride(0),
                stride_w=w_block.stride(0), stride_dz=out.stride(0), H=hd, ACC=_acc(h.dtype), PREC=_prec(h.dtype),
                LOW=_low(out.dtype), HAS_ENT=has_ent, F32=_f32_dots(h.dtype))

    def grid(meta):
        tiles_n, tiles_m = triton.cdiv(nb, meta["BN"]), triton.cdiv(t, meta["BM"])
        return (min(meta["NP"], tiles_n * tiles_m),) if meta["PERSIST"] else (tiles_n, tiles_m)
    _launch("logit_grad", grid, args, config, tma)
    return out


# ----------------------------------------------------------------------------------------------
# plain-torch references (same contracts; dense [n, V] tensors: small sizes only)


def _edge_rows(row_ptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(global edge indices, their row) of the CSR ``row_ptr``."""
    cnt = row_ptr.diff()
    rows = torch.repeat_interleave(torch.arange(cnt.numel(), device=row_ptr.device), cnt)
    return torch.arange(int(row_ptr[0]), int(row_ptr[-1]), device=row_ptr.device), rows


def logit_tiles_reference(h, w, row_ptr, tok, tgt, inv_t, ref=None, slack=None):
    slack = REF_SLACK if slack is None else slack
    acc = _acc_dtype(h.dtype)
    s = (h.to(acc) @ w.to(acc).T) * inv_t
    n, v = s.shape
    nt = -(-v // TILE_N)
    sp = torch.full((n, nt * TILE_N), float("-inf"), dtype=acc, device=s.device)
    sp[:, :v] = s
    sp = sp.view(n, nt, TILE_N)
    m = sp.amax(-1)
    e = torch.exp(sp - m[..., None])
    tot = e.sum(-1)
    q = torch.where(e > 0, e * (sp - m[..., None]), 0.0).sum(-1)
    if ref is not None:  # e^{s − r_t}: r_t = ref where m_t <= ref + slack, else m_t
        d = m - ref[:, None]
        e = e * torch.where(d <= slack, torch.exp(d.clamp(max=slack)), 1.0)[..., None]
    e = e.reshape(n, -1)[:, :v].clone()
    idx, rows = _edge_rows(row_ptr)
    t = tok[idx]
    own = (t >= 0) & (t < v)
    tgt[idx[own]] = s[rows[own], t[own]]
    e[rows[own], t[own]] = 0.0
    return e.to(w.dtype), m.T.contiguous(), tot.T.contiguous(), q.T.contiguous()


def combine_tiles_reference(pm, ps, pq):
    big = pm.amax(0)
    wt = torch.exp(pm - big)
    return big, (ps * wt).sum(0), ((pq + (pm - big) * ps) * wt).sum(0)


def combine_scale_reference(e, pm, lse, ref, slack=None):
    """(E with the rows that need it rescaled to P, scale) of :func:`combine_tiles` with ``ref``."""
    slack = REF_SLACK if slack is None else slack
    acc = pm.dtype
    good = pm.amax(0) - ref <= slack
    fix = ~good & (ref > float("-inf"))
    scale = torch.where(good, torch.exp(ref - lse), torch.where(fix, 1.0, 0.0)).to(acc)
    r_t = torch.where(pm - ref <= slack, ref, pm)  # [tiles, n]: each tile's reference
    c = torch.exp(r_t - lse).T.repeat_interleave(TILE_N, 1)[:, :e.shape[1]]
    return torch.where(fix[:, None], (e.to(acc) * c).to(e.dtype), e), scale


def target_logit_max_reference(h, w, row_ptr, tok, inv_t):
    acc = _acc_dtype(h.dtype)
    idx, rows = _edge_rows(row_ptr)
    t = tok[idx].long()
    own = (t >= 0) & (t < w.shape[0])
    s = (h[rows[own]].to(acc) * w[t[own]].to(acc)).sum(-1) * inv_t
    out = torch.full((h.shape[0],), float("-inf"), dtype=acc, device=h.device)
    return out.scatter_reduce(0, rows[own], s, reduce="amax")


def scale_tiles_reference(e, pm, lse, ent, *, entropy=False):
    acc = _acc_dtype(e.dtype)
    ef = e.to(acc)
    if entropy:
        x = torch.where(ef > 0, ef * (torch.log(torch.where(ef > 0, ef, 1.0)) + ent[:, None]), 0.0)
    else:
        x = ef * torch.exp(pm.T.repeat_interleave(TILE_N, 1)[:, :e.shape[1]] - lse[:, None])
    return x.to(e.dtype)


def hidden_grad_reference(a, a_ent, lse, ent, g_ent, row_ptr, tok, g_edge, tgt, w, inv_t, scale=None):
    t, _ = a.shape
    if scale is not None:
        a = a * scale[:, None]
    v = w.shape[0]
    idx, rows = _edge_rows(row_ptr)
    gsum = torch.zeros(t, dtype=a.dtype, device=a.device).index_add_(0, rows, g_edge[idx])
    out = -gsum[:, None] * a
    lp = tgt[idx] - lse[rows]
    p = torch.exp(lp)
    coef = g_edge[idx] - gsum[rows] * p
    if a_ent is not None and g_ent is not None:
        out -= g_ent[:, None] * a_ent
        coef -= g_ent[rows] * p * (lp + ent[rows])
    tk = tok[idx]
    own = (tk >= 0) & (tk < v)
    out.index_add_(0, rows, torch.where(own, coef, 0.0)[:, None] * w[tk.clamp(0, v - 1)].to(a.dtype))
    return out * inv_t, gsum


def logit_grad_reference(h, w_block, col0, lse, gsum, g_ent, ent, row_ptr, tok, g_edge, inv_t):
    acc = _acc_dtype(h.dtype)
    lp = (h.to(acc) @ w_block.to(acc).T) * inv_t - lse[:, None]
    p = torch.exp(lp)
    d = -p * gsum[:, None]
    if g_ent is not None:
        d -= p * g_ent[:, None] * (lp + ent[:, None])
    idx, rows = _edge_rows(row_ptr)
    t = tok[idx] - col0
    inb = (t >= 0) & (t < w_block.shape[0])
    d[rows[inb], t[inb]] += g_edge[idx[inb]]
    return (d * inv_t).to(h.dtype)
