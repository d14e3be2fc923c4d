"""Tree-aware LM head: edge log-probs and row entropies without materializing [T, V].

For compact rows ``u`` (hidden ``h_u``) and vocabulary-parallel weight shard ``W`` (rows
``[vocab_start, vocab_start + V_local)`` of the full ``[V, H]``)::

    s_u = W h_u / τ,   lse_u = log Σ_j exp s_uj,   H_u = lse_u − Σ_j p_uj s_uj,
    logp[c] = s_{parent[c], x_c} − lse_{parent[c]}      for every edge parent[c] → c.

A row with k children yields k log-probs (fork labels). Given upstream gradients ``g_c`` (log-probs)
and ``g^H_u`` (entropies), ``G_u = Σ_c g_c`` and ``q_u = p_u ⊙ (log p_u + H_u)``::

    dz_u = (Σ_c g_c e_{x_c} − G_u p_u − g^H_u q_u) / τ,   dh = dz W,   dW = dzᵀ h.

The head runs three passes over the logits (four GEMMs of 2·T·H·V each):

* forward, rows in chunks: the logits, their log-sum-exp and entropy, and ``A = P W`` where ``P``
  is ``p`` with the target columns ``x_c`` of each row's children set to 0 (and ``Aᴴ`` from
  ``q`` likewise when the entropy is differentiable). ``A`` ([T, H], fp32) is saved.
* backward, ``dh``: ``dh_u = (Σ_c coef_c W[x_c] − G_u A_u − g^H_u Aᴴ_u) / τ`` with
  ``coef_c = g_c − G_u p_c − g^H_u p_c (log p_c + H_u)`` in fp32. The targets enter with exact
  coefficients, so ``1 − p`` of a confident token never cancels inside a rounded product; ``A``
  is consumed (freed) here.
* backward, ``dW``: vocabulary blocks; each recomputes its logits for all rows, forms ``dz`` and
  rounds it once to the model dtype, and ``dW_block = dzᵀ h`` is one GEMM over all T rows with fp32
  accumulation and one rounding. No fp32 ``dW`` accumulator exists.

Implementations (``impl``): ``"triton"`` (CUDA, bf16/fp16; :mod:`harts.lm_head_triton`: the softmax
statistics, the target handling and ``dz`` are GEMM epilogues, so fp32 logits never reach device
memory) and ``"torch"`` (any device and dtype; a ``[chunk, V_local]`` buffer in the compute dtype, fp32
for bf16/fp16 inputs, is materialized per chunk and per vocabulary block). Both share this driver.
Plain packed sequences use the same code with ``parent[v] = v − 1`` inside each sequence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["tree_lm_head", "TreeHeadOutput", "HeadEdges", "head_edges"]

_ROW_BLOCKS = 8  # the torch path's softmax temporaries are [ceil(rows / 8), cols]
_SLICE_FRACTION = 16  # vocab slices keep [slice, H] fp32 products ≤ 1/16 of a chunk
_TRITON_VOCAB_BLOCK = 2048  # narrowest default backward vocabulary block of the Triton path
_TRITON_DZ_ELEMS = 2048 * 16384  # default dz block size: [T, block] holds at most this many elements
_ROW_REFERENCE = True  # Triton forward: E relative to each row's target logit (False: the per-tile pass; A/B runs)


class TreeHeadOutput(tuple):
    """``(logp [T], entropy [T])``; ``logp`` is 0 at roots."""

    @property
    def logp(self) -> torch.Tensor:
        return self[0]

    @property
    def entropy(self) -> torch.Tensor:
        return self[1]


@dataclass(frozen=True, eq=False)
class HeadEdges:
    """Out-edges ``parent[c] → c`` of a packed row, sorted by parent row (build once per microbatch
    with :func:`head_edges`; the head then needs no device-to-host synchronization)."""

    child: torch.Tensor
    """[E] child row of each edge (its log-prob slot)."""
    parent: torch.Tensor
    """[E] parent row (whose logits hold the edge's log-prob), non-decreasing."""
    token: torch.Tensor
    """[E] token id of the child."""
    offsets: tuple[int, ...]
    """T+1 host ints: edges of rows ``[r0, r1)`` are ``offsets[r0]:offsets[r1]``."""
    row_ptr: torch.Tensor | None = None
    """[T+1] int32 ``offsets`` on the device (the CSR the Triton kernels read); built if absent."""


def head_edges(tokens: torch.Tensor, parent: torch.Tensor) -> HeadEdges:
    """:class:`HeadEdges` of ``tokens, parent [T]`` (``parent < 0``: no incoming edge). One host copy."""
    if tokens.shape != parent.shape or tokens.dim() != 1:
        raise ValueError(f"tokens and parent must be [T], got {tuple(tokens.shape)}, {tuple(parent.shape)}")
    p = parent.detach().cpu()
    child = torch.nonzero(p >= 0).squeeze(1)
    child = child[torch.argsort(p[child], stable=True)]
    e_parent = p[child]
    off = torch.searchsorted(e_parent, torch.arange(p.numel() + 1))
    dev = parent.device
    child_d = child.to(dev)
    return HeadEdges(child=child_d, parent=e_parent.to(dev), token=tokens.index_select(0, child_d),
                     offsets=tuple(off.tolist()), row_ptr=off.to(device=dev, dtype=torch.int32))


def _row_stats(z: torch.Tensor, inv_temp: float):
    """Fused forward statistics of a logits chunk ``z [n, V]``: ``m = max z/τ``,
    ``Σ e`` and ``Σ e·s`` with ``s = z/τ − m``, ``e = exp s`` (no [n, V] temporary once compiled)."""
    if inv_temp != 1.0:  # a Python float: specialized when traced
        z = z * inv_temp
    m = z.amax(-1)
    s = z - m[:, None]
    e = torch.exp(s)
    return m, e.sum(-1), (e * s).sum(-1)


def _dz_inplace(z: torch.Tensor, lse: torch.Tensor, gsum: torch.Tensor, g_ent, ent: torch.Tensor, inv_temp: float):
    """Overwrite the logits block ``z`` with ``−p ⊙ (G + g^H (log p + H))`` (``−G p`` without an
    entropy gradient), ``log p = z/τ − lse``; one read and one write of the block once compiled."""
    lp = (z * inv_temp if inv_temp != 1.0 else z) - lse[:, None]
    p = torch.exp(lp)
    if g_ent is None:
        z.copy_(-gsum[:, None] * p)
    else:
        z.copy_(-p * (gsum[:, None] + g_ent[:, None] * (lp + ent[:, None])))


@functools.cache
def _fused_kernels():
    """``torch.compile``-d :func:`_row_stats` and :func:`_dz_inplace` (Inductor fuses each into
    one or two passes over the chunk), compiled lazily on first use."""
    return torch.compile(_row_stats), torch.compile(_dz_inplace)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _low_precision_cuda(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype


def _mm(a: torch.Tensor, b: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``cdtype``; bf16/fp16 CUDA operands multiply natively with fp32 output
    (fp32 accumulation, no fp32 copy of the [V, H] weight)."""
    if _low_precision_cuda(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(cdtype) @ b.to(cdtype)


def _vocab_slice(n: int, vl: int, h: int, in_place: bool) -> int:
    """Columns per vocabulary slice when an fp32 ``[n, vl]`` block is multiplied in the model dtype
    (a multiple of 128, at least 128).

    With in-place fp32 accumulation only the rounded ``[n, slice]`` copy is extra: 4 slices
    (≤ 1/8 of an fp32 block; fewer slices, fewer launches). Otherwise the ``[slice, H]`` fp32
    product is too, and slices are sized so that it stays ≤ 1/16 and the copy ≤ 1/32 of the block.
    """
    if in_place:
        s = math.ceil(vl / 4)
    else:
        s = min(math.ceil(n * vl / (_SLICE_FRACTION * max(h, 1))), math.ceil(vl / _SLICE_FRACTION))
    return min(vl, -(-max(s, 128) // 128) * 128)


@functools.cache
def _fp32_accumulating_addmm(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` accumulates bf16 products
    into an fp32 ``acc`` in place on ``device`` (CUDA builds whose ``addmm.dtype`` accepts an fp32
    ``self``); probed once per device with a 2×2 product."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
        acc = torch.full((2, 2), 0.5, device=device)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 2.5).all())
    except (RuntimeError, TypeError):
        return False


def _use_inplace_accumulation(h: torch.Tensor, weight: torch.Tensor) -> bool:
    return _low_precision_cuda(h, weight) and _fp32_accumulating_addmm(h.device)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with fp32 ``acc`` and bf16/fp16 ``a, b``, in place (one GEMM, no temporary)."""
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
    """``acc += a @ weight`` for ``a [n, V_local]`` in the compute dtype and ``acc [n, H]``, without
    an ``[n, V]`` or ``[V, H]`` temporary: low-precision weights get ``a`` rounded to the model dtype
    one vocabulary slice at a time, its products accumulated in fp32."""
    if a.dtype == weight.dtype == acc.dtype:
        acc.addmm_(a, weight)
        return
    vl = weight.shape[0]
    in_place = _use_inplace_accumulation(weight, weight)
    step = _vocab_slice(a.shape[0], vl, weight.shape[1], in_place)
    for v0 in range(0, vl, step):
        v1 = min(v0 + step, vl)
        d = a[:, v0:v1].to(weight.dtype)
        if in_place:
            _addmm_fp32_(acc, d, weight[v0:v1])
        else:
            acc.add_(_mm(d, weight[v0:v1], acc.dtype))


def _row_chunks(t: int, chunk: int) -> list[tuple[int, int]]:
    """Row ranges of the forward: ``chunk`` rows each; a tail of fewer than ``chunk / 8`` rows joins
    the chunk before it (each chunk reads all of ``W`` twice whatever its rows, so the 3-row tail of
    a 4,099-row tree microbatch would cost as much of ``W``'s bandwidth as a full chunk)."""
    starts = list(range(0, t, chunk))
    if len(starts) > 1 and 8 * (t - starts[-1]) < chunk:
        starts.pop()
    return list(zip(starts, starts[1:] + [t], strict=True)) if starts else []


def _grad_weight_block(dz: torch.Tensor, h: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dzᵀ h`` (one GEMM over all rows, one rounding to ``out``'s dtype). A ``dz`` in the
    compute dtype is rounded to the model dtype one slice of columns at a time."""
    if dz.dtype == h.dtype:
        torch.mm(dz.T, h, out=out)
        return
    step = _vocab_slice(dz.shape[0], dz.shape[1], h.shape[1], True)
    for v0 in range(0, dz.shape[1], step):
        v1 = min(v0 + step, dz.shape[1])
        torch.mm(dz[:, v0:v1].to(h.dtype).T, h, out=out[v0:v1])


def _zero_targets_(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, own: torch.Tensor) -> None:
    """``x[rows[own], cols[own]] = 0`` without boolean indexing (no host sync): a flat index_add
    of ``−x`` (exact: ``a + (−a) = 0``); edges of other shards add 0 at a clamped column."""
    flat = x.view(-1)
    idx = rows * x.shape[1] + cols.clamp(0, x.shape[1] - 1)
    flat.index_add_(0, idx, torch.where(own, -flat[idx], 0.0))


@dataclass
class _Cfg:
    off: tuple[int, ...]
    chunk: int
    inv_temp: float
    group: object
    vocab_start: int
    reduce_grad_input: bool
    fused: bool
    impl: str
    vocab_block: int | None
    need_grad: bool
    entropy_grad: bool


def _forward_chunk_torch(h, weight, tok_l, rows, cfg, lse, ent, a, a_ent):
    """Statistics and ``A`` (``Aᴴ``) of one row chunk from its materialized ``[n, V_local]`` logits
    (compute dtype); returns the target logits ``s[row, tok]`` (0 for other shards)."""
    n, vl = h.shape[0], weight.shape[0]
    cdtype = lse.dtype
    group, inv_temp = cfg.group, cfg.inv_temp
    tp = group is not None and dist.get_world_size(group) > 1
    z = _mm(h, weight.T, cdtype)  # [n, V_local]: the chunk buffer
    own = (tok_l >= 0) & (tok_l < vl)
    tgt = torch.where(own, z[rows, tok_l.clamp(0, vl - 1)], 0.0)
    if inv_temp != 1.0:
        tgt = tgt * inv_temp
    if cfg.fused and not tp:
        m, se, es = _fused_kernels()[0](z, inv_temp)
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        z.sub_(m[:, None])
    else:
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        m = _all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
        z.sub_(m[:, None])  # s − m
        se, es = torch.empty(n, dtype=cdtype, device=z.device), torch.empty(n, dtype=cdtype, device=z.device)
        blk = -(-n // _ROW_BLOCKS)
        for b0 in range(0, n, blk):
            e = torch.exp(z[b0:b0 + blk])  # [blk, V_local] temporary
            se[b0:b0 + blk] = e.sum(-1)
            es[b0:b0 + blk] = torch.xlogy(e, e, out=e).sum(-1)  # Σ e·(s − m)
            del e
    red = _all_reduce(torch.cat([se, es, tgt]), dist.ReduceOp.SUM, group)
    se, es, tgt = red[:n], red[n:2 * n], red[2 * n:]
    lse[:] = m + torch.log(se)
    ent[:] = torch.log(se) - es / se  # H = lse − Σ p s
    if a is None:  # no gradient wanted: statistics only
        return tgt
    z.sub_(torch.log(se)[:, None])  # log p
    blk = -(-n // _ROW_BLOCKS)
    for b0 in range(0, n, blk):
        b1 = min(b0 + blk, n)
        lp = z[b0:b1]
        p = torch.exp(lp)  # [blk, V_local] temporary
        sel = (rows >= b0) & (rows < b1)  # the block's edges (rows sorted: a contiguous range)
        _zero_targets_(p, torch.where(sel, rows - b0, 0), tok_l, own & sel)
        _accumulate_mm(a[b0:b1], p, weight)
        if a_ent is not None:
            q = p.mul_(lp.add_(ent[b0:b1, None]))  # p (log p + H), targets still 0
            _accumulate_mm(a_ent[b0:b1], q, weight)
        del p, lp
    return tgt


def _forward_chunk_triton(h, weight, row_ptr, tok_l, tgt, cfg, lse, ent, a, a_ent, inv_t, ref=None, scale=None):
    from harts import lm_head_triton as tri

    e, pm, ps, pq = tri.logit_tiles(h, weight, row_ptr, tok_l, tgt, inv_t, store_e=a is not None, ref=ref)
    if ref is not None:  # E relative to the rows' target logits: P = scale · E, so A = scale · (E W)
        tri.combine_tiles(pm, ps, pq, lse=lse, ent=ent, e=e, ref=ref, scale=scale)
        _product_into(a, e, weight)
        return
    group = cfg.group
    if group is not None and dist.get_world_size(group) > 1:
        m, se, es = tri.combine_tiles(pm, ps, pq)
        mg = _all_reduce(m.clone(), dist.ReduceOp.MAX, group)
        scale = torch.exp(m - mg)
        es = scale * (es + (m - mg) * se)  # Σ e^{s − mg} (s − mg) of this shard
        se = scale * se
        red = _all_reduce(torch.cat([se, es]), dist.ReduceOp.SUM, group)
        se, es, m = red[:h.shape[0]], red[h.shape[0]:], mg
        lse[:] = m + torch.log(se)
        ent[:] = torch.log(se) - es / se
    else:
        tri.combine_tiles(pm, ps, pq, lse=lse, ent=ent)  # one kernel writes lse and H
    if a is None:
        return
    _product_into(a, tri.scale_tiles(e, pm, lse, ent), weight)  # A = P W, cuBLAS, fp32 out
    if a_ent is not None:
        _product_into(a_ent, tri.scale_tiles(e, pm, lse, ent, entropy=True), weight)


def _product_into(out: torch.Tensor, p: torch.Tensor, weight: torch.Tensor) -> None:
    """``out = p @ weight`` for a zeroed fp32 ``out``: accumulated in place where cuBLAS allows an
    fp32 output of bf16/fp16 operands (no temporary, no copy), else computed and copied."""
    if out.is_contiguous() and _use_inplace_accumulation(p, weight):
        _addmm_fp32_(out, p, weight)
    else:
        out.copy_(_mm(p, weight, out.dtype))


class _TreeHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, e_child, e_parent, e_tok, row_ptr, cfg: _Cfg):
        t, hd = hidden.shape
        off, chunk, group = cfg.off, cfg.chunk, cfg.group
        tp = group is not None and dist.get_world_size(group) > 1
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        dev = hidden.device
        lse = torch.empty(t, dtype=cdtype, device=dev)
        ent = torch.empty(t, dtype=cdtype, device=dev)
        logp = torch.zeros(t, dtype=cdtype, device=dev)
        tok_l = (e_tok - cfg.vocab_start).to(torch.int32 if cfg.impl == "triton" else torch.int64)
        # A = P W (and Aᴴ): the part of dh that needs the whole row's probabilities, saved in fp32
        a = torch.zeros(t, hd, dtype=cdtype, device=dev) if cfg.need_grad else None
        a_ent = torch.zeros(t, hd, dtype=cdtype, device=dev) if cfg.need_grad and cfg.entropy_grad else None
        tgt = torch.zeros(e_child.numel(), dtype=cdtype, device=dev)
        inv_t = torch.full((1,), cfg.inv_temp, dtype=cdtype, device=dev)
        # Triton, unsharded, no entropy gradient: E relative to each row's target logit, so one factor
        # per row (applied in the backward's dh) replaces the per-tile rescaling pass over E
        ref = scale = None
        if _ROW_REFERENCE and cfg.impl == "triton" and a is not None and a_ent is None and not tp:
            from harts import lm_head_triton as tri

            ref = tri.target_logit_max(hidden, weight, row_ptr, tok_l, inv_t)
            scale = torch.empty(t, dtype=cdtype, device=dev)
        for r0, r1 in _row_chunks(t, chunk):
            a0, a1 = off[r0], off[r1]
            if cfg.impl == "triton":
                _forward_chunk_triton(hidden[r0:r1], weight, row_ptr[r0:], tok_l, tgt, cfg, lse[r0:r1], ent[r0:r1],
                                      None if a is None else a[r0:r1], None if a_ent is None else a_ent[r0:r1], inv_t,
                                      None if ref is None else ref[r0:r1], None if scale is None else scale[r0:r1])
                if tp:
                    _all_reduce(tgt[a0:a1], dist.ReduceOp.SUM, group)
            else:
                tgt[a0:a1] = _forward_chunk_torch(hidden[r0:r1], weight, tok_l[a0:a1], e_parent[a0:a1] - r0, cfg,
                                                  lse[r0:r1], ent[r0:r1], None if a is None else a[r0:r1],
                                                  None if a_ent is None else a_ent[r0:r1])
        logp[e_child] = tgt - lse[e_parent]  # every edge at once (fewer launches than per chunk)
        ctx.save_for_backward(hidden, weight, e_child, e_parent, tok_l, row_ptr, lse, ent, tgt)
        ctx.cfg = cfg
        ctx.a, ctx.a_ent, ctx.scale = a, a_ent, scale  # consumed (freed) by the backward
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, e_child, e_parent, tok_l, row_ptr, lse, ent, tgt = ctx.saved_tensors
        cfg = ctx.cfg
        if ctx.a is None:
            raise RuntimeError("tree_lm_head: no saved A (the backward ran twice, or the forward ran without grad)")
        a, a_ent, scale = ctx.a, ctx.a_ent, ctx.scale
        ctx.a = ctx.a_ent = ctx.scale = None  # freed as soon as dh is formed
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or hidden.shape[0] == 0:
            return (torch.zeros_like(hidden) if want_dh else None, torch.zeros_like(weight) if want_dw else None,
                    None, None, None, None, None)
        t, vl = hidden.shape[0], weight.shape[0]
        cdtype = lse.dtype
        group = cfg.group
        tp = group is not None and dist.get_world_size(group) > 1
        g_edge = g_logp[e_child].to(cdtype) if g_logp is not None else torch.zeros_like(tgt)
        # contiguous: the gradient of ent.sum() arrives expanded (stride 0), and the kernels index it by row
        g_ent = g_ent.to(cdtype).contiguous() if g_ent is not None else None
        if g_ent is None:
            a_ent = None
        inv_t = torch.full((1,), cfg.inv_temp, dtype=cdtype, device=hidden.device)
        # dh from A, the fp32 coefficients of the targets and the gathered target rows of W
        if cfg.impl == "triton":
            from harts import lm_head_triton as tri

            gsum = torch.empty(t, dtype=cdtype, device=hidden.device)
            dh = a if (tp and cfg.reduce_grad_input) else torch.empty_like(hidden)
            tri.hidden_grad(a, a_ent, lse, ent, g_ent, row_ptr, tok_l, g_edge, tgt, weight, inv_t, dh, gsum, scale)
        else:
            gsum = torch.zeros(t, dtype=cdtype, device=hidden.device).index_add_(0, e_parent, g_edge)
            dh = _hidden_grad_torch(a, a_ent, gsum, g_edge, g_ent, e_parent, tok_l, tgt, lse, ent, weight, cfg)
        if tp and cfg.reduce_grad_input:
            _all_reduce(dh, dist.ReduceOp.SUM, group)
        dh = dh.to(hidden.dtype) if want_dh else None
        del a, a_ent  # the fp32 [T, H] buffers go before dW is allocated
        if not want_dw:
            return dh, None, None, None, None, None, None
        # dW per vocabulary block: one GEMM over all rows, one rounding
        dw = torch.empty_like(weight)
        if cfg.impl == "triton":
            vb = _triton_vocab_block(t, vl, cfg.chunk, cfg.vocab_block)
            buf = torch.empty(t, vb, dtype=hidden.dtype, device=hidden.device)
            for b0 in range(0, vl, vb):
                b1 = min(b0 + vb, vl)
                dz = tri.logit_grad(hidden, weight[b0:b1], b0, lse, gsum, g_ent, ent, row_ptr, tok_l, g_edge, inv_t,
                                    buf[:, :b1 - b0])
                _grad_weight_block(dz, hidden, dw[b0:b1])
        else:
            vb = max(1, min(vl, cfg.chunk * vl // t))  # a [T, vb] block has <= chunk·V_local elements
            for b0 in range(0, vl, vb):
                b1 = min(b0 + vb, vl)
                z = _mm(hidden, weight[b0:b1].T, cdtype)  # [T, vb]: the block buffer
                _dz_block_torch(z, lse, gsum, g_ent, ent, cfg)
                inb = (tok_l >= b0) & (tok_l < b1)
                z.view(-1).index_add_(0, e_parent * (b1 - b0) + (tok_l - b0).clamp(0, b1 - b0 - 1),
                                      torch.where(inb, g_edge, 0.0))  # the targets' Σ_c g_c e_{x_c}
                if cfg.inv_temp != 1.0:
                    z.mul_(cfg.inv_temp)
                _grad_weight_block(z, hidden, dw[b0:b1])
                del z
        return dh, dw, None, None, None, None, None


def _hidden_grad_torch(a, a_ent, gsum, g_edge, g_ent, e_parent, tok_l, tgt, lse, ent, weight, cfg):
    """``dh = (Σ_c coef_c W[x_c] − G A − g^H Aᴴ) / τ`` in place in ``a`` (before any TP sum)."""
    vl = weight.shape[0]
    lp = tgt - lse[e_parent]
    p = torch.exp(lp)
    coef = g_edge - gsum[e_parent] * p
    a.mul_(-gsum[:, None])
    if a_ent is not None:
        coef = coef - g_ent[e_parent] * p * (lp + ent[e_parent])
        a.addcmul_(a_ent, g_ent[:, None], value=-1.0)
    coef = torch.where((tok_l >= 0) & (tok_l < vl), coef, 0.0)
    tk = tok_l.clamp(0, vl - 1)
    for c0 in range(0, e_parent.numel(), cfg.chunk):  # gathered rows of W, [chunk, H] at a time
        c1 = c0 + cfg.chunk
        a.index_add_(0, e_parent[c0:c1], weight[tk[c0:c1]].to(a.dtype) * coef[c0:c1, None])
    return a.mul_(cfg.inv_temp)


def _dz_block_torch(z, lse, gsum, g_ent, ent, cfg):
    """Overwrite the logits block ``z [T, nb]`` with ``−p ⊙ (G + g^H (log p + H))``."""
    inv_temp = cfg.inv_temp
    if cfg.fused:
        _fused_kernels()[1](z, lse, gsum, g_ent, ent, inv_temp)
        return
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    z.sub_(lse[:, None])  # log p
    if g_ent is None:
        z.exp_().mul_(-gsum[:, None])
        return
    n = z.shape[0]
    blk = -(-n // _ROW_BLOCKS)  # p and log p together, over row blocks
    for b0 in range(0, n, blk):
        b1 = min(b0 + blk, n)
        q = z[b0:b1]
        p = torch.exp(q)  # [blk, nb] temporary
        gh = g_ent[b0:b1]
        c = gh * ent[b0:b1] + gsum[b0:b1]  # G + g^H H
        q.mul_(-gh[:, None]).sub_(c[:, None]).mul_(p)  # −(g^H log p + G + g^H H) p
        del p, q


def _triton_vocab_block(t: int, vl: int, chunk: int, vocab_block: int | None = None) -> int:
    """Backward vocabulary block of the Triton path: ``vocab_block`` columns if given, else the
    widest multiple of 256 columns whose ``[T, block]`` dz buffer holds at most 2048 × 16,384
    elements (64 MiB in bf16), at least 2048 columns: 2048 at T = 16,384 rows, 7,936 at 4,099 rows
    (20 blocks of ``V = 151,936`` instead of 75: each block costs a Triton launch and a GEMM
    launch on the host, whatever its size). Either way capped so that the block holds no more
    than a forward chunk ``[chunk, V_local]``."""
    vb = vocab_block or max(_TRITON_VOCAB_BLOCK, _TRITON_DZ_ELEMS // max(t, 1) // 256 * 256)
    cap = max(128, (chunk * vl // max(t, 1)) // 128 * 128)
    return max(1, min(vb, cap, vl))


def _triton_usable(hidden: torch.Tensor, weight: torch.Tensor, explicit: bool = False) -> bool:
    """bf16/fp16 CUDA operands of one dtype; under Triton's CPU interpreter (``TRITON_INTERPRET=1``)
    an explicit ``impl="triton"`` also takes CPU tensors of any float dtype (the kernel tests)."""
    import os

    if weight.dtype != hidden.dtype:
        return False
    if explicit and not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
        return hidden.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    if not hidden.is_cuda or hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tree_lm_head(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, *,
                 chunk_size: int = 1024, temperature: float = 1.0, tp_group=None, vocab_start: int | None = None,
                 entropy_requires_grad: bool = False, reduce_grad_input: bool = True,
                 edges: HeadEdges | None = None, fused: bool = False, impl: str = "auto",
                 vocab_block: int | None = None) -> TreeHeadOutput:
    """Edge log-probs and entropies of a (tree-)packed row, without ``[T, V]`` logits.

    Args:
        hidden: ``[T, H]`` final hidden states (replicated over TP ranks).
        weight: ``[V_local, H]`` output-layer shard (vocab-parallel under TP).
        tokens, parent: ``[T]`` token id and parent row of each compact node (``parent < 0``:
            no incoming edge, log-prob 0).
        chunk_size: rows per forward chunk (a last one shorter than ``chunk_size / 8`` joins the one
            before it, which then has up to ⅛ more rows): the forward holds ``[chunk_size, V_local]`` values (the
            model dtype on the Triton path, the compute dtype on the torch path, whose backward
            blocks hold as many); the forward also saves ``A [T, H]`` in fp32 (two with a
            differentiable entropy), freed by the backward.
        temperature: τ, logits are divided by it.
        tp_group: tensor-parallel group holding the vocab shards (None: unsharded).
        vocab_start: first vocab id of this shard (default ``rank · V_local``).
        entropy_requires_grad: let gradients flow through the entropy (else it is detached).
        reduce_grad_input: all-reduce ``dhidden`` over ``tp_group`` (set False when the caller's
            sequence-parallel gather already reduce-scatters it).
        edges: :func:`head_edges` of ``(tokens, parent)`` built ahead (default: built here, one
            device-to-host copy).
        fused: torch path: run the per-chunk softmax statistics and the logit gradient as
            ``torch.compile``-d kernels (compiled on first use). Selects the torch path under
            ``impl="auto"``.
        impl: ``"triton"`` (bf16/fp16 on CUDA; kernels autotuned on first use per shape),
            ``"torch"``, or ``"auto"``: Triton where it applies and ``fused`` is off, else torch.
        vocab_block: vocabulary columns per backward block on the Triton path (default: 2048 at
            16,384 rows, wider for fewer rows so that ``[T, block]`` stays at 32 Mi elements;
            capped so that it stays within a forward chunk).

    Returns:
        ``(logp [T], entropy [T])`` in fp32 (fp64 for fp64 inputs).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if tokens.shape != (hidden.shape[0],) or parent.shape != (hidden.shape[0],):
        raise ValueError(f"tokens/parent must be [{hidden.shape[0]}], got {tuple(tokens.shape)}, {tuple(parent.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if vocab_block is not None and vocab_block < 1:
        raise ValueError(f"vocab_block must be >= 1, got {vocab_block}")
    if impl == "auto":
        impl = "triton" if not fused and _triton_usable(hidden, weight) else "torch"
    elif impl == "triton" and not _triton_usable(hidden, weight, explicit=True):
        raise ValueError(f"impl='triton' needs bf16/fp16 hidden and weight of one dtype on CUDA, got "
                         f"{hidden.dtype}/{weight.dtype} on {hidden.device}")
    if vocab_start is None:
        vocab_start = weight.shape[0] * (dist.get_rank(tp_group) if tp_group is not None else 0)
    if edges is None:
        edges = head_edges(tokens, parent)
    elif len(edges.offsets) != hidden.shape[0] + 1:
        raise ValueError(f"edges were built for {len(edges.offsets) - 1} rows, hidden has {hidden.shape[0]}")
    row_ptr = edges.row_ptr
    if row_ptr is None or row_ptr.device != hidden.device:  # one non-blocking copy (a pageable one waits for the GPU)
        from harts.upload import upload

        row_ptr = upload([np.asarray(edges.offsets)], hidden.device)[0].to(torch.int32)
    cfg = _Cfg(off=edges.offsets, chunk=chunk_size, inv_temp=1.0 / temperature, group=tp_group,
               vocab_start=vocab_start, reduce_grad_input=reduce_grad_input, fused=fused, impl=impl,
               vocab_block=vocab_block, entropy_grad=entropy_requires_grad,
               need_grad=torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
    logp, ent = _TreeHead.apply(hidden, weight, edges.child, edges.parent, edges.token, row_ptr, cfg)
    if not entropy_requires_grad:
        ent = ent.detach()
    return TreeHeadOutput((logp, ent))
