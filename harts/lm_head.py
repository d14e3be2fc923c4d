"""Tree-aware chunked LM head: edge log-probs and row entropies without materializing [T, V].

For compact rows ``u`` (hidden ``h_u``) and vocabulary-parallel weight shard ``W`` (rows
``[vocab_start, vocab_start + V_local)`` of the full ``[V, H]``), per chunk of rows::

    z_u = W h_u / τ,   lse_u = log Σ_j exp z_uj,   H_u = lse_u − Σ_j p_uj z_uj,
    logp[c] = z_{parent[c], x_c} − lse_{parent[c]}      for every edge parent[c] → c.

A row with k children yields k log-probs (fork labels). Only O(T) values (``lse``, ``H``) are
saved; backward recomputes each chunk's logits and forms::

    dz_u = (Σ_{c∈children(u)} g_c e_{x_c} − G_u p_u + g^H_u · (−p_u ⊙ (log p_u + H_u))) / τ,

with ``G_u = Σ_c g_c``, then ``dh = dz W`` (summed over tensor-parallel ranks) and
``dW = dzᵀ h``. Under TP the max, sum-exp, Σ p z and target logits are all-reduced per chunk.
Plain packed sequences use the same code with ``parent[v] = v − 1`` inside each sequence.

Memory: one ``[chunk, V_local]`` buffer in the compute dtype (fp32 for bf16/fp16 inputs) is alive
at a time. Forward turns it in place into ``e = exp(z − m)`` and then ``e · log e``; backward into
``log p`` and then ``dz``. The entropy gradient needs ``p`` and ``log p`` together and runs over
row blocks of ``chunk / 8`` (one ``[chunk/8, V]`` temporary). For bf16/fp16 weights ``dz`` is
rounded to the model dtype (as Megatron's own head does) in eight vocabulary slices, whose
products accumulate into the fp32 ``dh``/``dW`` in place (``addmm(out_dtype=float32, out=acc)``
on CUDA; where a build rejects that, smaller slices keep the product temporaries ≤ 1/16 chunk). Besides the chunk, backward
keeps an fp32 ``dW`` accumulator ``[V_local, H]`` (the size of Megatron's ``main_grad``) and an
fp32 ``dh [T, H]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["tree_lm_head", "TreeHeadOutput", "HeadEdges", "head_edges"]

_ENTROPY_ROW_BLOCKS = 8  # the entropy backward's temporary is [ceil(chunk / 8), V_local]
_SLICE_FRACTION = 16  # vocab slices keep [slice, H] fp32 products ≤ 1/16 of a chunk


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
                     offsets=tuple(off.tolist()))


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
    """Overwrite the logits chunk ``z`` with ``−p ⊙ (G + g^H (log p + H))`` (``−G p`` without an
    entropy gradient), ``log p = z/τ − lse``; one read and one write of the chunk once compiled."""
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
    """Columns per vocabulary slice of the chunk (a multiple of 128, at least 128).

    With in-place fp32 accumulation only the rounded ``[n, slice]`` copy is extra: 4 slices
    (≤ 1/8 of an fp32 chunk; fewer slices, fewer launches per chunk). Otherwise the ``[slice, H]`` fp32 product is too, and slices are
    sized so that it stays ≤ 1/16 and the copy ≤ 1/32 of the chunk.
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


def _accumulate_grads(dz: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, dh: torch.Tensor,
                      dw: torch.Tensor) -> None:
    """``dh += dz W`` and ``dw += dzᵀ h`` without a second ``[n, V]`` or ``[V, H]`` temporary.

    ``dz [n, V_local]`` (compute dtype), ``h [n, H]``, and the contiguous accumulators
    ``dh [n, H]``, ``dw [V_local, H]`` in the compute dtype. Low-precision weights: ``dz`` is
    rounded to the model dtype one vocabulary slice at a time.
    """
    if h.dtype == weight.dtype == dz.dtype == dw.dtype:
        dh.addmm_(dz, weight)
        dw.addmm_(dz.T, h)
        return
    vl = weight.shape[0]
    in_place = _use_inplace_accumulation(h, weight)
    step = _vocab_slice(dz.shape[0], vl, h.shape[1], in_place)
    for v0 in range(0, vl, step):
        v1 = min(v0 + step, vl)
        d = dz[:, v0:v1].to(h.dtype)  # logit gradients rounded to the model dtype, one slice at a time
        if in_place:
            _addmm_fp32_(dh, d, weight[v0:v1])
            _addmm_fp32_(dw[v0:v1], d.T, h)
        else:
            dh.add_(_mm(d, weight[v0:v1], dh.dtype))
            dw[v0:v1].add_(_mm(d.T, h, dw.dtype))


class _TreeHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, e_child, e_parent, e_tok, off, chunk, inv_temp, group, vocab_start,
                reduce_grad_input, fused):
        t = hidden.shape[0]
        vl = weight.shape[0]
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(t, dtype=cdtype, device=hidden.device)
        ent = torch.empty(t, dtype=cdtype, device=hidden.device)
        logp = torch.zeros(t, dtype=cdtype, device=hidden.device)
        zero = torch.zeros((), dtype=cdtype, device=hidden.device)
        for r0 in range(0, t, chunk):
            r1 = min(r0 + chunk, t)
            n = r1 - r0
            z = _mm(hidden[r0:r1], weight.T, cdtype)  # [n, V_local]: the only chunk buffer
            a0, a1 = off[r0], off[r1]
            rows = e_parent[a0:a1] - r0
            tl = e_tok[a0:a1] - vocab_start
            own = (tl >= 0) & (tl < vl)
            tgt = torch.where(own, z[rows, tl.clamp(0, vl - 1)], zero)
            if inv_temp != 1.0:
                tgt = tgt * inv_temp
            if fused and (group is None or dist.get_world_size(group) == 1):
                m, se, es = _fused_kernels()[0](z, inv_temp)
                del z
            else:
                if inv_temp != 1.0:
                    z.mul_(inv_temp)
                m = _all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
                e = z.sub_(m[:, None]).exp_()  # e = exp(z − m), in place
                se = e.sum(-1)
                es = torch.xlogy(e, e, out=e).sum(-1)  # Σ e·log e = Σ e·(z − m), in place
                del z, e
            red = _all_reduce(torch.cat([se, es, tgt]), dist.ReduceOp.SUM, group)
            se, es, tgt = red[:n], red[n:2 * n], red[2 * n:]
            lse[r0:r1] = m + torch.log(se)
            ent[r0:r1] = torch.log(se) - es / se  # H = lse − Σ p z
            logp[e_child[a0:a1]] = tgt - lse[e_parent[a0:a1]]
        ctx.save_for_backward(hidden, weight, e_child, e_parent, e_tok, lse, ent)
        ctx.cfg = (off, chunk, inv_temp, group, vocab_start, reduce_grad_input, fused)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, e_child, e_parent, e_tok, lse, ent = ctx.saved_tensors
        off, chunk, inv_temp, group, vocab_start, reduce_grad_input, fused = ctx.cfg
        t, vl = hidden.shape[0], weight.shape[0]
        cdtype = lse.dtype
        dh = torch.zeros(hidden.shape, dtype=cdtype, device=hidden.device)
        dw = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)
        g_edge = g_logp[e_child].to(cdtype) if g_logp is not None else None
        g_ent = g_ent.to(cdtype) if g_ent is not None else None
        for r0 in range(0, t, chunk):
            r1 = min(r0 + chunk, t)
            h = hidden[r0:r1]
            n = r1 - r0
            z = _mm(h, weight.T, cdtype)  # the only chunk buffer
            gsum = torch.zeros(n, dtype=cdtype, device=z.device)
            a0, a1 = off[r0], off[r1]
            rows = e_parent[a0:a1] - r0
            if g_edge is not None:
                g = g_edge[a0:a1]
                gsum.index_add_(0, rows, g)
            if fused:  # one read and one write of the chunk
                _fused_kernels()[1](z, lse[r0:r1], gsum, None if g_ent is None else g_ent[r0:r1], ent[r0:r1],
                                    inv_temp)
            else:
                if inv_temp != 1.0:
                    z.mul_(inv_temp)
                z.sub_(lse[r0:r1, None])  # log p
                if g_ent is None:
                    z.exp_().mul_(-gsum[:, None])  # −G p
                else:  # dz = −p ⊙ (G + g^H (log p + H)): p and log p together, over row blocks
                    blk = -(-n // _ENTROPY_ROW_BLOCKS)
                    for b0 in range(0, n, blk):
                        b1 = min(b0 + blk, n)
                        q = z[b0:b1]
                        p = torch.exp(q)  # [blk, V_local] temporary
                        gh = g_ent[r0 + b0:r0 + b1]
                        c = gh * ent[r0 + b0:r0 + b1] + gsum[b0:b1]  # G + g^H H
                        q.mul_(-gh[:, None]).sub_(c[:, None]).mul_(p)  # −(g^H log p + G + g^H H) p
                        del p, q  # q views the chunk buffer: drop it before the next chunk
            dz = z
            del z
            if g_edge is not None:
                tl = e_tok[a0:a1] - vocab_start
                own = (tl >= 0) & (tl < vl)
                # dz[row, tok] += g as one flat index_add kernel (index_put_ with accumulate launches
                # ~20: index-range checks and a sort). A trie node's children have distinct tokens,
                # so no two adds meet; edges of other vocab shards add an exact 0.
                dz.view(-1).index_add_(0, rows * vl + tl.clamp(0, vl - 1), torch.where(own, g, 0.0))
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            _accumulate_grads(dz, h, weight, dh[r0:r1], dw)
            del dz
        if reduce_grad_input:
            _all_reduce(dh, dist.ReduceOp.SUM, group)
        return (dh.to(hidden.dtype), dw.to(weight.dtype)) + (None,) * 10


def tree_lm_head(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, *,
                 chunk_size: int = 1024, temperature: float = 1.0, tp_group=None, vocab_start: int | None = None,
                 entropy_requires_grad: bool = False, reduce_grad_input: bool = True,
                 edges: HeadEdges | None = None, fused: bool = False) -> TreeHeadOutput:
    """Edge log-probs and entropies of a (tree-)packed row, chunked over rows.

    Args:
        hidden: ``[T, H]`` final hidden states (replicated over TP ranks).
        weight: ``[V_local, H]`` output-layer shard (vocab-parallel under TP).
        tokens, parent: ``[T]`` token id and parent row of each compact node (``parent < 0``:
            no incoming edge, log-prob 0).
        chunk_size: rows per chunk; peak extra memory ≈ one ``[chunk_size, V_local]`` buffer in
            fp32 (fp64 for fp64 inputs) plus, in backward, the fp32 ``dW`` accumulator.
        temperature: τ, logits are divided by it.
        tp_group: tensor-parallel group holding the vocab shards (None: unsharded).
        vocab_start: first vocab id of this shard (default ``rank · V_local``).
        entropy_requires_grad: let gradients flow through the entropy (else it is detached).
        reduce_grad_input: all-reduce ``dhidden`` over ``tp_group`` (set False when the caller's
            sequence-parallel gather already reduce-scatters it).
        edges: :func:`head_edges` of ``(tokens, parent)`` built ahead (default: built here, one
            device-to-host copy).
        fused: run the per-chunk softmax statistics and the logit gradient as ``torch.compile``-d
            kernels (one or two passes over the chunk instead of eight to ten; compiled on first
            use). Off by default. The forward statistics stay eager under TP (the max is
            all-reduced first).

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
    if vocab_start is None:
        vocab_start = weight.shape[0] * (dist.get_rank(tp_group) if tp_group is not None else 0)
    if edges is None:
        edges = head_edges(tokens, parent)
    elif len(edges.offsets) != hidden.shape[0] + 1:
        raise ValueError(f"edges were built for {len(edges.offsets) - 1} rows, hidden has {hidden.shape[0]}")
    logp, ent = _TreeHead.apply(hidden, weight, edges.child, edges.parent, edges.token, edges.offsets, chunk_size,
                                1.0 / temperature, tp_group, vocab_start, reduce_grad_input, fused)
    if not entropy_requires_grad:
        ent = ent.detach()
    return TreeHeadOutput((logp, ent))
