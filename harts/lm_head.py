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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["tree_lm_head", "TreeHeadOutput"]


class TreeHeadOutput(tuple):
    """``(logp [T], entropy [T])``; ``logp`` is 0 at roots."""

    @property
    def logp(self) -> torch.Tensor:
        return self[0]

    @property
    def entropy(self) -> torch.Tensor:
        return self[1]


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


class _TreeHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, e_child, e_parent, e_tok, e_off, chunk, inv_temp, group, vocab_start,
                reduce_grad_input):
        t = hidden.shape[0]
        vl = weight.shape[0]
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(t, dtype=cdtype, device=hidden.device)
        ent = torch.empty(t, dtype=cdtype, device=hidden.device)
        logp = torch.zeros(t, dtype=cdtype, device=hidden.device)
        off = e_off.tolist()
        for r0 in range(0, t, chunk):
            r1 = min(r0 + chunk, t)
            z = _mm(hidden[r0:r1], weight.T, cdtype)  # [n, V_local]: chunk buffer 1
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            a0, a1 = off[r0], off[r1]
            rows = e_parent[a0:a1] - r0
            tl = e_tok[a0:a1] - vocab_start
            own = (tl >= 0) & (tl < vl)
            tgt = torch.where(own, z[rows, tl.clamp(0, vl - 1)], torch.zeros((), dtype=cdtype, device=z.device))
            m = _all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
            z.sub_(m[:, None])  # s = z − m
            e = torch.exp(z)  # chunk buffer 2
            se = e.sum(-1)
            es = e.mul_(z).sum(-1)  # Σ e·s
            del e, z
            n = r1 - r0
            red = _all_reduce(torch.cat([se, es, tgt]), dist.ReduceOp.SUM, group)
            se, es, tgt = red[:n], red[n:2 * n], red[2 * n:]
            lse[r0:r1] = m + torch.log(se)
            ent[r0:r1] = torch.log(se) - es / se  # H = lse − Σ p z
            logp[e_child[a0:a1]] = tgt - lse[e_parent[a0:a1]]
        ctx.save_for_backward(hidden, weight, e_child, e_parent, e_tok, e_off, lse, ent)
        ctx.cfg = (chunk, inv_temp, group, vocab_start, reduce_grad_input)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, e_child, e_parent, e_tok, e_off, lse, ent = ctx.saved_tensors
        chunk, inv_temp, group, vocab_start, reduce_grad_input = ctx.cfg
        t, vl = hidden.shape[0], weight.shape[0]
        cdtype = lse.dtype
        dh = torch.zeros(hidden.shape, dtype=cdtype, device=hidden.device)
        dw = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)
        off = e_off.tolist()
        g_edge = g_logp[e_child].to(cdtype) if g_logp is not None else None
        for r0 in range(0, t, chunk):
            r1 = min(r0 + chunk, t)
            h = hidden[r0:r1]
            n = r1 - r0
            z = _mm(h, weight.T, cdtype)  # chunk buffer 1
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            z.sub_(lse[r0:r1, None])  # log p
            p = torch.exp(z)  # chunk buffer 2
            gsum = torch.zeros(n, dtype=cdtype, device=z.device)
            if g_edge is not None:
                a0, a1 = off[r0], off[r1]
                rows = e_parent[a0:a1] - r0
                g = g_edge[a0:a1]
                gsum.index_add_(0, rows, g)
            if g_ent is not None:  # dz = −p ⊙ (G + g^H (log p + H)), built in place
                z.add_(ent[r0:r1, None]).mul_(g_ent[r0:r1, None].to(cdtype)).add_(gsum[:, None])
                dz = p.mul_(z).neg_()
            else:
                dz = p.mul_(-gsum[:, None])
            del z
            if g_edge is not None:
                tl = e_tok[a0:a1] - vocab_start
                own = (tl >= 0) & (tl < vl)
                dz.index_put_((rows[own], tl[own]), g[own], accumulate=True)
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            if _low_precision_cuda(h, weight):
                dz = dz.to(h.dtype)  # logit gradients in the model dtype, as Megatron's own head
            dh[r0:r1] = _mm(dz, weight, cdtype)
            dw += _mm(dz.T, h, cdtype)
        if reduce_grad_input:
            _all_reduce(dh, dist.ReduceOp.SUM, group)
        return (dh.to(hidden.dtype), dw.to(weight.dtype), None, None, None, None, None, None, None, None, None)


def tree_lm_head(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, *,
                 chunk_size: int = 1024, temperature: float = 1.0, tp_group=None, vocab_start: int | None = None,
                 entropy_requires_grad: bool = False, reduce_grad_input: bool = True) -> TreeHeadOutput:
    """Edge log-probs and entropies of a (tree-)packed row, chunked over rows.

    Args:
        hidden: ``[T, H]`` final hidden states (replicated over TP ranks).
        weight: ``[V_local, H]`` output-layer shard (vocab-parallel under TP).
        tokens, parent: ``[T]`` token id and parent row of each compact node (``parent < 0``:
            no incoming edge, log-prob 0).
        chunk_size: rows per chunk; peak extra memory ≈ 2 · chunk_size · V_local fp32 values
            (two chunk buffers, in forward and in backward).
        temperature: τ, logits are divided by it.
        tp_group: tensor-parallel group holding the vocab shards (None: unsharded).
        vocab_start: first vocab id of this shard (default ``rank · V_local``).
        entropy_requires_grad: let gradients flow through the entropy (else it is detached).
        reduce_grad_input: all-reduce ``dhidden`` over ``tp_group`` (set False when the caller's
            sequence-parallel gather already reduce-scatters it).

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
    t = hidden.shape[0]
    child = torch.nonzero(parent >= 0).squeeze(1)
    order = torch.argsort(parent[child], stable=True)
    e_child = child[order]
    e_parent = parent[e_child]
    e_tok = tokens[e_child]
    e_off = torch.searchsorted(e_parent, torch.arange(t + 1, device=parent.device))
    logp, ent = _TreeHead.apply(hidden, weight, e_child, e_parent, e_tok, e_off, chunk_size, 1.0 / temperature,
                                tp_group, vocab_start, reduce_grad_input)
    if not entropy_requires_grad:
        ent = ent.detach()
    return TreeHeadOutput((logp, ent))
