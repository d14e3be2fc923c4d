"""A GDN layer's recurrence over all rounds of a :class:`harts.gdn.GdnPlan` as one autograd function.

The composed path of :func:`harts.gdn.tree_gated_delta_rule` (per round: gathers of ``q, k, v, g, β``,
the start states from earlier rounds, one varlen call, the kept rows; then the permutation back to
compact order) is about 40 autograd-recorded operations per layer forward and twice that backward.
On an H200 host each costs 10–40 µs, and a 16k-token tree step of a hybrid model is host-bound
(docs/benchmarks.md, harts_gdn). :func:`tree_recurrence` runs the same operations inside one
``torch.autograd.Function`` with an explicit backward:

* forward, per round ``r`` (rows ``R_r``, kept positions ``K_r``)::

      h0_r[d] = h_T[s]  for (s → d) in init_sources,  0 elsewhere
      o_r, h_T,r = kernel(q[R_r], k[R_r], v[R_r], g[R_r], β[R_r], h0_r)
      out = cat_r(o_r[K_r])[inverse]

* backward, rounds in reverse::

      do_r  = dout_ext[grad_rows_r]          (dout with a zero row T for replayed positions)
      dh_T,r = Σ over later rounds' (s → d) of dh0[d]  (0 when no piece starts from it)
      dq[R_r] += dq_r, … ;  dh0_r → the source pieces' dh_T

It saves the layer's own ``q, k, v, g, β`` (not per-round gathered copies), the start states ``h0_r``
and what the kernel keeps for its backward (FLA: the chunk-local cumulative gate and the WY factor
``A``). With :class:`harts.gdn_graphs.RoundGraphs` the whole forward (all rounds) is one CUDA graph
and the whole backward another, captured at their second use in a microbatch and replayed by the
remaining GDN layers: a replaying layer then costs the host five input copies, one launch and the
output copies per direction. Without autograd (``no_grad``, or no input requiring a gradient: a
teacher's scoring pass) only the forward runs, nothing is saved and a replay copies out the output
alone.

Kernels: ``fla`` (FLA's ``chunk_gated_delta_rule_fwd/_bwd``, called directly: the kernels of the public
``chunk_gated_delta_rule``, GPU tests compare them bitwise) and ``torch`` (the chunked reference of
:mod:`harts.gdn_reference` per piece; its backward recomputes the piece under autograd). The torch
kernels let the CPU tests check this function's routing against the composed path in fp64.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from harts.errors import GdnConfigError
from harts.gdn_reference import chunk_gated_delta_rule_reference

__all__ = ["check_graphs_plan", "torch_pieces", "tree_recurrence"]


# ---------------------------------------------------------------------------------------------
# round kernels: fwd(q, k, v, g, beta, h0) -> (o, h_T, saved); bwd(..., saved, do, dh_T) -> grads
# ---------------------------------------------------------------------------------------------
def _fla_fwd(q, k, v, g, beta, h0, *, cu, cu_cpu, chunk_indices, scale: float, chunk_size: int):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    gc, o, a, ht, _, _ = chunk_gated_delta_rule_fwd(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=chunk_size)
    return o[0].to(q.dtype), ht, (gc, a)


def _fla_bwd(q, k, v, g, beta, h0, saved, do, dht, *, cu, cu_cpu, chunk_indices, scale: float, chunk_size: int):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    gc, a = saved
    dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
        q=q[None], k=k[None], v=v[None], g=gc, beta=beta[None], A=a, scale=scale, initial_state=h0, do=do[None],
        dht=dht, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=chunk_size)
    return dq[0], dk[0], dv[0], dg[0], db[0], dh0


def torch_pieces(q, k, v, g, beta, h0, cu_cpu, scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One varlen call on the torch reference: packed ``[n, ...]`` inputs, ``h0 [N, HV, K, V]`` →
    ``o [n, HV, V]``, ``h_T [N, HV, K, V]``, piece by piece."""
    outs, finals = [], []
    bounds = cu_cpu.tolist()
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        # fresh (aligned) buffers per piece, as a lone sequence would have: CPU matmul kernels may
        # sum in a different order for misaligned views, which would break bitwise alignment checks
        piece = [x[a:b].clone()[None] for x in (q, k, v, g, beta)]
        o, ht = chunk_gated_delta_rule_reference(*piece, chunk_size=chunk_size, scale=scale,
                                                 initial_state=h0[i:i + 1], output_final_state=True)
        outs.append(o[0])
        finals.append(ht)
    return torch.cat(outs).to(v.dtype), torch.cat(finals).to(h0.dtype)


def _torch_fwd(q, k, v, g, beta, h0, *, cu, cu_cpu, chunk_indices, scale: float, chunk_size: int):
    o, ht = torch_pieces(q, k, v, g, beta, h0, cu_cpu, scale, chunk_size)
    return o, ht, ()


def _torch_bwd(q, k, v, g, beta, h0, saved, do, dht, *, cu, cu_cpu, chunk_indices, scale: float, chunk_size: int):
    xs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    with torch.enable_grad():
        o, ht = torch_pieces(*xs, cu_cpu, scale, chunk_size)
        return torch.autograd.grad((o, ht), xs, (do, dht))


_KERNELS = {"fla": (_fla_fwd, _fla_bwd, 2), "torch": (_torch_fwd, _torch_bwd, 0)}


# ---------------------------------------------------------------------------------------------
# the recurrence over all rounds, without autograd
# ---------------------------------------------------------------------------------------------
def _round_kw(rd, scale: float, chunk_size: int) -> dict:
    return {"cu": rd.cu_seqlens, "cu_cpu": rd.cu_seqlens_cpu, "chunk_indices": rd.chunk_indices, "scale": scale,
            "chunk_size": chunk_size}


def _state_shape(rd, v: torch.Tensor, kd: int) -> tuple[int, ...]:
    return (rd.cu_seqlens_cpu.numel() - 1, v.shape[1], kd, v.shape[2])


def _forward(q, k, v, g, beta, *, plan, kernels: str, scale: float, state_dtype: torch.dtype):
    """``(out [T, HV, V], h0 of every round…, what the kernel saved for every round…)``."""
    fwd = _KERNELS[kernels][0]
    states, kept, h0s, saved = [], [], [], []
    for rd in plan.rounds:
        h0 = q.new_zeros(_state_shape(rd, v, q.shape[2]), dtype=state_dtype)
        for sr, si, di in rd.init_sources:
            h0.index_copy_(0, di, states[sr].index_select(0, si))
        xs = (q, k, v, g, beta) if plan.identity else [x.index_select(0, rd.rows) for x in (q, k, v, g, beta)]
        o, ht, sv = fwd(*xs, h0, **_round_kw(rd, scale, plan.chunk_size))
        states.append(ht.to(state_dtype))
        h0s.append(h0)
        saved.extend(sv)
        kept.append(o if plan.identity else o.index_select(0, rd.keep))
    out = kept[0] if plan.identity else torch.cat(kept).index_select(0, plan.inverse)
    return (out, *h0s, *saved)


def _forward_output(q, k, v, g, beta, **kw):
    """``(out,)`` of :func:`_forward`: without autograd nothing else needs to outlive the call."""
    return (_forward(q, k, v, g, beta, **kw)[0],)


def _backward(q, k, v, g, beta, dout, *rest, plan, kernels: str, scale: float, state_dtype: torch.dtype):
    """``(dq, dk, dv, dg, dbeta)`` of :func:`_forward`'s ``out`` given ``dout``; ``rest``: its other outputs."""
    _, bwd, n_saved = _KERNELS[kernels]
    n = len(plan.rounds)
    h0s, flat = rest[:n], rest[n:]
    inputs = (q, k, v, g, beta)
    grads = None if plan.identity else [torch.zeros_like(x) for x in inputs]
    dext = dout if plan.identity else torch.cat([dout, dout.new_zeros(1, *dout.shape[1:])])
    dstates: list[torch.Tensor | None] = [None] * n
    for r in reversed(range(n)):
        rd = plan.rounds[r]
        xs = inputs if plan.identity else [x.index_select(0, rd.rows) for x in inputs]
        do = dext if plan.identity else dext.index_select(0, rd.grad_rows)
        dht = dstates[r]
        if dht is None:  # no piece starts from this round's final states
            dht = q.new_zeros(_state_shape(rd, v, q.shape[2]), dtype=state_dtype)
        d = bwd(*xs, h0s[r], tuple(flat[r * n_saved:(r + 1) * n_saved]), do, dht,
                **_round_kw(rd, scale, plan.chunk_size))
        if plan.identity:
            return tuple(di.to(x.dtype) for di, x in zip(d[:5], inputs))
        for acc, di in zip(grads, d[:5]):
            acc.index_add_(0, rd.rows, di.to(acc.dtype))
        for sr, si, di in rd.init_sources:
            if dstates[sr] is None:
                dstates[sr] = q.new_zeros(_state_shape(plan.rounds[sr], v, q.shape[2]), dtype=state_dtype)
            dstates[sr].index_add_(0, si, d[5].index_select(0, di))
    return tuple(grads)


def _call(direction: str, fn, kw: dict, graphs, *, keep_outputs: bool = True):
    """``fn`` bound to ``kw``, graphed in ``graphs`` under ``direction`` unless ``graphs`` is None."""
    bound = functools.partial(fn, **kw)
    if graphs is None:
        return bound
    key = (direction, kw["kernels"], kw["scale"], kw["state_dtype"])
    return graphs.call(key, bound, keep_outputs=keep_outputs)


class _Recurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, plan, kernels, graphs, scale, state_dtype):
        kw = {"plan": plan, "kernels": kernels, "scale": scale, "state_dtype": state_dtype}
        out, *rest = _call("forward", _forward, kw, graphs)(q, k, v, g, beta)
        ctx.save_for_backward(q, k, v, g, beta, *rest)
        ctx.kw, ctx.graphs = kw, graphs
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, g, beta, *rest = ctx.saved_tensors
        # the gradients are read by the layer's next backward nodes before any later replay (they
        # depend on them): no copies out of the graph
        bwd = _call("backward", _backward, ctx.kw, ctx.graphs, keep_outputs=False)
        return (*bwd(q, k, v, g, beta, dout.contiguous(), *rest), None, None, None, None, None)


def tree_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                    plan, kernels: str = "fla", graphs=None, scale: float | None = None,
                    state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gated delta rule over the forest of ``plan`` (``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, β [T, HV]``
    → ``o [T, HV, V]``), the rounds in one autograd function; inputs are validated by
    :func:`harts.gdn.tree_gated_delta_rule`, which calls this for the FLA backend. ``graphs``: the
    microbatch's :class:`harts.gdn_graphs.RoundGraphs` (``None``: eager)."""
    if kernels not in _KERNELS:
        raise GdnConfigError(f"kernels must be one of {tuple(_KERNELS)}, got {kernels!r}")
    check_graphs_plan(graphs, plan)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = [x.contiguous() for x in (q, k, v, g, beta)]
    if torch.is_grad_enabled() and any(x.requires_grad for x in args):
        return _Recurrence.apply(*args, plan, kernels, graphs, scale, state_dtype)
    # inference (e.g. a teacher's scoring pass): no saved tensors, a replay copies out the output only
    kw = {"plan": plan, "kernels": kernels, "scale": scale, "state_dtype": state_dtype}
    return _call("inference", _forward_output, kw, graphs)(*args)[0]


def check_graphs_plan(graphs, plan) -> None:
    """:class:`GdnConfigError` unless ``graphs`` (a :class:`harts.gdn_graphs.RoundGraphs` or None) is ``plan``'s."""
    if graphs is not None and graphs.plan is not plan:
        raise GdnConfigError("graphs were built for another plan: create one RoundGraphs(plan) per microbatch")
